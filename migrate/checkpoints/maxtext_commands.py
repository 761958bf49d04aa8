"""Converting MaxText checkpoints into the twins' and back (the map is
`migrate.checkpoints.maxtext_layouts`'s): the same contract as `commands.convert_checkpoint`
(the source only read, a staging directory moved into place when complete, `--force` only over
what the tool wrote, a MaxText checkpoints root included (`destination.ROOT_MARKER`), nothing
written on failure, refusals as CheckpointError: exit 2).

    into_twins(RUN/checkpoints/2, DST, cfg, "nnx", "pipeline")   # a twins checkpoint
    from_twins(DST, OUT/checkpoints, cfg, "nnx")                 # OUT/checkpoints/2/items
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from migrate.checkpoints import destination, maxtext_layouts
from migrate.checkpoints.checkpoint_io import host_copy, restore, save
from migrate.checkpoints.convert import unflatten_dict
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
    differences: tuple[str, ...] = ()  # a failed verification's findings: nothing written


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


def differences(
    expected: dict[tuple[str, ...], Any], actual: dict[tuple[str, ...], Any]
) -> list[str]:
    """Every way two MaxText-layout trees (flat) differ, bit for bit: paths, dtypes, shapes,
    bytes; at most `MAX_LISTED` named, then a count."""
    problems = [
        f"{'/'.join(p)}: only in the {'first' if p in expected else 'second'}"
        for p in sorted(set(expected) ^ set(actual))
    ]
    for path in sorted(set(expected) & set(actual)):
        a, b = np.asarray(expected[path]), np.asarray(actual[path])
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            problems.append(f"{'/'.join(path)}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
        elif a.tobytes() != b.tobytes():
            differ = int(np.count_nonzero(a != b))
            problems.append(f"{'/'.join(path)}: {differ} of {a.size} values differ")
    more = len(problems) - MAX_LISTED
    return problems[:MAX_LISTED] + ([f"... and {more} more"] if more > 0 else [])


def twins_as_maxtext(src: Path, cfg: Config, how: str) -> dict[tuple[str, ...], Any]:
    """The twins checkpoint at `src` (any framework and layout; its meta says which) as
    MaxText's Linen on-disk tree, flat, its layers stacked as `how` says."""
    meta = read_meta(src)
    src_spec, reference = plan(meta, cfg, meta["framework"], "linen", "reference")
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
    return maxtext_layouts.from_twins(trees, host_copy(counts[0]), weights.step, cfg.head_dim, how)


def as_maxtext(path: str | Path, cfg: Config, how: str | None = None) -> dict:
    """A checkpoint of any kind (a MaxText step directory, a twins checkpoint) as MaxText's
    Linen on-disk tree, flat, without 0.2.5's RNG state; `how`: the stacking for a twins
    checkpoint (default: the config's)."""
    path = Path(path)
    if (path / "items" / "_METADATA").is_file():
        return {p: a for p, a in maxtext_layouts.read(path).items() if p[0] != "nnx_aux"}
    return twins_as_maxtext(path, cfg, how or stacking_for(cfg))


def compare_any(a: str | Path, b: str | Path, cfg: Config) -> list[str]:
    """Two checkpoints of any of these kinds, leaf by leaf on MaxText's paths (a MaxText
    checkpoint's stacking decides a twins checkpoint's); empty when bit-identical."""
    kinds = [(Path(p) / "items" / "_METADATA").is_file() for p in (a, b)]
    first = as_maxtext(a, cfg, "scan")
    how = maxtext_layouts.stacking(first) if kinds[0] else "scan"
    second = as_maxtext(b, cfg, how)
    if kinds[1] and not kinds[0]:  # the twins side stacked as the MaxText side is
        first = as_maxtext(a, cfg, maxtext_layouts.stacking(second))
    return differences(first, second)


def into_twins(
    src: str | Path,
    dst: str | Path,
    cfg: Config,
    framework: str,
    layout: str,
    force: bool = False,
    verify: bool = False,
) -> MaxTextOutcome:
    """The MaxText checkpoint at `src` (a step directory) as a twins checkpoint of `cfg`
    (`framework`, `layout`) at `dst`; with `verify`, the staged result mapped back must equal
    the source bit for bit (RNG state aside) or nothing is written (`differences`)."""
    src, dst = maxtext_layouts.step_directory(Path(src).absolute()), Path(dst).absolute()
    destination.check_destination(src, dst, force)
    flat = maxtext_layouts.read(src)
    found = maxtext_layouts.release(flat)
    mapped = maxtext_layouts.to_twins(flat, cfg.head_dim)
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
        found_differences: list[str] = []
        if verify:
            source = {p: a for p, a in maxtext_layouts.read(src).items() if p[0] != "nnx_aux"}
            written = twins_as_maxtext(destination.staged(staging), cfg, mapped["stacking"])
            found_differences = differences(source, written)
        destination.publish_unless(found_differences, staging, dst, force)
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return MaxTextOutcome(
        found, mapped["step"], mapped["stacking"], arrays, tuple(mapped["dropped"]),
        tuple(found_differences),
    )  # fmt: skip


def stacking_for(cfg: Config) -> str:
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
    src: str | Path,
    dst: str | Path,
    cfg: Config,
    force: bool = False,
    verify: bool = False,
    how: str | None = None,
) -> MaxTextOutcome:
    """The twins checkpoint at `src` (either framework and layout) as a MaxText checkpoint
    (Linen layout, as both releases write and restore it; stacked as `how` says, by default as
    `cfg` pipelines) under
    the checkpoints root `dst` (`dst/<step - 1>/items`); with `verify`, read back and compared
    bit for bit before it is moved into place."""
    import orbax.checkpoint as ocp

    src, dst = Path(src).absolute(), Path(dst).absolute()
    destination.check_destination(src, dst, force)
    how = how or stacking_for(cfg)
    flat = twins_as_maxtext(src, cfg, how)
    step = int(flat[("step",)])
    tree = unflatten_dict(flat)
    tree["opt_state"] = [tree["opt_state"]["0"], None, tree["opt_state"]["2"]]
    staging = destination.stage(dst)
    try:
        root = destination.staged(staging)
        with ocp.CheckpointManager(root) as manager:
            manager.save(step - 1, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
            manager.wait_until_finished()
        destination.mark_root(root, [p.name for p in root.iterdir()])  # what --force may replace
        found = differences(flat, maxtext_layouts.read(root / str(step - 1))) if verify else []
        destination.publish_unless(found, staging, dst, force)
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return MaxTextOutcome("0.2.3 layout", step, how, len(flat), (), tuple(found))


def run_command(
    command: str,
    paths: list[str],
    cfg: Config,
    kinds: tuple[str | None, str | None],
    layout: str,
    force: bool,
    verify: bool,
) -> int:
    """`migrate compare A B`, or `migrate convert` with MaxText on one side of `kinds`; prints
    what it did and returns the exit status (1: they differ, or a verification failed)."""
    from migrate.errors import EXIT_FAIL, EXIT_PASS

    if command == "compare":
        found = compare_any(paths[0], paths[1], cfg)
        print("\n".join(f"  - {d}" for d in found) or f"{paths[0]} and {paths[1]}: bit-identical")
        return EXIT_FAIL if found else EXIT_PASS
    source, target = kinds
    if source == "maxtext":
        outcome = into_twins(paths[0], paths[1], cfg, str(target), layout, force, verify)
    else:
        outcome = from_twins(paths[0], paths[1], cfg, force, verify)
    if outcome.differences:
        print(f"migrate: verification failed; {paths[1]} was not written:", file=sys.stderr)
        print("\n".join(f"  - {d}" for d in outcome.differences), file=sys.stderr)
        return EXIT_FAIL
    print(
        f"from {paths[0]} ({source}) to {paths[1]} ({target}): MaxText {outcome.release}, "
        f"step {outcome.step}, {outcome.arrays} arrays, MaxText stacking {outcome.stacking}"
        + (", verified bit for bit" if verify else "")
    )
    if outcome.dropped:
        print(f"     dropped (no place in the twins): {', '.join(outcome.dropped)}")
    return EXIT_PASS
