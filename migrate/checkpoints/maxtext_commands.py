"""Converting MaxText checkpoints into the twins' and back (`migrate.checkpoints.maxtext` holds
the map): the same contract as `commands.convert_checkpoint` (the source only read, a staging
directory moved into place when complete, `--force` only over what the tool wrote, nothing
written on failure, refusals as CheckpointError: exit 2).

    into_twins(RUN/checkpoints/2, DST, cfg, "nnx", "pipeline")   # a twins checkpoint
    from_twins(DST, OUT/checkpoints, cfg, "nnx")                 # OUT/checkpoints/2/items
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from migrate.checkpoints import destination, maxtext
from migrate.checkpoints.checkpoint_io import host_copy, restore, save
from migrate.checkpoints.meta import CheckpointError, read_meta
from migrate.checkpoints.restage import Weights, assemble, relayout, take_apart
from migrate.checkpoints.train_state import (
    MAX_LISTED,
    Spec,
    abstract_state,
    plan,
    value_of,
)
from migrate.common import sharding
from migrate.config.contract import Config


@dataclasses.dataclass(frozen=True)
class MaxTextOutcome:
    """What a conversion wrote: the release read (or written for), the step, the stacking,
    how many arrays, and the leaves it dropped (declared, never silently)."""

    release: str
    step: int
    stacking: str
    arrays: int
    dropped: tuple[str, ...]


def _kind(key: str) -> str:
    """A `Weights` tree key -> `params`, `mu` or `nu`."""
    return key if key == "params" else key.rsplit("/", 1)[-1]


def _fill(template: Weights, mapped: dict[str, Any], count: Any, step: int) -> Weights:
    """The twins' reference-layout template filled with a MaxText checkpoint's arrays, each
    boxed with the template's logical names; every path, shape and dtype checked."""
    trees, problems = {}, []
    for key, boxes in template.trees.items():
        given = mapped[_kind(key)]
        problems += [f"{key}: missing {'/'.join(p)}" for p in boxes if p not in given]
        problems += [
            f"{key}: not in the twins' tree: {'/'.join(p)}" for p in given if p not in boxes
        ]
        tree = {}
        for path, box in boxes.items():
            if path not in given:
                continue
            array, want = given[path], value_of(box)
            if tuple(array.shape) != tuple(want.shape) or str(array.dtype) != str(want.dtype):
                problems.append(
                    f"{key}: {'/'.join(path)}: {tuple(array.shape)} {array.dtype} where the "
                    f"config's model has {tuple(want.shape)} {want.dtype}"
                )
                continue
            tree[path] = box.replace_boxed(array)
        trees[key] = tree
    counts = [x for x in jax.tree.leaves(template.skeleton) if not isinstance(x, str)]
    if len(counts) != 1:
        problems.append(f"the twins' optimizer holds {len(counts)} counts; MaxText's carries one")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED])
        more = (
            f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        )
        raise CheckpointError(f"the MaxText checkpoint does not fit the config:\n{listed}{more}")
    skeleton = jax.tree.map(
        lambda x: x if isinstance(x, str) else np.asarray(count, x.dtype), template.skeleton
    )
    return Weights(trees, skeleton, step)


def into_twins(
    src: str | Path,
    dst: str | Path,
    cfg: Config,
    framework: str,
    layout: str,
    force: bool = False,
) -> MaxTextOutcome:
    """The MaxText checkpoint at `src` (a step directory) as a twins checkpoint of `cfg`
    (`framework`, `layout`) at `dst`."""
    src, dst = maxtext.step_directory(Path(src).absolute()), Path(dst).absolute()
    destination.check_destination(src, dst, force)
    flat = maxtext.read(src)
    found = maxtext.release(flat)
    mapped = maxtext.to_twins(flat, cfg.head_dim)
    del flat
    reference, target = Spec("linen", "reference", cfg), Spec(framework, layout, cfg)
    mesh = sharding.make_mesh(cfg)
    weights = _fill(
        take_apart(abstract_state(reference, mesh), reference),
        mapped,
        mapped["count"],
        mapped["step"],
    )
    del mapped["params"], mapped["mu"], mapped["nu"]
    staging = destination.stage(dst)
    try:
        relayout(weights, reference, target, mesh)
        state = assemble(weights, target, mesh)
        del weights
        arrays = len(jax.tree.leaves((state.params, state.opt_state)))
        save(destination.staged(staging), target, state)
        del state
        destination.publish(staging, dst, force)
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return MaxTextOutcome(
        found, mapped["step"], mapped["stacking"], arrays, tuple(mapped["dropped"])
    )


def _stacking(cfg: Config) -> str:
    """MaxText's stacking for the twins' config: its pipeline when one layer per stage and no
    repeats, else its scanned decoder (which `cfg` must then not pipeline)."""
    if not cfg.using_pipeline:
        return "scan"
    if cfg.layers_per_stage == 1 and cfg.num_repeats == 1 and not cfg.scan_layers_per_stage:
        return "pipeline"
    raise CheckpointError(
        "MaxText's pipeline stacking is mapped for one layer per stage and no repeats only "
        f"(the config has L={cfg.layers_per_stage}, R={cfg.num_repeats})"
    )


def from_twins(
    src: str | Path, dst: str | Path, cfg: Config, framework: str, force: bool = False
) -> MaxTextOutcome:
    """The twins checkpoint at `src` as a MaxText checkpoint (Linen layout, as both releases
    write and restore it) under the checkpoints root `dst` (`dst/<step - 1>/items`)."""
    import orbax.checkpoint as ocp

    src, dst = Path(src).absolute(), Path(dst).absolute()
    destination.check_destination(src, dst, force)
    how = _stacking(cfg)
    meta = read_meta(src)
    src_spec, reference = plan(meta, cfg, meta["framework"], "linen", "reference")
    if meta["framework"] != framework:
        raise CheckpointError(f"{src}: holds {meta['framework']} trees, not {framework}")
    mesh = sharding.make_mesh(src_spec.cfg)
    weights = take_apart(restore(src, src_spec, mesh, meta), src_spec)
    relayout(weights, src_spec, reference, mesh)
    trees = {
        _kind(key): {p: host_copy(value_of(b)) for p, b in tree.items()}
        for key, tree in weights.trees.items()
    }
    counts = [x for x in jax.tree.leaves(weights.skeleton) if not isinstance(x, str)]
    if len(counts) != 1:
        raise CheckpointError(f"{src}: the optimizer holds {len(counts)} counts; MaxText's one")
    flat = maxtext.from_twins(trees, host_copy(counts[0]), weights.step, cfg.head_dim, how)
    del weights, trees
    tree: dict[str, Any] = {}
    for path, array in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    tree["opt_state"] = [tree["opt_state"]["0"], None, tree["opt_state"]["2"]]
    staging = destination.stage(dst)
    try:
        with ocp.CheckpointManager(destination.staged(staging)) as manager:
            manager.save(meta["step"] - 1, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
            manager.wait_until_finished()
        destination.publish(staging, dst, force)
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return MaxTextOutcome("0.2.3 layout", meta["step"], how, len(flat), ())
