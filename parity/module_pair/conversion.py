"""A user's own weight conversion between a Linen module and its NNX port, where paths alone do
not carry the weights: a fused QKV kernel, a reshaped `DenseGeneral` kernel, a transposed
layout, a recurrent cell's gates in another order.

`Conversion(to_nnx, to_linen)` holds two functions on plain nested dicts of arrays:
`to_nnx(linen_variables)` takes `{'params': {...}, 'batch_stats': {...}, ...}` (Linen's
collections, boxes removed) and returns the NNX module's state as `nnx.to_pure_dict` shows it
(every Param and mapped state Variable, no RNG state); `to_linen` is its inverse. Both are
checked strictly: each result must hold exactly the other side's paths, in its shapes and
dtypes (one `ConversionError` listing every mismatch), and the `roundtrip` check holds the pair
to bit-exact round trips both ways. Gradients go through `to_linen` too (the NNX gradients in
place of the parameters), which is exact for what such maps are: moves, transposes, reshapes,
splits and concatenations. The converted parameters carry the Linen module's logical names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flax import nnx

from migrate.checkpoints import convert
from migrate.checkpoints.convert import ConversionError
from migrate.errors import BadInput

Path = tuple[str, ...]
PlainTree = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Conversion:
    """Linen variables -> NNX state (`to_nnx`) and back (`to_linen`), as plain nested dicts."""

    to_nnx: Callable[[PlainTree], Mapping[str, Any]]
    to_linen: Callable[[PlainTree], Mapping[str, Any]]


class ConversionHookError(BadInput):
    """The user's conversion function raised: their code, not the port's nor this tool's."""


def _called(function: Callable[[PlainTree], Any], name: str, tree: PlainTree) -> Any:
    try:
        return function(tree)
    except Exception as error:
        raise ConversionHookError(
            f"conversion.{name} raised {type(error).__name__}: {str(error).strip()[:300]}"
        ) from error


def _described(value: Any) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return f"a {type(value).__name__}, not an array"
    return f"{np.dtype(dtype).name}{list(shape)}"


def _matched(direction: str, given: Mapping[Path, Any], expected: Mapping[Path, Any]) -> None:
    """One ConversionError listing every path `given` lacks or adds against `expected`, and
    every shape or dtype that differs."""
    problems = [
        f"{'/'.join(p)}: missing (expected {_described(expected[p])})"
        for p in sorted(set(expected) - set(given))
    ]
    problems += [
        f"{'/'.join(p)}: not in the target (got {_described(given[p])})"
        for p in sorted(set(given) - set(expected))
    ]
    for p in sorted(set(given) & set(expected)):
        got, want = given[p], expected[p]
        if getattr(got, "shape", None) != getattr(want, "shape", None) or getattr(
            got, "dtype", None
        ) != getattr(want, "dtype", None):
            problems.append(f"{'/'.join(p)}: got {_described(got)}, expected {_described(want)}")
    if problems:
        raise ConversionError(f"{direction} (conversion hook)", problems)


def _flat(tree: Any, what: str) -> dict[Path, Any]:
    if not isinstance(tree, Mapping):
        raise ConversionError(what, [f"returned a {type(tree).__name__}, expected a dict"])
    return convert.flatten_dict(dict(tree))


def to_nnx_state(conversion: Conversion, variables: Mapping[str, Any], template: nnx.State) -> Any:
    """Linen variables (boxed or not) -> a new State shaped like `template` (the NNX module's
    Params and mapped state), through `conversion.to_nnx`, strictly checked."""
    plain, _ = convert.strip_boxes(dict(variables))
    converted = _flat(_called(conversion.to_nnx, "to_nnx", plain), "Linen -> NNX (conversion hook)")
    slots = {tuple(str(k) for k in path): v for path, v in nnx.to_flat_state(template)}
    _matched("Linen -> NNX", converted, {p: v.get_value() for p, v in slots.items()})
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state(
            {
                path: variable.replace(converted[tuple(str(k) for k in path)])
                for path, variable in nnx.to_flat_state(template)
            }
        )


def to_linen_variables(
    conversion: Conversion, state: nnx.State, target: Mapping[str, Any]
) -> dict[str, Any]:
    """An NNX State (the module's Params and mapped state) -> Linen variables boxed as `target`
    (the Linen module's variables, possibly abstract), through `conversion.to_linen`, strictly
    checked."""
    plain = nnx.to_pure_dict(state)
    converted = _flat(
        _called(conversion.to_linen, "to_linen", plain), "NNX -> Linen (conversion hook)"
    )
    arrays, names = convert.strip_boxes(dict(target))
    expected = convert.flatten_dict(arrays)
    _matched("NNX -> Linen", converted, expected)
    flat_names = convert.flatten_dict(names)
    return convert.restore_boxes(
        convert.unflatten_dict(converted), convert.unflatten_dict(flat_names)
    )


def grads_to_linen(
    conversion: Conversion, grads: nnx.State, template: nnx.State, target: Mapping[str, Any]
) -> dict[str, Any]:
    """The NNX Params' gradients in Linen's `params` tree: `to_linen` of the module's state with
    each parameter's gradient in its place (the state Variables keep their values)."""
    grad_flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(grads)}
    with nnx.use_eager_sharding(False):
        merged = nnx.from_flat_state(
            {
                path: variable.replace(grad_flat[key].get_value())
                if (key := tuple(str(k) for k in path)) in grad_flat
                else variable
                for path, variable in nnx.to_flat_state(template)
            }
        )
    return to_linen_variables(conversion, merged, target)["params"]
