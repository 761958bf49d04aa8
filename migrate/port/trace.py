"""One abstract run of a Linen module (`jax.eval_shape` of its `init`), with Flax's method
interception recording each direct submodule: its name (`Dense_0` or its own), class,
attributes and the inputs of its first call, in the order the module constructed them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta

LITERALS = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class Child:
    """A direct submodule as the trace saw it."""

    name: str
    cls: type
    attributes: Mapping[str, Any]  # its dataclass fields (parent and name left out)
    inputs: tuple[Any, ...] = ()  # the positional arguments of its first call, abstract
    literal_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    called: bool = False


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one abstract `init` created: the direct submodules in construction order, every
    variable's shape and dtype per collection (paths under the module), and whether a dropout
    drew random numbers."""

    children: tuple[Child, ...]
    variables: Mapping[str, Mapping[tuple[str, ...], jax.ShapeDtypeStruct]]
    stochastic: bool

    def child(self, name: str) -> Child | None:
        return next((c for c in self.children if c.name == name), None)


def attributes(module: nn.Module) -> dict[str, Any]:
    """A Linen module's dataclass fields and values, `parent` and `name` left out."""
    return {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }


def _abstract(value: Any) -> Any:
    return jax.ShapeDtypeStruct(value.shape, value.dtype) if hasattr(value, "shape") else value


def _draws(module: nn.Module, kwargs: Mapping[str, Any]) -> bool:
    """A dropout call that draws: a rate above zero, not deterministic."""
    if not isinstance(module, nn.Dropout) or module.rate == 0:
        return False
    given = kwargs.get("deterministic")
    return (module.deterministic if given is None else given) is False


def _flat(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    return flat


def trace(module: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> Trace:
    """`module.init` on `inputs` and `kwargs`, abstractly (nothing is computed or allocated)."""
    seen: dict[str, Child] = {}
    order: list[str] = []
    stochastic = False

    def record(next_fun, args, call_kwargs, context):
        nonlocal stochastic
        bound = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **call_kwargs)
        stochastic = stochastic or _draws(bound, call_kwargs)
        path = bound.path if bound.scope is not None else ()
        if len(path) == 1 and path[0] not in seen:
            literal = {k: v for k, v in call_kwargs.items() if isinstance(v, LITERALS)}
            seen[path[0]] = Child(
                path[0],
                type(bound),
                attributes(bound),
                tuple(_abstract(a) for a in args),
                literal,
                called=True,
            )
        out = next_fun(*args, **call_kwargs)
        if not path and not order:  # the module itself: its children, as constructed
            order.extend(bound._state.children)
            for name, child in bound._state.children.items():
                if isinstance(child, nn.Module) and name not in seen:
                    seen[name] = Child(name, type(child), attributes(child))
        return out

    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    with nn.intercept_methods(record):
        variables = jax.eval_shape(lambda *args: module.init(keys, *args, **kwargs), *inputs)
    variables = meta.unbox(variables)
    children = tuple(seen[name] for name in order if name in seen)
    flat = {collection: _flat(tree) for collection, tree in variables.items()}
    return Trace(children, flat, stochastic)
