#!/usr/bin/env bash
# Install a MaxText release (0.2.5 unless MAXTEXT_VERSION says another: 0.2.3, 0.2.4 install
# alike) into its own virtual environment, for the benchmarks in bench/: the recipe of
# `python -m parity.maxtext.build_envs` (MaxText's wheel with --no-deps beside exactly the
# pinned packages its imports need, parity/maxtext/requirements.txt), which `make maxtext-envs`
# and users' own installs run too.
#
#   bench/maxtext/install.sh                  # -> bench/.venv-maxtext, checks the pipeline imports
#   bench/maxtext/install.sh MODULE...        # also check that these modules import
#   MAXTEXT_VENV=/path bench/maxtext/install.sh   # another location
#   MAXTEXT_VERSION=0.2.3 MAXTEXT_VENV=.venv-maxtext-0.2.3 bench/maxtext/install.sh
#   PYTHON=/path/to/python3.12 bench/maxtext/install.sh
#
# Run MaxText code with `DECOUPLE_GCLOUD=TRUE $MAXTEXT_VENV/bin/python ...` (CPU, no cloud).
# Idempotent. Prints the environment's python on success.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${MAXTEXT_VENV:-$root/bench/.venv-maxtext}
python=${PYTHON:-$("$root/.ci/find-python" python3.12)}
check=()
[ $# -eq 0 ] || check=(--check "$@")
PYTHONPATH="$root" "$python" -m parity.maxtext.build_envs --python "$python" \
  --venv "$venv" "${MAXTEXT_VERSION:-0.2.5}" "${check[@]}"
