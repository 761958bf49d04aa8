"""Where each side of a remote pair runs, read from the command's flags and validated before
JAX starts: an interpreter that is there and runs, a checkout that holds the project. No JAX."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from migrate.errors import BadInput
from parity.remote.client import check_interpreter, project_path
from parity.run_options import SideOptions

SIDES = ("linen", "nnx")


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where one side runs: its interpreter, the checkout it imports first, and an optional
    `module:function` its worker calls before building anything (a test's injected bug)."""

    python: str
    path: str | None = None
    patch: str | None = None
    timeout_s: float = 600.0
    extra_paths: tuple[str, ...] = ()  # importable by the worker after `path` (the patch's)


# Run by the interpreter a side's worker would run in: "missing" where `module` is not
# importable there (found, not imported: nothing of it runs).
_PROBE = (
    "import importlib.util, sys; "
    "print('found' if importlib.util.find_spec(sys.argv[1]) else 'missing')"
)


def require_module(
    python: str, module: str, what: str, paths: Sequence[str] = (), name: str | None = None
) -> None:
    """BadInput (`WHAT: has no NAME installed`, NAME defaulting to the module's) when `python`,
    with `paths` first on its path as its worker's, cannot import `module`. An interpreter that
    cannot answer the question (it fails or hangs) is left to its worker, which reports what
    happens there."""
    try:
        with tempfile.TemporaryDirectory(prefix="parity-probe-") as directory:
            project = str(project_path(Path(directory)))
            done = subprocess.run(
                [python, "-c", _PROBE, module],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([*paths, project])},
                cwd=os.sep,  # not the caller's directory: a checkout there would answer for it
                timeout=120,
            )
    except (OSError, subprocess.SubprocessError):
        return
    if done.returncode == 0 and done.stdout.strip() == "missing":
        raise BadInput(f"{what}: has no {name or module} installed (No module named {module!r})")


def checkout(path: str, flag: str, needs: Sequence[str] = ()) -> str:
    """`path` resolved, or BadInput where it is no checkout of this project with workers, or
    lacks a file of `needs` (the module of the factory its workers will run)."""
    root = Path(path)
    if not (root / "parity" / "remote" / "worker.py").is_file():
        raise BadInput(
            f"--{flag}={path}: not a checkout of this project with workers "
            "(no parity/remote/worker.py there)"
        )
    missing = [name for name in needs if not (root / name).is_file()]
    if missing:
        raise BadInput(
            f"--{flag}={path}: that checkout has no {missing[0]} (a version of the project "
            "from before its worker factory moved there); use a newer checkout"
        )
    return str(root.resolve())


def from_options(
    sides: SideOptions, num_processes: int, checkpoint: str | None, needs: Sequence[str] = ()
) -> dict[str, Environment] | None:
    """Each side's environment when any `--{side}_python` / `--{side}_path` is given (a side
    without its own runs in this interpreter and checkout, in a worker too); else None. A
    checkout must hold the files of `needs` (`checkout`)."""
    if not sides.any_given:
        return None
    if num_processes > 1:
        raise BadInput("--linen_python/--nnx_python: a remote pair runs in one process")
    if checkpoint is not None:
        raise BadInput("--checkpoint with workers (--linen_python/--nnx_python): not supported")
    out = {}
    for side in SIDES:
        path = sides.path(side)
        out[side] = Environment(
            python=check_interpreter(sides.python(side) or sys.executable),
            path=checkout(path, f"{side}_path", needs) if path else None,
            timeout_s=sides.worker_timeout_s,
        )
    return out
