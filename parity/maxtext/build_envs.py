"""MaxText releases' own environments, built by the installed tool (no Makefile needed):

    python -m parity.maxtext.build_envs [--dir DIR | --venv PATH] [--python PY]
        RELEASE... [--check MODULE ...]

Each release (0.2.3, 0.2.4, 0.2.5) in a venv of its own, `DIR/.venv-maxtext-RELEASE` (DIR: by
default `~/.cache/linen-nnx-parity/envs`; `make maxtext-envs` gives the checkout): MaxText's
wheel installed with `--no-deps` beside exactly the pinned packages its imports need
(`requirements.txt` beside this module: jax, flax and the rest as the default stack pins
them), byte-compiled once (where `PYTHONDONTWRITEBYTECODE` is set every worker would compile
its imports again), its imports checked. Idempotent: a built environment whose stamp names its
release and whose imports passed is left as it is. MaxText is never the project's dependency:
it lives only there. Prints each environment's interpreter.

Stdlib only: it runs under any Python 3.12, before anything of the project is installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

RELEASES = ("0.2.3", "0.2.4", "0.2.5")
REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
CHECKOUT = Path(__file__).resolve().parent.parent.parent  # a checkout, or site-packages
DEFAULT_DIR = Path.home() / ".cache" / "linen-nnx-parity" / "envs"
# What the gate imports of a release (its decoder, its pipeline, its config reader).
MODULES = ("maxtext.layers.pipeline", "maxtext.models.llama2", "maxtext.configs.pyconfig")


class BuildError(Exception):
    """A release's environment could not be built (the message says which step and why)."""


def venv_path(release: str, directory: Path) -> Path:
    return directory / f".venv-maxtext-{release}"


def find_python(release: str) -> str | None:
    """The interpreter of `release`'s built environment: the checkout's (`make maxtext-envs`)
    where there is one, else the one in `DEFAULT_DIR`; None when neither is built."""
    for directory in (CHECKOUT, DEFAULT_DIR):
        python = venv_path(release, directory) / "bin" / "python"
        if python.exists():
            return str(python)
    return None


def _run(command: list[str], what: str, **kwargs) -> None:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BuildError(f"{what}: {' | '.join(tail) or f'exit {done.returncode}'}")


def build(release: str, venv: Path, python: str, modules: tuple[str, ...] = MODULES) -> Path:
    """`release` in `venv` (built, or left as it is when its stamps say so); its interpreter."""
    if release not in RELEASES:
        raise BuildError(f"MaxText {release}: not a release this project maps {RELEASES}")
    interpreter = venv / "bin" / "python"
    installed, checked = venv / ".installed", venv / ".imports-checked"
    runs = interpreter.exists() and subprocess.run([interpreter, "-c", ""]).returncode == 0
    fresh = (
        runs
        and installed.is_file()
        and installed.read_text().strip() == release
        and installed.stat().st_mtime >= REQUIREMENTS.stat().st_mtime
    )
    if not fresh:
        if not runs:
            _run([python, "-m", "venv", str(venv)], f"venv {venv}")
        pip = [str(interpreter), "-m", "pip", "install", "--quiet", "--no-compile", "--no-deps"]
        _run([*pip[:-2], "--upgrade", "pip"], "pip upgrade")
        _run([*pip, "-r", str(REQUIREMENTS)], f"MaxText {release}'s requirements")
        _run([*pip, f"maxtext=={release}"], f"maxtext=={release}")
        purelib = subprocess.run(
            [interpreter, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        # Files a package ships that do not compile (templates) are skipped: not checked.
        compileall = [interpreter, "-m", "compileall", "-q", "-j", "0", purelib]
        subprocess.run(compileall, capture_output=True)
        installed.write_text(release + "\n")
        checked.unlink(missing_ok=True)
    wanted = " ".join(modules)
    if not checked.is_file() or checked.read_text().strip() != wanted:
        env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu"}
        for module in modules:
            what = f"import {module} in {venv}"
            _run([str(interpreter), "-c", f"import {module}"], what, env=env)
        checked.write_text(wanted + "\n")
    return interpreter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="+", metavar="RELEASE", help=", ".join(RELEASES))
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the venvs go")
    where.add_argument("--venv", type=Path, help="this venv (one release)")
    parser.add_argument("--python", default=sys.executable, help="a Python 3.12 for the venvs")
    parser.add_argument("--check", nargs="*", default=(), help="modules that must import too")
    args = parser.parse_args(argv)
    if args.venv is not None and len(args.releases) != 1:
        parser.error("--venv takes one release")
    unknown = [r for r in args.releases if r not in RELEASES]
    if unknown:
        parser.error(f"MaxText {', '.join(unknown)}: not a release this project maps {RELEASES}")
    if sysconfig.get_python_version() != "3.12" and args.python == sys.executable:
        parser.error("MaxText needs Python 3.12: run this with it, or pass --python")
    try:
        for release in args.releases:
            venv = args.venv or venv_path(release, args.dir.absolute())
            print(build(release, venv.absolute(), args.python, (*MODULES, *args.check)))
    except BuildError as e:
        print(f"build_envs: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
