"""Where each side of a remote pair runs, read from the command's flags and validated before
JAX starts: an interpreter that is there and runs, a checkout that holds the project. No JAX."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from migrate.errors import BadInput
from parity.remote.client import check_interpreter

SIDES = ("linen", "nnx")
# The checks that call the twins' functions in the harness's process (pipeline against
# reference, bubbles, the drill-down, compile and efficiency from abstract shapes): not
# available when the sides run in workers.
LOCAL_ONLY = ("pipeline", "bubbles", "layers", "compile", "efficiency")


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where one side runs: its interpreter, the checkout it imports first, and an optional
    `module:function` its worker calls before building anything (a test's injected bug)."""

    python: str
    path: str | None = None
    patch: str | None = None
    timeout_s: float = 600.0
    extra_paths: tuple[str, ...] = ()  # importable by the worker after `path` (the patch's)


def checkout(path: str, flag: str) -> str:
    root = Path(path)
    if not (root / "parity" / "remote" / "worker.py").is_file():
        raise BadInput(
            f"--{flag}={path}: not a checkout of this project with workers "
            "(no parity/remote/worker.py there)"
        )
    return str(root.resolve())


def from_flags(flags: Any) -> dict[str, Environment] | None:
    """Each side's environment when any `--{side}_python` / `--{side}_path` is given (a side
    without its own runs in this interpreter and checkout, in a worker too); else None."""
    given = {
        (side, kind): flags[f"{side}_{kind}"].value for side in SIDES for kind in ("python", "path")
    }
    if not any(given.values()):
        return None
    if flags["num_processes"].value > 1:
        raise BadInput("--linen_python/--nnx_python: a remote pair runs in one process")
    if flags["checkpoint"].value is not None:
        raise BadInput("--checkpoint with workers (--linen_python/--nnx_python): not supported")
    out = {}
    for side in SIDES:
        python = given[side, "python"] or sys.executable
        path = given[side, "path"]
        out[side] = Environment(
            python=check_interpreter(python),
            path=checkout(path, f"{side}_path") if path else None,
            timeout_s=flags["worker_timeout_s"].value,
        )
    return out
