"""A Linen module's source, read and rewritten with libcst (comments and formatting of
untouched lines kept): its class, fields and compact `__call__`, the submodule constructors
in it in evaluation order, and the rewrite of its body into an NNX `__call__`."""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import textwrap
import types
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import libcst as cst
from flax import nnx
from libcst.metadata import MetadataWrapper, PositionProvider

from migrate.errors import BadInput

LINEN_ONLY = ("variable", "make_rng", "is_initializing", "is_mutable_collection", "put_variable")
LOOPS = (cst.For, cst.While, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)


class PortError(BadInput):
    """A module `migrate port` cannot read or port: exit 2, one line."""


@dataclasses.dataclass(frozen=True)
class Site:
    """A submodule constructed in `__call__`: `nn.Dense(8, name="fc1")`."""

    node: cst.Call
    line: int
    target: Any  # the class it constructs, or None (a transform's product: `nn.scan(...)`)
    explicit_name: str | None
    called: cst.Call | None  # the call that calls it at once: `nn.Dense(8)(x)`
    in_loop: bool


@dataclasses.dataclass(frozen=True)
class SelfCall:
    """A `self.param(...)`, `self.sow(...)` or other Linen-only method called in `__call__`."""

    node: cst.Call
    line: int
    method: str


@dataclasses.dataclass(frozen=True)
class ClassSource:
    """The parsed class and what `migrate port` reads off it."""

    cls: type
    module: types.ModuleType
    first_line: int
    class_def: cst.ClassDef
    call: cst.FunctionDef
    fields: tuple[cst.AnnAssign, ...]
    sites: tuple[Site, ...]
    self_calls: tuple[SelfCall, ...]


def read(cls: type) -> ClassSource:
    """`cls`'s source, parsed; PortError for a class without a compact `__call__`."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise PortError(f"{cls!r} is not a Linen module class (flax.linen.Module)")
    try:
        lines, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        raise PortError(f"{cls.__qualname__}: its source cannot be read") from None
    tree = cst.parse_module(textwrap.dedent("".join(lines)))
    wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    class_def = next(s for s in tree.body if isinstance(s, cst.ClassDef))
    methods = {s.name.value: s for s in class_def.body.body if isinstance(s, cst.FunctionDef)}
    if "setup" in methods:
        raise PortError(f"{cls.__qualname__}: setup-style modules are not ported yet")
    call = methods.get("__call__")
    if call is None or not any(_is_compact(d) for d in call.decorators):
        raise PortError(f"{cls.__qualname__}: no @nn.compact __call__ to port")
    others = [m for name, m in methods.items() if name != "__call__"]
    if any(_is_compact(d) for m in others for d in m.decorators):
        raise PortError(f"{cls.__qualname__}: compact methods besides __call__ are not ported yet")
    fields = tuple(
        s.body[0]
        for s in class_def.body.body
        if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.AnnAssign)
    )
    module = inspect.getmodule(cls)
    finder = _Finder(vars(module), positions, first - 1)
    call.visit(finder)
    return ClassSource(
        cls, module, first, class_def, call, fields, tuple(finder.sites), tuple(finder.self_calls)
    )


def _is_compact(decorator: cst.Decorator) -> bool:
    node = decorator.decorator
    return (isinstance(node, cst.Attribute) and node.attr.value == "compact") or (
        isinstance(node, cst.Name) and node.value == "compact"
    )


def resolve(node: cst.BaseExpression, scope: Mapping[str, Any]) -> Any:
    """The object a `Name` or `a.b.c` chain names in `scope` (None where it names none)."""
    if isinstance(node, cst.Name):
        return scope.get(node.value, getattr(builtins, node.value, None))
    if isinstance(node, cst.Attribute):
        base = resolve(node.value, scope)
        return None if base is None else getattr(base, node.attr.value, None)
    return None


def names_in(node: cst.CSTNode) -> set[str]:
    """The bare names an expression reads (attributes' own names left out)."""
    found: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)
            return False

        def visit_Arg(self, node: cst.Arg) -> bool:  # a keyword is no name read
            node.value.visit(self)
            return False

        def visit_Name(self, node: cst.Name) -> None:
            found.add(node.value)

    node.visit(Names())
    return found


def is_static(node: cst.CSTNode, scope: Mapping[str, Any]) -> bool:
    """An expression `__init__` can evaluate: it reads only `self`, globals and builtins."""
    return all(n == "self" or n in scope or hasattr(builtins, n) for n in names_in(node))


TRANSFORMS = {nn.scan, nn.vmap, nn.remat, nn.checkpoint, nn.jit, nn.map_variables, nn.remat_scan}


class _Finder(cst.CSTVisitor):
    """Submodule constructors and `self.` method calls, in evaluation order."""

    def __init__(self, scope: Mapping[str, Any], positions: Mapping, offset: int) -> None:
        self.scope, self.positions, self.offset = scope, positions, offset
        self.sites: list[Site] = []
        self.self_calls: list[SelfCall] = []
        self.loops = 0
        self.calling: dict[int, cst.Call] = {}

    def _line(self, node: cst.CSTNode) -> int:
        return self.positions[node].start.line + self.offset

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, LOOPS):
            self.loops += 1
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if isinstance(original_node, LOOPS):
            self.loops -= 1
        super().on_leave(original_node)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Call):
            self.calling[id(node.func)] = node
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value == "self"
        ):
            self.self_calls.append(SelfCall(node, self._line(node), func.attr.value))
            return
        target = resolve(func, self.scope)
        product = isinstance(func, cst.Call) and resolve(func.func, self.scope) in TRANSFORMS
        if not (product or (isinstance(target, type) and issubclass(target, nn.Module))):
            return
        name = next((a.value for a in node.args if a.keyword and a.keyword.value == "name"), None)
        explicit = name.evaluated_value if isinstance(name, cst.SimpleString) else None
        self.sites.append(
            Site(
                node,
                self._line(node),
                None if product else target,
                explicit,
                self.calling.get(id(node)),
                self.loops > 0,
            )
        )


@dataclasses.dataclass(frozen=True)
class CallEdit:
    """How one site reads in the NNX `__call__`: `self.ATTR`, and keyword arguments added to
    the call that calls it (those NNX takes at call time)."""

    attribute: str
    call_kwargs: tuple[tuple[str, cst.BaseExpression], ...] = ()
    call_renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SelfEdit:
    """A `self.` call rewritten (`self.param(...)` -> `self.scale[...]`) or marked."""

    replacement: cst.BaseExpression | None
    comment: str | None = None


class _Rewriter(cst.CSTTransformer):
    def __init__(
        self,
        scope: Mapping[str, Any],
        sites: Mapping[int, CallEdit],
        self_edits: Mapping[int, SelfEdit],
    ) -> None:
        self.scope, self.sites, self.self_edits = scope, sites, self_edits
        self.marks: list[str] = []

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if id(original_node) in self.self_edits:
            edit = self.self_edits[id(original_node)]
            if edit.comment:
                self.marks.append(edit.comment)
            return edit.replacement or updated_node
        if id(original_node) in self.sites:
            return _self_attribute(self.sites[id(original_node)].attribute)
        if isinstance(original_node.func, cst.Call) and id(original_node.func) in self.sites:
            edit = self.sites[id(original_node.func)]
            args = [
                a.with_changes(keyword=cst.Name(edit.call_renamed[a.keyword.value]))
                if a.keyword and a.keyword.value in edit.call_renamed
                else a
                for a in updated_node.args
            ]
            given = {a.keyword.value for a in args if a.keyword}
            for name, value in edit.call_kwargs:
                if name not in given:
                    args.append(cst.Arg(value, keyword=cst.Name(name), equal=_NO_SPACE))
            return updated_node.with_changes(args=commas(args))
        return updated_node

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        """`nn.relu` -> `nnx.relu` where NNX exports the same function."""
        if resolve(original_node.value, self.scope) is not nn:
            return updated_node
        value = getattr(nn, original_node.attr.value, None)
        same = getattr(nnx, original_node.attr.value, None)
        if value is not None and same is value and not isinstance(value, type):
            return updated_node.with_changes(value=cst.Name("nnx"))
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if not self.marks:
            return updated_node
        comments = [cst.EmptyLine(comment=cst.Comment(f"# {m}")) for m in self.marks]
        self.marks = []
        return updated_node.with_changes(leading_lines=[*updated_node.leading_lines, *comments])


_NO_SPACE = cst.AssignEqual(
    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
)


def commas(args: list[cst.Arg]) -> list[cst.Arg]:
    """The arguments with a comma after each but the last."""
    out = []
    for i, arg in enumerate(args):
        last = i == len(args) - 1
        if last:
            out.append(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT))
        elif arg.comma is cst.MaybeSentinel.DEFAULT:
            out.append(
                arg.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            )
        else:
            out.append(arg)
    return out


def _self_attribute(name: str) -> cst.Attribute:
    return cst.Attribute(value=cst.Name("self"), attr=cst.Name(name))


def rewrite_call(
    source: ClassSource,
    sites: Mapping[int, CallEdit],
    self_edits: Mapping[int, SelfEdit],
) -> cst.FunctionDef:
    """The NNX `__call__`: `@nn.compact` dropped, each site `self.ATTR`, the Linen-only calls
    rewritten or marked, `nn.FUNCTION` -> `nnx.FUNCTION`; everything else as written."""
    rewriter = _Rewriter(vars(source.module), sites, self_edits)
    call = source.call.visit(rewriter)
    kept = [d for d in call.decorators if not _is_compact(d)]
    return call.with_changes(decorators=kept)
