"""Weight converters between Linen variables and NNX state, and between weight layouts.

Pure functions: they build new trees and never mutate their inputs. Framework conversion moves
the same array objects (no copies); only layout changes (pipeline <-> reference) reshape.
Strict: every mismatch (missing or extra leaf, shape, dtype, logical names) is collected and
raised at once in a `ConversionError` that lists every offending path with both sides' values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from migrate import layout
from migrate.config import Config

Names = tuple[str | None, ...]
Path = tuple[str, ...]

# Linen path prefix -> NNX path prefix, for module pairs whose paths must differ. The twins in
# migrate/linen and migrate/nnx agree on every path, so the project's own map is empty; a
# contributor whose pair differs declares the renames here (or passes `renames=`), and the same
# map serves both directions.
LINEN_TO_NNX_RENAMES: Mapping[Path, Path] = {}

# NNX state that has no Linen counterpart: filtered explicitly, by type, never silently.
NNX_ONLY_STATE = (nnx.RngState,)


class ConversionError(ValueError):
    """Two weight trees that do not fit; the message lists every offending path."""

    def __init__(self, direction: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"{direction}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems)
        )


# ------------------------------------------------------------------ LogicallyPartitioned boxes


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def _is_names(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


def strip_boxes(tree: Any) -> tuple[Any, Any]:
    """(plain arrays, logical names) from a tree of `LogicallyPartitioned` boxes.

    Unboxed leaves get names `None`.
    """
    arrays = jax.tree.map(lambda x: x.value if _is_box(x) else x, tree, is_leaf=_is_box)
    names = jax.tree.map(lambda x: tuple(x.names) if _is_box(x) else None, tree, is_leaf=_is_box)
    return arrays, names


def restore_boxes(arrays: Any, names: Any, mesh=None, rules=None) -> Any:
    """Inverse of `strip_boxes`: leaves with names become `LogicallyPartitioned` again."""

    def box(leaf_names, value):
        if leaf_names is None:
            return value
        return nn.LogicallyPartitioned(value, leaf_names, mesh=mesh, rules=rules)

    return jax.tree.map(box, names, arrays, is_leaf=_is_names)


# ------------------------------------------------------------------ flat views


def flatten_dict(tree: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    flat: dict[Path, Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            flat.update(flatten_dict(value, path))
        else:
            flat[path] = value
    return flat


def unflatten_dict(flat: Mapping[Path, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _rename(path: Path, renames: Mapping[Path, Path]) -> Path:
    for old, new in renames.items():
        if path[: len(old)] == old:
            return (*new, *path[len(old) :])
    return path


def _inverse(renames: Mapping[Path, Path]) -> dict[Path, Path]:
    return {new: old for old, new in renames.items()}


def _describe(value: Any, names: Names | None) -> str:
    shape = tuple(getattr(value, "shape", ()))
    dtype = getattr(value, "dtype", type(value).__name__)
    return f"shape {shape} {dtype} names {names}"


def _path_str(path: Path) -> str:
    return "/".join(path)


def nnx_flat_params(state: nnx.State) -> dict[Path, nnx.Variable]:
    """Path -> Param of an NNX state; RNG state dropped by type; anything else refused."""
    params: dict[Path, nnx.Variable] = {}
    unknown = []
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(k) for k in path)
        if isinstance(variable, nnx.Param):
            params[path] = variable
        elif not isinstance(variable, NNX_ONLY_STATE):
            unknown.append(
                f"{_path_str(path)}: {type(variable).__name__} has no Linen 'params' counterpart"
            )
    if unknown:
        raise ConversionError("NNX state", unknown)
    return params


def nnx_names(variable: nnx.Variable) -> Names | None:
    names = variable.get_metadata().get("out_sharding")
    return None if names is None else tuple(names)


def _check_pair(path: Path, linen_value, linen_names, nnx_value, nnx_names_) -> list[str]:
    problems = []
    where = _path_str(path)
    if tuple(linen_value.shape) != tuple(nnx_value.shape):
        problems.append(
            f"{where}: shape differs: Linen {tuple(linen_value.shape)} vs NNX "
            f"{tuple(nnx_value.shape)}"
        )
    if linen_value.dtype != nnx_value.dtype:
        problems.append(
            f"{where}: dtype differs: Linen {linen_value.dtype} vs NNX {nnx_value.dtype}"
        )
    if linen_names != nnx_names_:
        problems.append(f"{where}: logical names differ: Linen {linen_names} vs NNX {nnx_names_}")
    return problems


def _match(
    direction: str,
    linen_flat: dict[Path, tuple[Any, Names | None]],
    nnx_flat: dict[Path, tuple[Any, Names | None]],
) -> None:
    """Raise one ConversionError listing every missing, extra and mismatching path."""
    problems = []
    for path in sorted(set(nnx_flat) - set(linen_flat)):
        problems.append(
            f"{_path_str(path)}: missing on the Linen side (NNX: {_describe(*nnx_flat[path])})"
        )
    for path in sorted(set(linen_flat) - set(nnx_flat)):
        problems.append(
            f"{_path_str(path)}: missing on the NNX side (Linen: {_describe(*linen_flat[path])})"
        )
    for path in sorted(set(linen_flat) & set(nnx_flat)):
        problems += _check_pair(path, *linen_flat[path], *nnx_flat[path])
    if problems:
        raise ConversionError(direction, problems)


def _linen_flat(params: Mapping[str, Any], renames: Mapping[Path, Path]):
    arrays, names = strip_boxes(params)
    flat_arrays = flatten_dict(arrays)
    flat_names = flatten_dict(names)
    return {_rename(p, renames): (v, flat_names[p]) for p, v in flat_arrays.items()}


# ------------------------------------------------------------------ Linen <-> NNX


def linen_to_nnx(
    variables: Mapping[str, Any],
    target: nnx.Module | nnx.State,
    renames: Mapping[Path, Path] = LINEN_TO_NNX_RENAMES,
) -> nnx.State:
    """Linen `{'params': ...}` -> a new NNX State shaped like `target`'s parameters.

    `target` is an NNX model or its (possibly abstract, from `nnx.eval_shape`) state; it is not
    modified. Every NNX Param must be matched by a Linen leaf of the same shape, dtype and
    logical names; the arrays are moved, not copied.
    """
    if "params" not in variables:
        raise ConversionError(
            "Linen -> NNX", [f"no 'params' collection (found {sorted(variables)})"]
        )
    extra_collections = sorted(set(variables) - {"params"})
    if extra_collections:
        raise ConversionError(
            "Linen -> NNX", [f"collection {c!r} has no NNX counterpart" for c in extra_collections]
        )
    state = nnx.state(target) if isinstance(target, nnx.Module) else target
    nnx_params = nnx_flat_params(state)
    linen_flat = _linen_flat(variables["params"], renames)
    _match("Linen -> NNX", linen_flat, {p: (v, nnx_names(v)) for p, v in nnx_params.items()})
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state({p: v.replace(linen_flat[p][0]) for p, v in nnx_params.items()})


def nnx_to_linen(
    state: nnx.Module | nnx.State,
    target: Mapping[str, Any] | None = None,
    renames: Mapping[Path, Path] = LINEN_TO_NNX_RENAMES,
) -> dict[str, Any]:
    """NNX parameters -> Linen `{'params': ...}` with `LogicallyPartitioned` boxes restored.

    Names come from each Param's `out_sharding`. With `target` (Linen variables, possibly
    abstract from `jax.eval_shape(model.init, ...)`) every leaf is checked against it.
    """
    state = nnx.state(state) if isinstance(state, nnx.Module) else state
    inverse = _inverse(renames)
    nnx_params = nnx_flat_params(state)
    flat = {_rename(p, inverse): (v.get_value(), nnx_names(v)) for p, v in nnx_params.items()}
    if target is not None:
        linen_flat = _linen_flat(target["params"], {})
        _match("NNX -> Linen", linen_flat, flat)
    arrays = unflatten_dict({p: v for p, (v, _) in flat.items()})
    names = unflatten_dict({p: n for p, (_, n) in flat.items()})
    return {"params": restore_boxes(arrays, names)}


def check_linen(
    variables: Mapping[str, Any], target: Mapping[str, Any], direction: str = "NNX -> Linen"
) -> dict[str, Any]:
    """`variables` (a Linen `{'params': ...}` tree, boxed) when every parameter matches
    `target`'s (possibly abstract, from `jax.eval_shape(model.init, ...)`) in path, shape,
    dtype and logical names; otherwise one ConversionError listing every mismatch."""
    _match(direction, _linen_flat(target["params"], {}), _linen_flat(variables["params"], {}))
    return dict(variables)


# ------------------------------------------------------------------ layouts


def _replace_subtree(params: Mapping[str, Any], drop: str, key: str, value: Any) -> dict:
    out = {k: v for k, v in params.items() if k != drop}
    out[key] = value
    return out


def _map_names(fn, names: Any) -> Any:
    return jax.tree.map(fn, names, is_leaf=lambda x: isinstance(x, tuple))


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
    ref_names = _map_names(lambda n: layout.pipeline_names_to_reference(n, cfg), some_slot)
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
    stage_names = _map_names(lambda n: layout.reference_names_to_pipeline(n, cfg), names)
    stages = {slot: restore_boxes(tree, stage_names) for slot, tree in stage_arrays.items()}
    return {
        **variables,
        "params": _replace_subtree(params, "layers", "pipeline", {"layers": stages}),
    }


def nnx_pipeline_to_reference(state: nnx.State, cfg: Config) -> nnx.State:
    """NNX parameters of the pipelined decoder -> those of the reference decoder."""
    return linen_to_nnx_unchecked(linen_pipeline_to_reference(nnx_to_linen(state), cfg))


def nnx_reference_to_pipeline(state: nnx.State, cfg: Config) -> nnx.State:
    """NNX parameters of the reference decoder -> those of the pipelined decoder."""
    return linen_to_nnx_unchecked(linen_reference_to_pipeline(nnx_to_linen(state), cfg))


def linen_to_nnx_unchecked(variables: Mapping[str, Any]) -> nnx.State:
    """Linen variables -> NNX State of Params built from the boxes alone (no target model)."""
    linen_flat = _linen_flat(variables["params"], LINEN_TO_NNX_RENAMES)
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state(
            {
                p: nnx.Param(value, out_sharding=names) if names is not None else nnx.Param(value)
                for p, (value, names) in linen_flat.items()
            }
        )
