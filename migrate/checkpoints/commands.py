"""The checkpoint commands: write a fresh checkpoint, convert one between frameworks and layouts,
compare two bit for bit.

The parts: `migrate.checkpoints.train_state` (what a checkpoint holds, as the twins' objects),
`migrate.checkpoints.checkpoint_io` (the on-disk Orbax format, validated reads),
`migrate.checkpoints.restage` (conversion leaf by leaf). A command writes into a staging directory
that is moved into place only when complete and, if asked, verified
(`migrate.checkpoints.destination`: what `--force` may replace, signals, stale staging
directories); any error or failed check leaves the destination as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from migrate.checkpoints import destination
from migrate.checkpoints.checkpoint_io import restore, save
from migrate.checkpoints.meta import CheckpointError, read_meta
from migrate.checkpoints.restage import assemble, differences, relayout, same_layout, take_apart
from migrate.checkpoints.train_state import Spec, TrainState, init_state, plan, to_pure
from migrate.common import sharding
from migrate.config.contract import Config
from migrate.runtime import cli_support


def compare_checkpoints(
    src: str | Path, src_spec: Spec, dst: str | Path, dst_spec: Spec, mesh: Mesh, dtype=None
) -> list[str]:
    """Restore both checkpoints and compare them bit for bit, as Linen trees in a common layout
    (the destination's, or the reference layout when re-staged); `dtype` casts the source side
    as the conversion did. Empty when equal. Holds both checkpoints in memory."""
    common = Spec(
        "linen", dst_spec.layout if same_layout(src_spec, dst_spec) else "reference", dst_spec.cfg
    )
    sides = []
    for path, spec, cast in ((src, src_spec, dtype), (dst, dst_spec, None)):
        weights = take_apart(restore(path, spec, mesh), spec)
        relayout(weights, spec, common, mesh, cast)
        sides.append(weights)
    return differences(*sides)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a command wrote (or, when a check failed, did not write)."""

    source: Spec | None
    target: Spec
    step: int
    arrays: int
    nbytes: int
    checks: tuple[str, ...] = ()  # checks run on the written checkpoint before it was moved
    differences: tuple[str, ...] = ()  # their findings; non-empty: nothing was written


Check = Callable[[Path, Spec], Sequence[str]]


def _sizes(state: TrainState) -> tuple[int, int]:
    leaves = jax.tree.leaves(to_pure((state.params, state.opt_state)))
    return len(leaves), sum(int(x.nbytes) for x in leaves)


def _check_and_publish(
    staging: Path, dst: Path, spec: Spec, force: bool, checks: Mapping[str, Check]
) -> tuple[str, ...]:
    """Run `checks` on the checkpoint saved in `staging` in order; publish it when none finds a
    problem, discard it otherwise. Returns the problems."""
    for check in checks.values():
        cli_support.raise_if_interrupted()
        found = tuple(check(destination.staged(staging), spec))
        if found:
            destination.discard(staging)
            return found
    destination.publish(staging, dst, force)
    return ()


def init_checkpoint(dst: str | Path, spec: Spec, force: bool = False) -> Outcome:
    """Write a freshly initialised checkpoint of `spec` at `dst` (staged, then moved)."""
    dst = Path(dst).absolute()
    destination.check_destination(None, dst, force)
    mesh = sharding.make_mesh(spec.cfg)
    staging = destination.stage(dst)
    try:
        state = init_state(spec, mesh)
        outcome = Outcome(None, spec, 0, *_sizes(state))
        cli_support.raise_if_interrupted()
        save(destination.staged(staging), spec, state)
        _check_and_publish(staging, dst, spec, force, {})
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return outcome


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    cfg: Config,
    source: str,
    target: str,
    layout: str | None = None,
    changes: Mapping[str, Any] = {},
    dtype: str | None = None,
    force: bool = False,
    verify: bool = False,
    checks: Mapping[str, Check] = {},
) -> Outcome:
    """Convert the checkpoint at `src` (framework `source`) into one at `dst` (framework
    `target`, layout `layout` or the source's, layout keys changed by `changes`, cast to `dtype`).

    Reads `src` only. Restores with the target mesh's sharding, converts leaf by leaf, writes
    into a staging directory and moves it to `dst` when complete and, with `verify`, equal bit
    for bit to the source (then `checks`, for example a forward pass); any error or failed check
    leaves `dst` as it was.
    """
    src, dst = Path(src).absolute(), Path(dst).absolute()
    destination.check_destination(src, dst, force)
    meta = read_meta(src)
    if meta["framework"] != source:
        raise CheckpointError(
            f"{src}: holds {meta['framework']} trees, not {source} (--from={source})"
        )
    src_spec, tgt_spec = plan(meta, cfg, source, target, layout, changes, dtype)
    mesh = sharding.make_mesh(tgt_spec.cfg)

    def bit_exact(staging: Path, spec: Spec) -> list[str]:
        return compare_checkpoints(src, src_spec, staging, spec, mesh, dtype)

    all_checks = {**({"bit-exact": bit_exact} if verify else {}), **checks}
    staging = destination.stage(dst)
    try:
        # Locals, not arguments, hold the trees: the restored state is gone once taken apart,
        # each source array once its converted twin exists, and the converted state once saved
        # (a caller's argument would pin them all until the call returns).
        weights = take_apart(restore(src, src_spec, mesh, meta), src_spec)
        relayout(weights, src_spec, tgt_spec, mesh, dtype)
        state = assemble(weights, tgt_spec, mesh)
        del weights
        outcome = Outcome(src_spec, tgt_spec, state.step, *_sizes(state), tuple(all_checks))
        cli_support.raise_if_interrupted()
        save(destination.staged(staging), tgt_spec, state)
        del state
        found = _check_and_publish(staging, dst, tgt_spec, force, all_checks)
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return dataclasses.replace(outcome, differences=found)
