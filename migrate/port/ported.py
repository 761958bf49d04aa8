"""The vocabulary of a port: what a written class holds (`Placed`), what it leaves
untranslated (`Stub`), what one class's code is (`Emitted`), the marks written into the files,
and the helpers a port file defines where an idiom has no NNX one-liner."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import libcst as cst

HEADER = "# Written by `migrate port`"  # the first line of every file it writes
STUB = "migrate port: STUB"
# Written into a port file that calls them: NNX forms of Linen idioms with no NNX one-liner.
HELPERS = {
    "remat_class": '''def remat_class(cls, **options):
    """`nn.remat(cls, ...)` in NNX: `cls` with its `__call__` rematerialised by `nnx.remat`
    (`static_argnums` count `self` as 0, as Linen's do)."""
    return type(cls.__name__, (cls,), {"__call__": nnx.remat(cls.__call__, **options)})''',
    "jit_class": '''def jit_class(cls, **options):
    """`nn.jit(cls, ...)` in NNX: `cls` with its `__call__` compiled by `nnx.jit`."""
    return type(cls.__name__, (cls,), {"__call__": nnx.jit(cls.__call__, **options)})''',
    "stacked_class": '''def _stacked(cls, size, variable_axes, split_rngs, metadata_params):
    """`cls` whose instances hold `size` instances' variables stacked on a leading axis: built
    under `nnx.vmap`, each with its own keys, the axis named in the sharding metadata as
    Linen's `metadata_params` names it."""
    del split_rngs  # every stream is split: the weights are the Linen side's, moved over
    if any(axis != 0 for axis in (variable_axes or {}).values()):
        raise NotImplementedError(f"variable_axes={variable_axes}: only a leading axis is ported")
    name = (metadata_params or {}).get(nnx.PARTITION_NAME)  # Linen's key: the same string
    metadata = {nnx.PARTITION_NAME: name} if name is not None else {}

    class Stacked(cls):
        def __init__(self, *args, rngs, **kwargs):
            @nnx.split_rngs(splits=size)  # every stream: each instance its own keys
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=size, transform_metadata=metadata)
            def build(rngs):
                return cls(*args, rngs=rngs, **kwargs)

            built = build(rngs)
            cls.__init__(self, *args, rngs=rngs, **kwargs)
            nnx.update(self, nnx.state(built))

    Stacked.__name__ = Stacked.__qualname__ = cls.__name__
    return Stacked, metadata


def _axis(axis):
    """Linen's `nn.broadcast` is NNX's `None`."""
    return None if type(axis).__name__ == "_Broadcast" else axis


def scan_class(cls, *, length, in_axes=0, out_axes=0, variable_axes=None, split_rngs=None,
               metadata_params=None, **options):
    """`nn.scan(cls, ...)` in NNX: `length` stacked instances (`_stacked`), called by
    `nnx.scan` over them: `(carry, *xs) -> (carry, ys)`."""
    stacked, metadata = _stacked(cls, length, variable_axes, split_rngs, metadata_params)
    ins = tuple(map(_axis, in_axes if isinstance(in_axes, tuple) else (in_axes,)))

    def __call__(self, carry, *xs):
        @nnx.scan(in_axes=(0, nnx.Carry, *ins[: len(xs)]), out_axes=(nnx.Carry, _axis(out_axes)),
                  length=length, transform_metadata=metadata, **options)
        def step(module, carry, *xs):
            return cls.__call__(module, carry, *xs)

        return step(self, carry, *xs)

    stacked.__call__ = __call__
    return stacked


def vmap_class(cls, *, axis_size, in_axes=0, out_axes=0, variable_axes=None, split_rngs=None,
               metadata_params=None, **options):
    """`nn.vmap(cls, ...)` in NNX: `axis_size` stacked instances (`_stacked`), each applied to
    its slice of the inputs by `nnx.vmap`."""
    stacked, metadata = _stacked(cls, axis_size, variable_axes, split_rngs, metadata_params)

    def __call__(self, *xs):
        ins = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(xs)

        @nnx.vmap(in_axes=(0, *map(_axis, ins)), out_axes=out_axes, transform_metadata=metadata,
                  **options)
        def apply(module, *xs):
            return cls.__call__(module, *xs)

        return apply(self, *xs)

    stacked.__call__ = __call__
    return stacked''',
    "module_template": '''def module_template(create):
    """`Module(..., parent=None)` in NNX: the structure (`GraphDef`) of the module `create(rngs)`
    builds, nothing allocated; `nnx.merge(template, weights)` applies it to weights, as Linen's
    `template.apply({"params": weights}, ...)`."""
    with nnx.use_eager_sharding(False):
        return nnx.graphdef(nnx.eval_shape(lambda: create(nnx.Rngs(0))))''',
    "stacked_modules": '''def stacked_modules(create, size, axis_name, rngs):
    """`size` modules from `create(rngs)`, each with its own keys, their variables stacked on a
    leading axis (named `axis_name` in the sharding metadata where not None): the submodule a
    Linen transform with `variable_axes={...: 0}` stacks, as NNX builds it."""
    metadata = {nnx.PARTITION_NAME: axis_name} if axis_name is not None else {}

    @nnx.split_rngs(splits=size)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=size, transform_metadata=metadata)
    def build(rngs):
        return create(rngs)

    return build(rngs)''',
    "function_transforms": '''def _leading(variable_axes, metadata_params):
    """Only a leading stacked axis is ported. Its name (`metadata_params`) was added to the
    weights' sharding metadata where they were stacked (`stacked_modules`); a call leaves the
    metadata as it is: where the weights were sliced by other means first (a pipeline's stage
    applied to its slice), the axis is no longer the leading one."""
    del metadata_params
    if any(axis != 0 for axis in (variable_axes or {}).values()):
        raise NotImplementedError(f"variable_axes={variable_axes}: only a leading axis is ported")


def scan_function(fn, *, length=None, in_axes=0, out_axes=0, variable_axes=None,
                  split_rngs=None, metadata_params=None, **options):
    """`nn.scan(fn, ...)` of a function `fn(module, carry, *xs) -> (carry, ys)` in NNX: the
    module's variables (stacked on a leading axis: `stacked_modules`) scanned by `nnx.scan`
    with the carry, `in_axes` for `xs` (`None`: broadcast, Linen's `nn.broadcast`)."""
    del split_rngs  # the module's keys were split where it was stacked
    _leading(variable_axes, metadata_params)

    def scanned(module, carry, *xs):
        ins = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(xs)
        step = nnx.scan(fn, in_axes=(0, nnx.Carry, *ins), out_axes=(nnx.Carry, out_axes),
                        length=length, **options)
        return step(module, carry, *xs)

    return scanned


def vmap_function(fn, *, in_axes=0, out_axes=0, axis_size=None, variable_axes=None,
                  split_rngs=None, metadata_params=None, **options):
    """`nn.vmap(fn, ...)` of a function `fn(module, *xs)` in NNX: the module's variables
    (stacked on a leading axis: `stacked_modules`) mapped by `nnx.vmap` with `xs`."""
    del split_rngs  # the module's keys were split where it was stacked
    _leading(variable_axes, metadata_params)

    def mapped(module, *xs):
        ins = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(xs)
        apply = nnx.vmap(fn, in_axes=(0, *ins), out_axes=out_axes, axis_size=axis_size,
                         **options)
        return apply(module, *xs)

    return mapped''',
}
# The helpers a rewritten Linen transform of a class calls, and the one defining them.
CLASS_TRANSFORMS = {
    "remat": "remat_class",
    "checkpoint": "remat_class",
    "jit": "jit_class",
    "scan": "scan_class",
    "vmap": "vmap_class",
}
DEFINED_BY = {
    "scan_class": "stacked_class",
    "vmap_class": "stacked_class",
    "scan_function": "function_transforms",
    "vmap_function": "function_transforms",
}


@dataclasses.dataclass(frozen=True)
class Stub:
    """A construct left untranslated: its Linen line, the idiom, and what stands in for it."""

    line: int
    idiom: str
    note: str
    linen_code: bool = False  # Linen-only code left in the class: it cannot run in NNX

    def __str__(self) -> str:
        return f"line {self.line}: {self.idiom}: {self.note}"

    @property
    def comment(self) -> str:
        """The mark the port's code carries where the construct stands."""
        return f"{STUB} (Linen line {self.line}): {self.idiom}: {self.note}"


@dataclasses.dataclass(frozen=True)
class Placed:
    """A Linen submodule or parameter and where the port holds it."""

    linen: str
    attribute: str
    form: str  # `nn.Dense -> nnx.Linear`, `bridged (nnx.bridge.ToNNX)`, `self.param -> nnx.Param`


@dataclasses.dataclass(frozen=True)
class Emitted:
    """One NNX class's source and what it holds."""

    code: str
    placed: tuple[Placed, ...]
    stubs: tuple[Stub, ...]
    needs: frozenset[tuple[str, str]] = frozenset()  # (module, name) its traced values name
    helpers: frozenset[str] = frozenset()  # functions of `HELPERS` the class calls
    variable_types: Mapping[str, str] = dataclasses.field(default_factory=dict)  # collection
    functions: tuple[Any, ...] = ()  # `functions.FunctionPort`s of the user's functions it calls


def snake(name: str) -> str:
    """`LayerNorm_0` -> `layer_norm_0`."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def variable_class(name: str, collection: str) -> str:
    """The `nnx.Variable` subclass a port file defines for a Linen collection."""
    return f'class {name}(nnx.Variable):\n    """The Linen collection `{collection}`."""\n'
