"""Where `migrate` writes: checks on the destination, a staging directory beside it, the final
move, and the removal of staging directories that killed runs left behind. No JAX.

Rules (docs/checkpoints.md, "Safety"):

- `--force` replaces a destination only when it is a checkpoint this tool recognises (its items
  and a valid `meta`); anything else (a directory of other files, a file, a symbolic link, the
  current directory or one above it, the source or a directory above it) is refused, always.
- A destination whose parent is a file or cannot be written is refused before any work.
- The checkpoint is written to `STAGING/checkpoint`, STAGING being `.migrate-staging-<12 hex>`
  beside the destination (a short fixed name: any legal destination name fits) with an
  `owner.json` that records the destination, the pid and its start time. The final move renames
  an old destination to `STAGING/replaced`, the new checkpoint into place, then removes STAGING.
- A staging directory whose owner is no longer running is stale: the next run for the same
  destination removes it, first moving `replaced` back if the run died between the two renames.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import psutil

from migrate import meta, safe_load
from migrate.cli_support import signals_deferred, unwritable_reason
from migrate.meta import CheckpointError

STAGING_PREFIX = ".migrate-staging-"
OWNER_FILE = "owner.json"
STAGED = "checkpoint"  # the new checkpoint inside a staging directory
REPLACED = "replaced"  # the old destination, moved aside during the final move
NAME_BYTES = 255  # the file-name limit of Linux file systems


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))  # through symlinks; never raises on a loop


def _inside(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def _check_parent(dst: Path) -> None:
    """The nearest existing ancestor of `dst` must be a directory this process can write."""
    reason = unwritable_reason(dst.parent)
    if reason:
        raise CheckpointError(f"{dst}: cannot be created: {reason}")


def replaceable_problem(dst: Path) -> str | None:
    """Why `--force` must not replace the existing `dst`, or None when it may."""
    if dst.is_symlink():
        return "is a symbolic link"
    if not dst.is_dir():
        return "is not a directory"
    try:
        meta.read_meta(dst)
    except CheckpointError as e:
        return f"is not a checkpoint this tool wrote ({str(e).split(': ', 1)[-1][:200]})"
    return None


def check_destination(src: Path | None, dst: Path, force: bool) -> None:
    """Refuse, before any work, a destination this command must not write or replace."""
    dst = dst.absolute()
    if len(os.fsencode(dst.name)) > NAME_BYTES:
        raise CheckpointError(f"{dst}: the name is longer than {NAME_BYTES} bytes")
    real_dst, cwd = _real(dst), None
    if src is not None:
        real_src = _real(src)
        if _inside(real_dst, real_src) or _inside(real_src, real_dst):
            raise CheckpointError(
                f"{dst}: the destination must not be, contain or lie inside the source {src}"
            )
    with contextlib.suppress(OSError):  # a deleted working directory contains nothing
        cwd = _real(Path.cwd())
    if cwd is not None and _inside(cwd, real_dst):
        raise CheckpointError(f"{dst}: the destination is or contains the current directory")
    if dst.exists() or dst.is_symlink():
        if not force:
            raise CheckpointError(f"{dst}: already exists; pass --force to replace it")
        problem = replaceable_problem(dst)
        if problem:
            raise CheckpointError(f"{dst}: {problem}; not replacing it, even with --force")
    _check_parent(dst)


def _owner_alive(owner: dict) -> bool:
    try:
        return psutil.Process(owner["pid"]).create_time() == owner["started"]
    except (psutil.Error, KeyError, TypeError, ValueError, OverflowError):
        return False


def _read_owner(staging: Path) -> dict | None:
    try:
        owner = safe_load.load_json_file(staging / OWNER_FILE, 1 << 16, "owner file")
    except safe_load.ParseError:
        return None
    return owner if isinstance(owner, dict) else None


def remove_stale(dst: Path) -> list[Path]:
    """Remove the staging directories of `dst` whose owner process has ended (restoring an old
    destination a killed run had moved aside); returns them. Others' are left alone."""
    dst = dst.absolute()
    removed = []
    try:
        candidates = sorted(dst.parent.glob(f"{STAGING_PREFIX}*")) if dst.parent.is_dir() else []
    except OSError:
        candidates = []
    for staging in candidates:
        if staging.is_symlink() or not staging.is_dir():
            continue
        owner = _read_owner(staging)
        if owner is None:
            with contextlib.suppress(OSError):
                staging.rmdir()  # only when empty: killed between mkdir and its owner file
            continue
        if owner.get("destination") != str(dst) or _owner_alive(owner):
            continue
        with signals_deferred():
            replaced = staging / REPLACED
            if replaced.is_dir() and not (dst.exists() or dst.is_symlink()):
                replaced.rename(dst)  # the run died between its two renames
            shutil.rmtree(staging, ignore_errors=True)
        removed.append(staging)
    return removed


def stage(dst: Path) -> Path:
    """A new staging directory for `dst` (stale ones removed first); write the checkpoint to
    `staged(staging)`."""
    dst = dst.absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale(dst):
        print(f"[migrate] removed {stale}, left by a run that was killed", file=sys.stderr)
    staging = dst.parent / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    me = psutil.Process()
    owner = {"destination": str(dst), "pid": me.pid, "started": me.create_time()}
    (staging / OWNER_FILE).write_text(json.dumps(owner) + "\n")
    return staging


def staged(staging: Path) -> Path:
    """Where the checkpoint goes inside `staging`."""
    return staging / STAGED


def discard(staging: Path) -> None:
    """Remove `staging` and everything in it (it is ours: `stage` made it)."""
    shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, dst: Path, force: bool) -> None:
    """Move the complete checkpoint into place, then remove `staging` (with the old destination,
    which is renamed aside first and only removed once the new one is in place). Signals wait
    until both renames are done."""
    with signals_deferred():
        if dst.exists() or dst.is_symlink():
            if not force:
                raise CheckpointError(
                    f"{dst}: appeared while converting; pass --force to replace it"
                )
            problem = replaceable_problem(dst)
            if problem:
                raise CheckpointError(f"{dst}: {problem}; not replacing it, even with --force")
            dst.rename(staging / REPLACED)
        staged(staging).rename(dst)
    discard(staging)
