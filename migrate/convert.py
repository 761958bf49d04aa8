"""Weight converters: strip/restore `LogicallyPartitioned`, pipeline <-> reference layouts.

Pure functions: they build new trees and never mutate their inputs; arrays are moved, not
copied, wherever no reshape is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from migrate import layout
from migrate.config import Config

Names = tuple[str | None, ...]


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def strip_boxes(tree: Any) -> tuple[Any, Any]:
    """(plain arrays, logical names) from a tree of `LogicallyPartitioned` boxes.

    Unboxed leaves get names `None`.
    """
    arrays = jax.tree.map(lambda x: x.value if _is_box(x) else x, tree, is_leaf=_is_box)
    names = jax.tree.map(lambda x: tuple(x.names) if _is_box(x) else None, tree, is_leaf=_is_box)
    return arrays, names


def restore_boxes(arrays: Any, names: Any, mesh=None, rules=None) -> Any:
    """Inverse of `strip_boxes`: leaves with names become `LogicallyPartitioned` again."""

    def box(value, leaf_names):
        if leaf_names is None:
            return value
        return nn.LogicallyPartitioned(value, leaf_names, mesh=mesh, rules=rules)

    return jax.tree.map(box, arrays, names, is_leaf=lambda x: x is None or isinstance(x, tuple))


def _replace_subtree(params: Mapping[str, Any], drop: str, key: str, value: Any) -> dict:
    out = {k: v for k, v in params.items() if k != drop}
    out[key] = value
    return out


def linen_pipeline_to_reference(variables: Mapping[str, Any], cfg: Config) -> dict:
    """Linen variables of the pipelined decoder -> those of the reference decoder (boxed)."""
    params = variables["params"]
    if "pipeline" not in params:
        raise layout.LayoutError(
            "no 'pipeline' subtree in the Linen params: not a pipelined decoder's variables"
        )
    arrays, names = strip_boxes(params["pipeline"]["layers"])
    ref_arrays = layout.pipeline_to_reference(arrays, cfg)
    some_slot = next(iter(names.values()))
    ref_names = jax.tree.map(
        lambda n: layout.pipeline_names_to_reference(n, cfg),
        some_slot,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    ref_layers = restore_boxes(ref_arrays, ref_names)
    return {**variables, "params": _replace_subtree(params, "pipeline", "layers", ref_layers)}


def linen_reference_to_pipeline(variables: Mapping[str, Any], cfg: Config) -> dict:
    """Linen variables of the reference decoder -> those of the pipelined decoder (boxed)."""
    params = variables["params"]
    if "layers" not in params:
        raise layout.LayoutError(
            "no 'layers' subtree in the Linen params: not a reference decoder's variables"
        )
    arrays, names = strip_boxes(params["layers"])
    stage_arrays = layout.reference_to_pipeline(arrays, cfg)
    stage_names = jax.tree.map(
        lambda n: layout.reference_names_to_pipeline(n, cfg),
        names,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    stages = {slot: restore_boxes(tree, stage_names) for slot, tree in stage_arrays.items()}
    return {
        **variables,
        "params": _replace_subtree(params, "layers", "pipeline", {"layers": stages}),
    }
