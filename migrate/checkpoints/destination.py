"""Where `migrate` writes: checks on the destination, a staging directory beside it, the final
move, and the removal of staging directories that killed runs left behind. No JAX.

Rules (docs/checkpoints.md, "Safety"):

- An empty directory is a destination like a missing one (nothing in it to lose), with or
  without `--force`.
- `--force` replaces a destination only when it is a checkpoint this tool recognises: a twins
  checkpoint (its items and a valid `meta`), or a MaxText checkpoints root this tool wrote
  (`--to=maxtext`: its `ROOT_MARKER` names the step directories it wrote, and the root holds
  nothing else: a step MaxText's `train.py` added since is not the tool's to remove). Anything
  else (a directory of other files, a file, a symbolic link, the current directory or one above
  it, the source or a directory above it) is refused, always.
- A destination whose parent is a file or cannot be written is refused before any work.
- The checkpoint is written to `STAGING/checkpoint`, STAGING being `.migrate-staging-<12 hex>`
  beside the destination (a short fixed name: any legal destination name fits) with an
  `owner.json` that records the destination, the pid and its start time (it is made as
  `.migrate-newborn-<12 hex>` and renamed once that file is written). The final move renames an
  old destination to `STAGING/replaced`, the new checkpoint into place, then removes STAGING;
  SIGINT and SIGTERM wait until both renames are done.
- An error or a signal removes STAGING (again, until it stays gone: Orbax's writer threads may
  outlive the interrupted save). A staging directory whose owner is no longer running is stale:
  the next run for the same destination removes it, first moving `replaced` back if the run
  died between the two renames; so are ownerless leftovers of ours (only pieces of a staged
  checkpoint, or an empty newborn older than a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psutil

from migrate.checkpoints import meta
from migrate.checkpoints.meta import CheckpointError
from migrate.config import safe_load
from migrate.runtime.cli_support import raise_if_interrupted, signals_deferred, unwritable_reason

STAGING_PREFIX = ".migrate-staging-"
NEWBORN_PREFIX = ".migrate-newborn-"  # a staging directory until its owner file is written
_OURS = re.compile(rf"({re.escape(STAGING_PREFIX)}|{re.escape(NEWBORN_PREFIX)})[0-9a-f]{{12}}")
OWNERLESS_AFTER_S = 60.0
OWNER_FILE = "owner.json"
STAGED = "checkpoint"  # the new checkpoint inside a staging directory
REPLACED = "replaced"  # the old destination, moved aside during the final move
NAME_BYTES = 255  # the file-name limit of Linux file systems
SETTLE_S = 0.5
# In a MaxText checkpoints root this tool wrote: what it wrote there (Orbax's checkpoint
# manager lists only step directories, so MaxText reads the root as before).
ROOT_MARKER = "written-by-migrate.json"
ROOT_FORMAT = "linen-nnx-parity/maxtext-root"


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))  # through symlinks; never raises on a loop


def _inside(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def _check_parent(dst: Path) -> None:
    """The nearest existing ancestor of `dst` must be a directory this process can write."""
    reason = unwritable_reason(dst.parent)
    if reason:
        raise CheckpointError(f"{dst}: cannot be created: {reason}")


def _empty_directory(dst: Path) -> bool:
    """A real directory (not a link) with nothing in it: nothing to lose by writing there."""
    try:
        return dst.is_dir() and not dst.is_symlink() and next(os.scandir(dst), None) is None
    except OSError:
        return False


def mark_root(root: Path, steps: Sequence[str]) -> None:
    """Record in the MaxText checkpoints root `root` (staged) that this tool wrote it, with the
    step directories it wrote."""
    record = {"format": ROOT_FORMAT, "version": 1, "steps": sorted(steps)}
    (root / ROOT_MARKER).write_text(json.dumps(record) + "\n")


def _root_problem(dst: Path) -> str | None:
    """Why `dst`, which has a `ROOT_MARKER`, is not a MaxText root exactly as this tool wrote
    it (the marker valid, the steps it names there as directories, nothing else), or None."""
    try:
        record = safe_load.load_json_file(dst / ROOT_MARKER, 1 << 16, "marker")
    except safe_load.ParseError as e:
        return f"its {ROOT_MARKER} is unreadable ({str(e)[:200]})"
    steps = record.get("steps") if isinstance(record, dict) else None
    if not isinstance(steps, list) or record.get("format") != ROOT_FORMAT:
        return f"its {ROOT_MARKER} is not this tool's"
    try:
        entries = set(os.listdir(dst)) - {ROOT_MARKER}
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    others = sorted(entries - set(map(str, steps)))
    if others:
        shown = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
        return f"holds entries this tool did not write ({shown})"
    linked = [s for s in steps if not (dst / str(s)).is_dir() or (dst / str(s)).is_symlink()]
    if linked:
        return f"step {linked[0]} is not the directory this tool wrote"
    return None


def replaceable_problem(dst: Path) -> str | None:
    """Why `--force` must not replace the existing `dst`, or None when it may."""
    if _empty_directory(dst):
        return None
    if dst.is_symlink():
        return "is a symbolic link"
    if not dst.is_dir():
        return "is not a directory"
    if (dst / ROOT_MARKER).is_file():
        problem = _root_problem(dst)
        return f"is not a MaxText checkpoints root this tool wrote: {problem}" if problem else None
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
    if (dst.exists() or dst.is_symlink()) and not _empty_directory(dst):
        problem = replaceable_problem(dst)  # first: never advise --force where it is refused
        if problem:
            raise CheckpointError(f"{dst}: {problem}; not replacing it, even with --force")
        if not force:
            raise CheckpointError(f"{dst}: already exists; pass --force to replace it")
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


def _stale(staging: Path, dst: Path) -> bool:
    """Whether `staging` (one of ours by its name) is left over and may go."""
    owner = _read_owner(staging)
    if owner is not None:
        return owner.get("destination") == str(dst) and not _owner_alive(owner)
    entries = list(staging.iterdir())
    if staging.name.startswith(STAGING_PREFIX):
        # Orbax's writer threads wrote on after an interrupted run removed it: nothing but
        # pieces of the staged checkpoint.
        return all(p.name.startswith(STAGED) for p in entries)
    # Killed between creating it and writing its owner file (a live run takes microseconds).
    return not entries and time.time() - staging.stat().st_mtime > OWNERLESS_AFTER_S


def remove_stale(dst: Path) -> list[Path]:
    """Remove the staging directories of `dst` whose owner process has ended (restoring an old
    destination a killed run had moved aside), and ownerless leftovers; returns them. Those
    of live runs and of other destinations are left alone."""
    dst = dst.absolute()
    removed = []
    try:
        names = os.listdir(dst.parent) if dst.parent.is_dir() else []
    except OSError:
        names = []
    for name in sorted(names):
        staging = dst.parent / name
        if not _OURS.fullmatch(name) or staging.is_symlink() or not staging.is_dir():
            continue
        try:
            if not _stale(staging, dst):
                continue
        except OSError:
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
    `staged(staging)`. It appears under its name with its owner file already in it."""
    dst = dst.absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale(dst):
        print(f"[migrate] removed {stale}, left by a run that was killed", file=sys.stderr)
    token = uuid.uuid4().hex[:12]
    newborn = dst.parent / f"{NEWBORN_PREFIX}{token}"
    newborn.mkdir()
    me = psutil.Process()
    owner = {"destination": str(dst), "pid": me.pid, "started": me.create_time()}
    (newborn / OWNER_FILE).write_text(json.dumps(owner) + "\n")
    staging = dst.parent / f"{STAGING_PREFIX}{token}"
    newborn.rename(staging)
    return staging


def staged(staging: Path) -> Path:
    """Where the checkpoint goes inside `staging`."""
    return staging / STAGED


def discard(staging: Path, settle: bool = False) -> None:
    """Remove `staging` and everything in it (it is ours: `stage` made it). With `settle`
    (after an error or a signal during a save), remove it again until it stays gone for
    `SETTLE_S`: Orbax's writer threads may still create files in it after it was removed."""
    shutil.rmtree(staging, ignore_errors=True)
    gone_since = time.monotonic()
    deadline = gone_since + 10 * SETTLE_S
    while settle and time.monotonic() < deadline:
        time.sleep(SETTLE_S / 5)
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= SETTLE_S:
            return


def publish_unless(problems: Sequence[str], staging: Path, dst: Path, force: bool) -> None:
    """The staged checkpoint moved into place when its verification found no `problems`,
    discarded otherwise (nothing is written over a checkpoint that did not verify)."""
    if problems:
        discard(staging)
    else:
        publish(staging, dst, force)


def publish(staging: Path, dst: Path, force: bool) -> None:
    """Move the complete checkpoint into place, then remove `staging` (with the old destination,
    which is renamed aside first and only removed once the new one is in place). Signals wait
    until both renames are done; one received before, not yet raised, stops it here."""
    raise_if_interrupted()
    with signals_deferred():
        if dst.exists() or dst.is_symlink():
            empty = _empty_directory(dst)
            problem = replaceable_problem(dst)
            if problem:
                raise CheckpointError(f"{dst}: {problem}; not replacing it, even with --force")
            if not (force or empty):
                raise CheckpointError(
                    f"{dst}: appeared while converting; pass --force to replace it"
                )
            dst.rename(staging / REPLACED)
        staged(staging).rename(dst)
    discard(staging)
