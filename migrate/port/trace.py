"""One abstract run of a Linen module (`jax.eval_shape` of its `init`), with Flax's method
interception recording every submodule at any depth: its name (`Dense_0` or its own), class,
attributes, the inputs of its first call and its own submodules, in construction order."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta

LITERALS = (bool, int, float, str, type(None))
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Child:
    """A submodule as the trace saw it."""

    name: str
    cls: type
    attributes: Mapping[str, Any]  # its dataclass fields (parent and name left out)
    inputs: tuple[Any, ...] = ()  # the positional arguments of its first call, abstract
    literal_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    called: bool = False
    path: Path = ()
    children: tuple[str, ...] = ()  # its own submodules' names, as constructed


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one abstract `init` created under the module at `root`: every module of the tree
    by path, every variable's shape and dtype per collection (paths under `root`), and
    whether a dropout drew random numbers."""

    nodes: Mapping[Path, Child]
    variables: Mapping[str, Mapping[Path, jax.ShapeDtypeStruct]]
    stochastic: bool
    root: Path = ()
    # The sharding names of each boxed variable (`nn.with_logical_partitioning`), by collection.
    partitions: Mapping[str, Mapping[Path, tuple]] = dataclasses.field(default_factory=dict)

    @property
    def module(self) -> Child:
        return self.nodes[self.root]

    @property
    def children(self) -> tuple[Child, ...]:
        """The direct submodules of `root`, in construction order."""
        return tuple(self.nodes[(*self.root, n)] for n in self.module.children)

    def child(self, name: str) -> Child | None:
        return self.nodes.get((*self.root, name))

    def at(self, name: str) -> Trace:
        """The trace of the direct submodule `name`: its tree and its variables."""
        return Trace(
            self.nodes,
            _under(self.variables, name),
            self.stochastic,
            (*self.root, name),
            _under(self.partitions, name),
        )

    def stacked_axes(self, name: str) -> list[tuple[int, str | None]]:
        """The leading axes every parameter under the submodule `name` shares: each one's size
        and the sharding name every boxed parameter gives it (None where they differ or none
        is boxed); what Linen transforms stacking its variables made of them, the
        outermost first."""
        params = _under(self.variables, name).get("params", {})
        names = _under(self.partitions, name).get("params", {})
        shapes = [leaf.shape for leaf in params.values()]
        axes: list[tuple[int, str | None]] = []
        for i in range(min((len(s) for s in shapes), default=0)):
            sizes = {s[i] for s in shapes}
            at = {n[i] if len(n) > i else None for n in names.values()}
            if len(sizes) != 1:
                break
            axes.append((sizes.pop(), at.pop() if len(at) == 1 else None))
        return axes


def _under(tree: Mapping[str, Mapping[Path, Any]], name: str) -> dict[str, dict[Path, Any]]:
    """Per collection, the entries under the submodule `name`, their paths below it."""
    out = {
        collection: {path[1:]: leaf for path, leaf in leaves.items() if path[0] == name}
        for collection, leaves in tree.items()
    }
    return {c: leaves for c, leaves in out.items() if leaves}


def fields_of(cls: type | nn.Module) -> list[str]:
    """A Linen class's constructor fields, `parent` and `name` left out."""
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]


def attributes(module: nn.Module) -> dict[str, Any]:
    """A Linen module's field values, by `fields_of`."""
    return {name: getattr(module, name) for name in fields_of(module)}


def _abstract(value: Any) -> Any:
    return jax.ShapeDtypeStruct(value.shape, value.dtype) if hasattr(value, "shape") else value


def _draws(module: nn.Module, kwargs: Mapping[str, Any]) -> bool:
    """A dropout call that draws: a rate above zero, not deterministic."""
    if not isinstance(module, nn.Dropout) or module.rate == 0:
        return False
    given = kwargs.get("deterministic")
    return (module.deterministic if given is None else given) is False


def _flat(tree: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    flat: dict[Path, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    return flat


def _submodules(module: nn.Module) -> dict[str, nn.Module]:
    return {n: c for n, c in module._state.children.items() if isinstance(c, nn.Module)}


def trace(
    module: nn.Module,
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    method: str | None = None,
) -> Trace:
    """`module.init` on `inputs` and `kwargs` (calling `method`, default `__call__`),
    abstractly (nothing is computed or allocated)."""
    called: dict[Path, tuple[type, dict, tuple, dict]] = {}
    built: dict[Path, nn.Module] = {}
    stochastic = False

    def record(next_fun, args, call_kwargs, context):
        nonlocal stochastic
        bound = context.module
        path = tuple(bound.path) if bound.scope is not None else ()
        if context.method_name == "__call__" or (not path and context.method_name == method):
            stochastic = stochastic or _draws(bound, call_kwargs)
            if path not in called:
                literal = {k: v for k, v in call_kwargs.items() if isinstance(v, LITERALS)}
                inputs = tuple(_abstract(a) for a in args)
                called[path] = (type(bound), attributes(bound), inputs, literal)
        out = next_fun(*args, **call_kwargs)
        built.setdefault(path, bound)
        return out

    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    with nn.intercept_methods(record):
        variables = jax.eval_shape(
            lambda *args: module.init(keys, *args, method=method, **kwargs), *inputs
        )
    boxed = lambda x: isinstance(x, meta.Partitioned)
    partitions: dict[str, dict[Path, tuple]] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(variables, is_leaf=boxed)[0]:
        if boxed(leaf):
            path = tuple(str(k.key) for k in key_path)
            partitions.setdefault(path[0], {})[path[1:]] = tuple(leaf.names)
    variables = meta.unbox(variables)

    nodes: dict[Path, Child] = {}

    def add(path: Path, bound: nn.Module) -> None:
        kids = _submodules(bound)
        for name, kid in kids.items():
            add((*path, name), built.get((*path, name), kid))
        if path in called:
            cls, attrs, args, literal = called[path]
            nodes[path] = Child(path[-1] if path else "", cls, attrs, args, literal, True,
                                path, tuple(kids))  # fmt: skip
        else:
            nodes[path] = Child(path[-1] if path else "", type(bound), attributes(bound),
                                path=path, children=tuple(kids))  # fmt: skip

    add((), built[()])
    flat = {collection: _flat(tree) for collection, tree in variables.items()}
    return Trace(nodes, flat, stochastic, partitions=partitions)
