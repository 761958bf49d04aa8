"""The vocabulary of a port: what a written class holds (`Placed`), what it leaves
untranslated (`Stub`), what one class's code is (`Emitted`), the marks written into the files,
and the helpers a port file defines where an idiom has no NNX one-liner."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import libcst as cst

HEADER = "# Written by `migrate port`"  # the first line of every file it writes
STUB = "migrate port: STUB"
# Written into a port file that calls them: NNX forms of Linen idioms with no NNX one-liner.
HELPERS = {
    "remat_class": '''def remat_class(cls, **options):
    """`nn.remat(cls, ...)` in NNX: `cls` with its `__call__` rematerialised by `nnx.remat`
    (`static_argnums` count `self` as 0, as Linen's do)."""
    return type(cls.__name__, (cls,), {"__call__": nnx.remat(cls.__call__, **options)})''',
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


def snake(name: str) -> str:
    """`LayerNorm_0` -> `layer_norm_0`."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def variable_class(name: str, collection: str) -> str:
    """The `nnx.Variable` subclass a port file defines for a Linen collection."""
    return f'class {name}(nnx.Variable):\n    """The Linen collection `{collection}`."""\n'
