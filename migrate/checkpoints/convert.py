"""Weight converters between Linen variables and NNX state, and between weight layouts.

Pure functions: they build new trees and never mutate their inputs. Framework conversion moves
the same array objects (no copies); only layout changes (pipeline <-> reference) reshape.
Strict: every mismatch (missing or extra leaf, shape, dtype, logical names) is collected and
raised at once in a `ConversionError` that lists every offending path with both sides' values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from migrate.common import axes, layout
from migrate.config.contract import Config

Names = tuple[str | None, ...]
Path = tuple[str, ...]
# Whether two annotations of one weight agree (default: equal names).
SameNames = Callable[[Names | None, Names | None], bool]

# Linen path prefix -> NNX path prefix, for module pairs whose paths must differ. The twins in
# migrate/linen and migrate/nnx agree on every path, so the project's own map is empty; a
# contributor whose pair differs declares the renames here (or passes `renames=`), and the same
# map serves both directions.
LINEN_TO_NNX_RENAMES: Mapping[Path, Path] = {}

# NNX state that has no Linen counterpart: filtered explicitly, by type, never silently.
NNX_ONLY_STATE = (nnx.RngState,)
# Linen collection -> NNX Variable type, as the twins use them: parameters only. A module pair
# with other state maps more (`parity.module_pair.calls.DEFAULT_COLLECTIONS`).
PARAMS_ONLY: Mapping[str, type] = {"params": nnx.Param}


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


def rename_path(path: Path, renames: Mapping[Path, Path]) -> Path:
    """`path` with its longest prefix among `renames`' keys replaced (not the first in order)."""
    old = max((o for o in renames if path[: len(o)] == tuple(o)), key=len, default=None)
    return path if old is None else (*renames[old], *path[len(old) :])


def _inverse(renames: Mapping[Path, Path]) -> dict[Path, Path]:
    return {new: old for old, new in renames.items()}


def _describe(value: Any, names: Names | None) -> str:
    shape = tuple(getattr(value, "shape", ()))
    dtype = getattr(value, "dtype", type(value).__name__)
    return f"shape {shape} {dtype} names {names}"


def _path_str(path: Path) -> str:
    return "/".join(path)


def _keyed_str(key: Path) -> str:
    """A (collection, *path) key as messages show it: parameters by path alone, other
    collections prefixed (`batch_stats/bn/mean`)."""
    return _path_str(key[1:] if key[0] == "params" else key)


def collection_of(variable_type: type, collections: Mapping[str, type] = PARAMS_ONLY) -> str | None:
    """The Linen collection an NNX Variable type maps to: its own entry, else the entry of
    its nearest mapped base class (a `Param` subclass is a parameter); None when unmapped."""
    for name, mapped in collections.items():
        if variable_type is mapped:
            return name
    for cls in variable_type.__mro__[1:]:
        for name, mapped in collections.items():
            if cls is mapped:
                return name
    return None


def _counterpart(collections: Mapping[str, type]) -> str:
    return " or ".join(repr(c) for c in collections)


def nnx_flat_variables(
    state: nnx.State, collections: Mapping[str, type] = PARAMS_ONLY
) -> dict[Path, nnx.Variable]:
    """(collection, *path) -> Variable of an NNX state, for every Variable type `collections`
    maps; RNG state dropped by type; anything else refused."""
    flat: dict[Path, nnx.Variable] = {}
    unknown = []
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(k) for k in path)
        collection = collection_of(type(variable), collections)
        if collection is not None and not isinstance(variable, NNX_ONLY_STATE):
            flat[(collection, *path)] = variable
        elif not isinstance(variable, NNX_ONLY_STATE):
            unknown.append(
                f"{_path_str(path)}: {type(variable).__name__} has no Linen "
                f"{_counterpart(collections)} counterpart"
            )
    if unknown:
        raise ConversionError("NNX state", unknown)
    return flat


def nnx_flat_params(state: nnx.State) -> dict[Path, nnx.Variable]:
    """Path -> Param of an NNX state; RNG state dropped by type; anything else refused."""
    return {key[1:]: v for key, v in nnx_flat_variables(state).items()}


def nnx_names(variable: nnx.Variable) -> Names | None:
    names = variable.get_metadata().get("out_sharding")
    return None if names is None else tuple(names)


def _check_pair(
    key: Path, linen_value, linen_names, nnx_value, nnx_names_, same_names: SameNames | None = None
) -> list[str]:
    problems = []
    where = _keyed_str(key)
    if tuple(linen_value.shape) != tuple(nnx_value.shape):
        problems.append(
            f"{where}: shape differs: Linen {tuple(linen_value.shape)} vs NNX "
            f"{tuple(nnx_value.shape)}"
        )
    if linen_value.dtype != nnx_value.dtype:
        problems.append(
            f"{where}: dtype differs: Linen {linen_value.dtype} vs NNX {nnx_value.dtype}"
        )
    if not (same_names or operator.eq)(linen_names, nnx_names_):
        problems.append(f"{where}: logical names differ: Linen {linen_names} vs NNX {nnx_names_}")
    return problems


def _match(
    direction: str,
    linen_flat: dict[Path, tuple[Any, Names | None]],
    nnx_flat: dict[Path, tuple[Any, Names | None]],
    same_names: SameNames | None = None,
) -> None:
    """Raise one ConversionError listing every missing, extra and mismatching path (keys
    are (collection, *path)); names agree when equal, or as `same_names` says."""
    problems = []
    for key in sorted(set(nnx_flat) - set(linen_flat)):
        problems.append(
            f"{_keyed_str(key)}: missing on the Linen side (NNX: {_describe(*nnx_flat[key])})"
        )
    for key in sorted(set(linen_flat) - set(nnx_flat)):
        problems.append(
            f"{_keyed_str(key)}: missing on the NNX side (Linen: {_describe(*linen_flat[key])})"
        )
    for key in sorted(set(linen_flat) & set(nnx_flat)):
        problems += _check_pair(key, *linen_flat[key], *nnx_flat[key], same_names)
    if problems:
        raise ConversionError(direction, problems)


def _linen_flat(
    variables: Mapping[str, Any], renames: Mapping[Path, Path], collections: Any = ("params",)
) -> dict[Path, tuple[Any, Names | None]]:
    """(collection, *NNX path) -> (array, logical names) of the given Linen collections."""
    flat = {}
    for collection in collections:
        arrays, names = strip_boxes(variables.get(collection, {}))
        flat_names = flatten_dict(names)
        for path, value in flatten_dict(arrays).items():
            flat[(collection, *rename_path(path, renames))] = (value, flat_names[path])
    return flat


# ------------------------------------------------------------------ Linen <-> NNX


def linen_to_nnx(
    variables: Mapping[str, Any],
    target: nnx.Module | nnx.State,
    renames: Mapping[Path, Path] = LINEN_TO_NNX_RENAMES,
    collections: Mapping[str, type] = PARAMS_ONLY,
    same_names: SameNames | None = None,
) -> nnx.State:
    """Linen variables -> a new NNX State shaped like `target`'s mapped variables.

    `target` is an NNX model or its (possibly abstract, from `nnx.eval_shape`) state; it is not
    modified. `collections` maps each Linen collection to its NNX Variable type (default: only
    `params` <-> `nnx.Param`). Every mapped NNX Variable must be matched by a Linen leaf of the
    same shape, dtype and logical names (or names `same_names` accepts: the NNX Variables keep
    their own); the arrays are moved, not copied.
    """
    if "params" not in variables:
        raise ConversionError(
            "Linen -> NNX", [f"no 'params' collection (found {sorted(variables)})"]
        )
    extra_collections = sorted(set(variables) - set(collections))
    if extra_collections:
        raise ConversionError(
            "Linen -> NNX", [f"collection {c!r} has no NNX counterpart" for c in extra_collections]
        )
    state = nnx.state(target) if isinstance(target, nnx.Module) else target
    nnx_flat = nnx_flat_variables(state, collections)
    linen_flat = _linen_flat(variables, renames, collections)
    nnx_described = {k: (v, nnx_names(v)) for k, v in nnx_flat.items()}
    _match("Linen -> NNX", linen_flat, nnx_described, same_names)
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state(
            {k[1:]: v.replace(linen_flat[k][0]) for k, v in nnx_flat.items()}
        )


def nnx_to_linen(
    state: nnx.Module | nnx.State,
    target: Mapping[str, Any] | None = None,
    renames: Mapping[Path, Path] = LINEN_TO_NNX_RENAMES,
    collections: Mapping[str, type] = PARAMS_ONLY,
) -> dict[str, Any]:
    """NNX variables -> Linen `{'params': ..., other collections}` with `LogicallyPartitioned`
    boxes restored (names from each Variable's `out_sharding`).

    `collections` maps Linen collections to NNX Variable types (default: `params` only); the
    result always has `params` and every other collection that has a variable. With `target`
    (Linen variables, possibly abstract from `jax.eval_shape(model.init, ...)`) every leaf of
    every mapped collection is checked against it.
    """
    state = nnx.state(state) if isinstance(state, nnx.Module) else state
    inverse = _inverse(renames)
    flat = {
        (k[0], *rename_path(k[1:], inverse)): (v.get_value(), nnx_names(v))
        for k, v in nnx_flat_variables(state, collections).items()
    }
    if target is not None:
        _match("NNX -> Linen", _linen_flat(target, {}, collections), flat)
    out: dict[str, Any] = {"params": {}}
    for collection in collections:
        part = {k[1:]: v for k, v in flat.items() if k[0] == collection}
        if part or collection == "params":
            arrays = unflatten_dict({p: v for p, (v, _) in part.items()})
            names = unflatten_dict({p: n for p, (_, n) in part.items()})
            out[collection] = restore_boxes(arrays, names)
    return out


def check_linen(
    variables: Mapping[str, Any],
    target: Mapping[str, Any],
    direction: str = "NNX -> Linen",
    same_names: SameNames | None = None,
) -> dict[str, Any]:
    """`variables` (Linen variables, boxed) when every leaf of every collection of `target`
    (possibly abstract, from `jax.eval_shape(model.init, ...)`) is matched in path, shape,
    dtype and logical names, and `variables` has nothing more; otherwise one ConversionError
    listing every mismatch. Names `same_names` accepts become the target's (its model's own)."""
    collections = sorted(set(target) | set(variables))
    target_flat = _linen_flat(target, {}, collections)
    _match(direction, target_flat, _linen_flat(variables, {}, collections), same_names)
    if same_names is None:
        return dict(variables)
    arrays, _ = strip_boxes(dict(variables))
    key = lambda path: tuple(str(k.key) for k in path)  # (collection, *path)
    names = jax.tree_util.tree_map_with_path(lambda p, _: target_flat[key(p)][1], arrays)
    return restore_boxes(arrays, names)


# ------------------------------------------------------------------ layouts


def _replace_subtree(params: Mapping[str, Any], drop: str, key: str, value: Any) -> dict:
    out = {k: v for k, v in params.items() if k != drop}
    out[key] = value
    return out


def _map_names(fn, names: Any) -> Any:
    return jax.tree.map(fn, names, is_leaf=lambda x: isinstance(x, tuple))


def linen_pipeline_to_reference(variables: Mapping[str, Any], cfg: Config) -> dict:
    """Linen variables of the pipelined decoder -> those of the reference decoder (boxed); the
    layers after a pipelined subset follow the pipelined ones (`migrate.common.placement`)."""
    params = variables["params"]
    if "pipeline" not in params:
        raise layout.LayoutError(
            "no 'pipeline' subtree in the Linen params: not a pipelined decoder's variables"
        )
    arrays, names = strip_boxes(params["pipeline"]["layers"])
    after = params.get(axes.LAYERS_AFTER_PIPELINE)
    after_arrays = None if after is None else strip_boxes(after["layers"])[0]
    ref_arrays = layout.join_reference(arrays, after_arrays, cfg)
    some_slot = next(iter(names.values()))
    ref_names = _map_names(lambda n: layout.pipeline_names_to_reference(n, cfg), some_slot)
    ref_layers = restore_boxes(ref_arrays, ref_names)
    rest = {k: v for k, v in params.items() if k != axes.LAYERS_AFTER_PIPELINE}
    return {**variables, "params": _replace_subtree(rest, "pipeline", "layers", ref_layers)}


def linen_reference_to_pipeline(variables: Mapping[str, Any], cfg: Config) -> dict:
    """Linen variables of the reference decoder -> those of the pipelined decoder (boxed): the
    first P layers into the pipeline's stages, the rest into `layers_after_pipeline`."""
    params = variables["params"]
    if "layers" not in params:
        raise layout.LayoutError(
            "no 'layers' subtree in the Linen params: not a reference decoder's variables"
        )
    arrays, names = strip_boxes(params["layers"])
    stage_arrays, after_arrays = layout.split_reference(arrays, cfg)
    stage_names = _map_names(lambda n: layout.reference_names_to_pipeline(n, cfg), names)
    stages = {slot: restore_boxes(tree, stage_names) for slot, tree in stage_arrays.items()}
    out = _replace_subtree(params, "layers", "pipeline", {"layers": stages})
    if after_arrays is not None:
        after_names = _map_names(layout.reference_names_to_after_pipeline, names)
        out[axes.LAYERS_AFTER_PIPELINE] = {"layers": restore_boxes(after_arrays, after_names)}
    return {**variables, "params": out}


def nnx_pipeline_to_reference(state: nnx.State, cfg: Config) -> nnx.State:
    """NNX parameters of the pipelined decoder -> those of the reference decoder."""
    return linen_to_nnx_unchecked(linen_pipeline_to_reference(nnx_to_linen(state), cfg))


def nnx_reference_to_pipeline(state: nnx.State, cfg: Config) -> nnx.State:
    """NNX parameters of the reference decoder -> those of the pipelined decoder."""
    return linen_to_nnx_unchecked(linen_reference_to_pipeline(nnx_to_linen(state), cfg))


def linen_to_nnx_unchecked(variables: Mapping[str, Any]) -> nnx.State:
    """Linen variables -> NNX State of Params built from the boxes alone (no target model)."""
    linen_flat = _linen_flat(variables, LINEN_TO_NNX_RENAMES)
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state(
            {
                k[1:]: nnx.Param(value, out_sharding=names)
                if names is not None
                else nnx.Param(value)
                for k, (value, names) in linen_flat.items()
            }
        )
