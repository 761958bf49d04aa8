"""Conversion of a train state between the twins and between layouts, leaf by leaf.

A state is taken apart into flat Linen-form trees (`Weights`), each tree moved to the target
layout one weight at a time (`migrate.checkpoints.convert` and `migrate.common.layout`: each new
array is built, placed with its target sharding, and its source dropped before the next, so that
peak memory stays near one copy), and assembled into the target twin's objects, checked strictly
against the target config's model. `differences` compares two states bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from migrate.checkpoints import convert
from migrate.checkpoints.checkpoint_io import host_copy
from migrate.checkpoints.meta import ARRAY_ITEMS, CheckpointError
from migrate.checkpoints.train_state import (
    MAX_LISTED,
    Path_,
    Spec,
    TrainState,
    abstract_state,
    describe,
    is_box,
    keystr,
    leaf_sharding,
    listing,
    mismatches,
    names_of,
    value_of,
)
from migrate.common import axes


@dataclasses.dataclass
class Weights:
    """A train state taken apart for leaf-by-leaf work, in Linen form.

    `trees` maps 'params' and the optimizer-state key of each moment ('1/0/mu', ...) to a flat
    `path -> LogicallyPartitioned` dict; `skeleton` is the optimizer state with each moment
    replaced by its key. Steps that convert leaves pop them from `trees`, so each source array
    is released once its converted twin exists.
    """

    trees: dict[str, dict[Path_, Any]]
    skeleton: Any
    step: int


def _is_moment_of(spec: Spec, params: Any) -> Callable[[Any], bool]:
    if spec.framework == "nnx":
        return lambda x: isinstance(x, nnx.State)
    structure = jax.tree.structure(params["params"], is_leaf=is_box)
    return lambda x: isinstance(x, dict) and jax.tree.structure(x, is_leaf=is_box) == structure


def take_apart(state: TrainState, spec: Spec) -> Weights:
    """`state` (either twin) -> Weights in Linen form; arrays are moved, never copied."""
    to_linen = (lambda t: t) if spec.framework == "linen" else convert.nnx_to_linen
    is_moment = _is_moment_of(spec, state.params)
    trees = {"params": convert.flatten_dict(to_linen(state.params)["params"])}

    def moment(path, x):
        if not is_moment(x):
            return x
        key = keystr(path)
        tree = to_linen(x)["params"] if spec.framework == "nnx" else x
        trees[key] = convert.flatten_dict(tree)
        return key

    skeleton = jax.tree_util.tree_map_with_path(moment, state.opt_state, is_leaf=is_moment)
    return Weights(trees, skeleton, state.step)


def assemble(weights: Weights, spec: Spec, mesh: Mesh) -> TrainState:
    """Weights (Linen form, `spec`'s layout) -> `spec`'s twin objects, checked strictly against
    the model the config describes (paths, shapes, dtypes, logical names)."""
    template = abstract_state(spec, mesh)
    trees = {k: convert.unflatten_dict(v) for k, v in weights.trees.items()}
    if spec.framework == "linen":
        build = lambda tree: tree
    else:
        build = lambda tree: convert.linen_to_nnx({"params": tree}, template.params)
    params = {"params": trees["params"]} if spec.framework == "linen" else build(trees["params"])
    opt_state = jax.tree.map(
        lambda x: build(trees[x]) if isinstance(x, str) else x, weights.skeleton
    )
    state = TrainState(params, opt_state, weights.step)
    for item in ARRAY_ITEMS:
        expected, actual = describe(getattr(template, item)), describe(getattr(state, item))
        problems = mismatches(item, expected, actual) + [
            f"{item}/{k}: {actual[k].dtype} names {actual[k].names}, expected "
            f"{expected[k].dtype} names {expected[k].names}"
            for k in sorted(set(expected) & set(actual))
            if (actual[k].dtype, actual[k].names) != (expected[k].dtype, expected[k].names)
        ]
        if problems:
            raise CheckpointError(
                f"converted trees do not fit {spec.describe()}:\n{listing(problems)}"
            )
    return state


def same_layout(a: Spec, b: Spec) -> bool:
    """Whether weights of `a` and `b` have the same shapes and paths (no re-staging needed)."""
    if a.layout != b.layout:
        return False
    shape = lambda c: (
        c.num_stages,
        c.num_repeats,
        c.layers_per_stage,
        c.scan_layers_per_stage,
        c.num_pipelined_layers,
    )
    return a.layout == "reference" or shape(a.cfg) == shape(b.cfg)


def _cast(tree: Any, dtype: str | None) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(lambda b: b.replace_boxed(b.value.astype(dtype)), tree, is_leaf=is_box)


def _finisher(spec: Spec, mesh: Mesh, dtype: str | None) -> Callable[[Any], Any]:
    """Cast (elementwise: the sharding stays) and place one box that keeps its shape."""

    def finish(box):
        value = _cast(box, dtype).value
        target = leaf_sharding(tuple(box.names), tuple(value.shape), mesh, spec.cfg)
        return box.replace_boxed(jax.device_put(value, target))

    return finish


@functools.cache
def _mover(src: Spec, tgt: Spec, dtype: str | None) -> Callable[[Any], Any]:
    """Linen boxes of one layer weight in `src`'s layout -> in `tgt`'s, through the reference
    layout (`migrate.checkpoints.convert` and `migrate.common.layout`, names and arrays alike),
    cast to `dtype`."""

    def move(variables):
        if src.use_pipeline:
            variables = convert.linen_pipeline_to_reference(variables, src.cfg)
        if tgt.use_pipeline:
            variables = convert.linen_reference_to_pipeline(variables, tgt.cfg)
        return _cast(variables, dtype)

    return move


def _on_mesh(fn: Callable[[Any], Any], tree: Any, spec: Spec, mesh: Mesh) -> Any:
    """`fn(tree)` (boxes to boxes) under jit, each output landing with the sharding its names
    resolve to: eager reshapes would gather a stage-sharded weight onto every device."""
    abstract = jax.eval_shape(fn, tree)
    shardings = jax.tree.map(
        lambda b: leaf_sharding(tuple(b.names), tuple(b.value.shape), mesh, spec.cfg),
        abstract,
        is_leaf=is_box,
    )
    return jax.jit(fn, out_shardings=shardings)(tree)


def _layer_path(path: Path_, spec: Spec) -> Path_ | None:
    """The path inside one layer of a stacked decoder-layer weight, or None for other weights."""
    if spec.use_pipeline and path[:2] == ("pipeline", "layers"):
        return path[3:]
    if spec.use_pipeline and path[:2] == (axes.LAYERS_AFTER_PIPELINE, "layers"):
        return path[2:]
    if not spec.use_pipeline and path[0] == "layers":
        return path[1:]
    return None


def _relayout_tree(
    flat: dict[Path_, Any], src: Spec, tgt: Spec, mesh: Mesh, dtype: str | None
) -> dict[Path_, Any]:
    """One weight tree (flat, Linen form) from `src`'s layout to `tgt`'s, one weight at a time;
    pops every entry of `flat`, so each source array is released once it has been moved."""
    finish = _finisher(tgt, mesh, dtype)
    restage = not same_layout(src, tgt)
    out: dict[Path_, Any] = {}
    groups: dict[Path_, list[Path_]] = {}  # one weight's path in a layer -> its stage slots
    for path in list(flat):
        inner = _layer_path(path, src) if restage else None
        if inner is None:
            out[path] = finish(flat.pop(path))
        else:
            groups.setdefault(inner, []).append(path)
    move = _mover(src, tgt, dtype)
    for inner, members in groups.items():
        # The weight sits under a fixed key, so that every weight of one shape and names (a
        # parameter and its moments) shares one compiled move.
        if src.use_pipeline:
            slots = {p[2]: {"w": flat.pop(p)} for p in members if p[0] == "pipeline"}
            variables = {"params": {"pipeline": {"layers": slots}}}
            after = [p for p in members if p[0] == axes.LAYERS_AFTER_PIPELINE]
            if after:
                after_layers = {"layers": {"w": flat.pop(after[0])}}
                variables["params"][axes.LAYERS_AFTER_PIPELINE] = after_layers
            del slots
        else:
            variables = {"params": {"layers": {"w": flat.pop(members[0])}}}
        moved = _on_mesh(move, variables, tgt, mesh)
        del variables
        for path, box in convert.flatten_dict(moved["params"]).items():
            out[(*path[:-1], *inner)] = box
    return out


def relayout(weights: Weights, src: Spec, tgt: Spec, mesh: Mesh, dtype: str | None = None) -> None:
    """Move every weight tree from `src`'s layout to `tgt`'s, cast to `dtype` if given, and place
    each new array with the sharding its names resolve to on `mesh`; in place, leaf by leaf."""
    for key in list(weights.trees):
        weights.trees[key] = _relayout_tree(weights.trees[key], src, tgt, mesh, dtype)


def convert_state(
    state: TrainState, src: Spec, tgt: Spec, mesh: Mesh, dtype: str | None = None
) -> TrainState:
    """`state` of `src` as `tgt`'s twin objects (framework, layout, dtype), on `mesh`, in memory.

    While the caller holds `state`, re-staged weights exist twice; `convert_checkpoint` instead
    takes the restored state apart at once, so each source array goes as its twin arrives.
    """
    weights = take_apart(state, src)
    relayout(weights, src, tgt, mesh, dtype)
    return assemble(weights, tgt, mesh)


# ------------------------------------------------------------------ comparison


def _flat_arrays(weights: Weights) -> dict[str, Any]:
    out = {}
    for key, tree in weights.trees.items():
        for path, box in tree.items():
            out[f"{key}:{'/'.join(path)}"] = box
    flat, _ = jax.tree_util.tree_flatten_with_path(weights.skeleton)
    for p, x in flat:
        if not isinstance(x, str):
            out[f"opt_state:{keystr(p)}"] = x
    return out


def differences(a: Weights, b: Weights, limit: int = MAX_LISTED) -> list[str]:
    """Every way `a` and `b` differ, bit for bit: keys, names, dtypes, shapes, values, step."""
    problems = [] if a.step == b.step else [f"step: {a.step} vs {b.step}"]
    flat_a, flat_b = _flat_arrays(a), _flat_arrays(b)
    for key in sorted(set(flat_a) ^ set(flat_b)):
        problems.append(f"{key}: only on the {'source' if key in flat_a else 'destination'} side")
    for key in sorted(set(flat_a) & set(flat_b)):
        x, y = flat_a[key], flat_b[key]
        if names_of(x) != names_of(y):
            problems.append(f"{key}: logical names {names_of(x)} vs {names_of(y)}")
        x, y = host_copy(value_of(x)), host_copy(value_of(y))
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            problems.append(f"{key}: {x.shape} {x.dtype} vs {y.shape} {y.dtype}")
            continue
        differ = int(np.sum(x.reshape(-1).view(np.uint8) != y.reshape(-1).view(np.uint8)))
        if differ:
            problems.append(f"{key}: {differ} of {x.nbytes} bytes differ")
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] * (len(problems) > limit))
