#!/usr/bin/env bash
# Install a MaxText release (0.2.5 unless MAXTEXT_VERSION says another: 0.2.3, 0.2.4 install
# alike) into its own virtual environment: for the benchmarks in bench/, and for the MaxText
# gate (`make maxtext-envs`: 0.2.3 and 0.2.5 in .venv-maxtext-<version>).
# MaxText is never a dependency of the project: its wheel goes in with --no-deps, next to exactly
# the packages that the imports listed below need (bench/maxtext/requirements.txt, pinned).
#
#   bench/maxtext/install.sh                  # -> bench/.venv-maxtext, checks the pipeline imports
#   bench/maxtext/install.sh MODULE...        # also check that these modules import
#   MAXTEXT_VENV=/path bench/maxtext/install.sh   # another location
#   MAXTEXT_VERSION=0.2.3 MAXTEXT_VENV=.venv-maxtext-0.2.3 bench/maxtext/install.sh
#   PYTHON=/path/to/python3.12 bench/maxtext/install.sh
#
# Run MaxText code with `DECOUPLE_GCLOUD=TRUE $MAXTEXT_VENV/bin/python ...` (CPU, no cloud).
# Idempotent: a second run finds the environment built and its imports checked (once per install
# and module list). Prints the environment's python on success.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${MAXTEXT_VENV:-$root/bench/.venv-maxtext}
version=${MAXTEXT_VERSION:-0.2.5}
case "$version" in 0.2.3|0.2.4|0.2.5) ;; *) echo "install.sh: MaxText $version: not a release this project maps (0.2.3, 0.2.4, 0.2.5)" >&2; exit 2 ;; esac
python=${PYTHON:-$("$root/.ci/find-python" python3.12)}
modules=(maxtext.layers.pipeline maxtext.models.llama2 maxtext.configs.pyconfig "$@")

if [ ! -f "$venv/.installed" ] || [ "$here/requirements.txt" -nt "$venv/.installed" ] \
    || [ "$(cat "$venv/.installed")" != "$version" ]; then
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # --no-compile: pip byte-compiles module by module (about 60 of the 90 s an environment
  # took); compileall does it in parallel (~25 s). Compiled once here, because where
  # PYTHONDONTWRITEBYTECODE is set no import writes a .pyc, and every MaxText worker would
  # compile its imports again (13 s -> 4.5 s per worker). Files that do not compile are skipped.
  "$venv/bin/python" -m pip install --quiet --no-compile --no-deps -r "$here/requirements.txt"
  "$venv/bin/python" -m pip install --quiet --no-compile --no-deps "maxtext==$version"
  "$venv/bin/python" -m compileall -q -j 0 \
    "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true
  echo "$version" > "$venv/.installed"
fi
# The imports are checked once per install and module list (each MaxText import takes seconds:
# re-checking both environments on every `make test` took 55.6 s): the stamp records what passed.
checked="$venv/.imports-checked"
if [ ! -f "$checked" ] || [ "$venv/.installed" -nt "$checked" ] || ! "$venv/bin/python" -c '' \
    || [ "$(cat "$checked")" != "${modules[*]}" ]; then
  rm -f "$checked"
  for module in "${modules[@]}"; do
    DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu "$venv/bin/python" -c "import $module" >/dev/null 2>&1 || {
      echo "install.sh: 'import $module' fails in $venv; the error:" >&2
      DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu "$venv/bin/python" -c "import $module" 2>&1 | tail -3 >&2
      echo "add the missing package (pinned) to $here/requirements.txt and rerun" >&2
      exit 1
    }
  done
  echo "${modules[*]}" > "$checked"
fi
echo "$venv/bin/python"
