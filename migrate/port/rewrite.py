"""The NNX methods written from the Linen ones (libcst: comments and formatting of untouched
lines kept): what each edit changes (a compact site read as `self.ATTR`, a call replaced or
marked, parameters read as values, ported classes by their ports' names, lists of submodules
as `nnx.List`), and the locals of a compact `__call__` that `__init__` can evaluate."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import libcst as cst
from flax import nnx

from migrate.port import ported
from migrate.port.ported import code_of
from migrate.port.source import (
    ClassSource,
    is_compact,
    is_static,
    names_read,
    resolve,
    self_attribute,
)


@dataclasses.dataclass(frozen=True)
class Local:
    """A local name assigned once in a function: its statement, value and how often it is read."""

    statement: cst.SimpleStatementLine
    value: cst.BaseExpression
    reads: int


def locals_of(function: cst.FunctionDef) -> dict[str, Local]:
    """The names `function` assigns exactly once (`name = value`, or as one of a tuple of
    names given a tuple of values: `cfg, rules = self.config, self.rules`), with their reads."""
    assigned: dict[str, list[tuple[cst.SimpleStatementLine, cst.BaseExpression | None]]] = {}
    reads: dict[str, int] = {}

    class Visitor(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
            for small in node.body:
                if isinstance(small, cst.Assign):
                    for name, value in _pairs(small):
                        assigned.setdefault(name, []).append((node, value))

        def visit_Assign(self, node: cst.Assign) -> bool:
            node.value.visit(self)
            return False

        def visit_Name(self, node: cst.Name) -> None:
            reads[node.value] = reads.get(node.value, 0) + 1

    function.body.visit(Visitor())
    single = {}
    for name, found in assigned.items():
        statement, value = found[0]
        if len(found) == 1 and len(statement.body) == 1 and value is not None:
            single[name] = Local(statement, value, reads.get(name, 0))
    return single


def _pairs(assign: cst.Assign) -> list[tuple[str, cst.BaseExpression | None]]:
    """Each name an assignment binds and the value it gives that name alone (None where it
    gives none: several targets, a starred or nested target, an unpacked value)."""
    names = [n.value for t in assign.targets for n in names_read(t.target)]
    if len(assign.targets) != 1:
        return [(n, None) for n in names]
    target, value = assign.targets[0].target, assign.value
    if isinstance(target, cst.Name):
        return [(target.value, value)]
    elements = target.elements if isinstance(target, cst.Tuple) else None
    values = value.elements if isinstance(value, cst.Tuple) else None
    if (
        elements is None or values is None or len(elements) != len(values)
        or not all(isinstance(e.value, cst.Name) for e in elements)
        or any(isinstance(v, cst.StarredElement) for v in values)
    ):  # fmt: skip
        return [(n, None) for n in names]
    return [(e.value.value, v.value) for e, v in zip(elements, values, strict=True)]


def static_values(
    locals_: Mapping[str, Local], scope: Mapping[str, Any]
) -> dict[str, cst.BaseExpression]:
    """The locals assigned once from what `__init__` can evaluate (`self`, globals, builtins),
    each with the earlier such locals it reads substituted (`cfg.dtype` ->
    `self.config.dtype`)."""
    values: dict[str, cst.BaseExpression] = {}
    for name, local in locals_.items():
        substituted = substitute(local.value, values)
        if is_static(substituted, scope):
            values[name] = substituted
    return values


def substitute(node: cst.BaseExpression, values: Mapping[str, cst.BaseExpression]) -> Any:
    """`node` with each local name read in it replaced by its value (`cfg.dtype` ->
    `self.config.dtype` where `cfg = self.config`); attributes' and keywords' own names kept."""
    read = {id(name) for name in names_read(node)}

    class Substitute(cst.CSTTransformer):
        def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> Any:
            value = values.get(original_node.value)
            if value is None or id(original_node) not in read:
                return updated_node
            simple = isinstance(value, cst.Name | cst.Attribute | cst.Subscript | cst.Call)
            return (
                value
                if simple
                else value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            )

    return node.visit(Substitute())


@dataclasses.dataclass(frozen=True)
class CallEdit:
    """How one site reads in the NNX `__call__`: `self.ATTR`, and keyword arguments added to
    the call that calls it (those NNX takes at call time)."""

    attribute: str
    call_kwargs: tuple[tuple[str, cst.BaseExpression], ...] = ()
    call_renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    expression: str | None = None  # instead of `self.ATTR`: `getattr(self, f"layers_{i}")`


@dataclasses.dataclass(frozen=True)
class SelfEdit:
    """A `self.` call rewritten (`self.param(...)` -> `self.scale[...]`) or marked."""

    replacement: cst.BaseExpression | None
    comment: str | None = None


@dataclasses.dataclass
class Edits:
    """Everything a method's rewrite changes, by node identity where it is one node."""

    sites: Mapping[int, CallEdit] = dataclasses.field(default_factory=dict)  # compact sites
    calls: Mapping[int, SelfEdit] = dataclasses.field(default_factory=dict)  # calls replaced
    param_reads: frozenset[str] = frozenset()  # `self.NAME` read as `self.NAME[...]`
    dropped: frozenset[int] = frozenset()  # statements left out
    listed: frozenset[int] = frozenset()  # lists of submodules, wrapped in `nnx.List`
    ported: Mapping[type, str] = dataclasses.field(default_factory=dict)  # class -> its port
    class_locals: frozenset[str] = frozenset()  # locals holding a (ported) class
    helpers: set[str] = dataclasses.field(default_factory=set)  # `remat_class`, ... called
    variable_reads: frozenset[str] = frozenset()  # `self.count`, `ema`: `.value` -> `[...]`
    branches: Mapping[int, str] = dataclasses.field(default_factory=dict)  # `if` -> branch kept
    # setup's layers whose NNX call takes keywords renamed: `self.drop(x, rng=k)` -> `rngs=k`
    call_renamed: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)


# Linen functions on variables -> their NNX form; None: the argument itself (an NNX Variable
# is its own box: its value and its sharding names).
LINEN_FUNCTIONS = {nn.meta.unbox: None, nn.get_partition_spec: "nnx.get_partition_spec"}


def linen_function(
    original: cst.Call, updated: cst.Call, scope: Mapping[str, Any]
) -> cst.BaseExpression | None:
    """`nn.meta.unbox(x)` -> `x`, `nn.get_partition_spec(x)` -> `nnx.get_partition_spec(x)`
    (None: `original` calls neither)."""
    target = resolve(original.func, scope)
    if not any(target is f for f in LINEN_FUNCTIONS) or len(updated.args) != 1:
        return None
    form = LINEN_FUNCTIONS[target]
    if form is None:
        return updated.args[0].value
    return updated.with_changes(func=cst.parse_expression(form))


def applied(call: cst.Call) -> cst.BaseExpression | None:
    """Linen's functional apply with weights, `template.apply({"params": w}, *args)` ->
    `nnx.merge(template, w)(*args)` (the template a `GraphDef`: `module_template`); None for
    any other call."""
    func, args = call.func, call.args
    if not (isinstance(func, cst.Attribute) and func.attr.value == "apply" and args):
        return None
    variables = args[0].value
    if args[0].keyword or args[0].star or not isinstance(variables, cst.Dict):
        return None
    elements = variables.elements
    if len(elements) != 1 or not isinstance(elements[0], cst.DictElement):
        return None
    key = elements[0].key
    if not (isinstance(key, cst.SimpleString) and key.evaluated_value == "params"):
        return None
    merged = cst.Call(
        cst.parse_expression("nnx.merge"),
        commas([cst.Arg(func.value), cst.Arg(elements[0].value)]),
    )
    return cst.Call(merged, commas(list(args[1:])))


# A Linen transform of a class -> the helper the port file defines (`ported.HELPERS`).
CLASS_TRANSFORMS = {getattr(nn, name): helper for name, helper in ported.CLASS_TRANSFORMS.items()}


class _Rewriter(cst.CSTTransformer):
    def __init__(self, scope: Mapping[str, Any], edits: Edits) -> None:
        self.scope, self.edits = scope, edits
        self.marks: list[str] = []

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        edits = self.edits
        if id(original_node) in edits.calls:
            edit = edits.calls[id(original_node)]
            if edit.comment:
                self.marks.append(edit.comment)
            return edit.replacement or updated_node
        if id(original_node) in edits.sites:
            edit = edits.sites[id(original_node)]
            if edit.expression is not None:
                return cst.parse_expression(edit.expression)
            return _self_attribute(edit.attribute)
        if isinstance(original_node.func, cst.Call) and id(original_node.func) in edits.sites:
            edit = edits.sites[id(original_node.func)]
            args = _renamed(updated_node.args, edit.call_renamed)
            given = {a.keyword.value for a in args if a.keyword}
            for name, value in edit.call_kwargs:
                if name not in given:
                    args.append(cst.Arg(value, keyword=cst.Name(name), equal=_NO_SPACE))
            return updated_node.with_changes(args=commas(args))
        renamed = edits.call_renamed.get(self_attribute(original_node.func) or "")
        if renamed:
            updated_node = updated_node.with_changes(args=_renamed(updated_node.args, renamed))
        replaced = linen_function(original_node, updated_node, self.scope) or applied(updated_node)
        if replaced is not None:
            return replaced
        template = self._template(original_node, updated_node)
        if template is not None:
            return template
        helper = CLASS_TRANSFORMS.get(resolve(original_node.func, self.scope))
        if helper is not None and self._class(original_node):
            edits.helpers.add(helper)  # the port file defines it
            return updated_node.with_changes(func=cst.Name(helper))
        return updated_node

    def _template(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression | None:
        """`Block(..., parent=None)` (an unbound Linen module, applied to weights later) of a
        ported class -> `module_template(lambda rngs: Block(..., rngs=rngs))`: its `GraphDef`."""
        target = resolve(original.func, self.scope)
        if not (isinstance(target, type) and target in self.edits.ported):
            return None
        unbound = [
            a for a in updated.args
            if a.keyword and a.keyword.value == "parent"
            and isinstance(a.value, cst.Name) and a.value.value == "None"
        ]  # fmt: skip
        if not unbound:
            return None
        kept = [a for a in updated.args if a not in unbound]
        rngs = cst.Arg(cst.Name("rngs"), keyword=cst.Name("rngs"), equal=_NO_SPACE)
        built = updated.with_changes(args=commas([*kept, rngs]))
        self.edits.helpers.add("module_template")
        return cst.parse_expression(f"module_template(lambda rngs: {code_of(built)})")

    def leave_Subscript(
        self, original_node: cst.Subscript, updated_node: cst.Subscript
    ) -> cst.BaseExpression:
        """`self.variables["params"]["layers"]` -> the `nnx.state` the plan wrote for it."""
        edit = self.edits.calls.get(id(original_node))
        return edit.replacement if edit is not None and edit.replacement else updated_node

    def leave_If(
        self, original_node: cst.If, updated_node: cst.If
    ) -> cst.BaseStatement | cst.FlattenSentinel | cst.RemovalSentinel:
        """`if self.is_initializing(): ...` (Linen's init pass, which NNX has not: a module
        is built initialised): its other branch only."""
        kept = self.edits.branches.get(id(original_node))
        if kept is None:
            return updated_node
        if kept == "body":
            return cst.FlattenSentinel(updated_node.body.body)
        other = updated_node.orelse
        if other is None:
            return cst.RemoveFromParent()
        if isinstance(other, cst.If):
            return other
        return cst.FlattenSentinel(other.body.body)

    def _class(self, call: cst.Call) -> bool:
        """`nn.remat(X, ...)` (or another transform) of a class: X a ported class or a local
        holding one."""
        first = call.args[0].value if call.args and not call.args[0].keyword else None
        if isinstance(first, cst.Name) and first.value in self.edits.class_locals:
            return True
        return first is not None and resolve(first, self.scope) in self.edits.ported

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self._ported(original_node, updated_node)

    def leave_List(self, original_node: cst.List, updated_node: cst.List) -> cst.BaseExpression:
        return self._listed(original_node, updated_node)

    def leave_ListComp(
        self, original_node: cst.ListComp, updated_node: cst.ListComp
    ) -> cst.BaseExpression:
        return self._listed(original_node, updated_node)

    def _listed(self, original_node: cst.CSTNode, updated_node: Any) -> cst.BaseExpression:
        if id(original_node) not in self.edits.listed:
            return updated_node
        return cst.Call(cst.parse_expression("nnx.List"), [cst.Arg(updated_node)])

    def _ported(self, original_node: cst.CSTNode, updated_node: Any) -> cst.BaseExpression:
        """A reference to a ported class (`modules.Block`) as the port's own name."""
        found = resolve(original_node, self.scope)
        if isinstance(found, type) and found in self.edits.ported:
            return cst.Name(self.edits.ported[found])
        return updated_node

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        """`nn.relu` -> `nnx.relu` where NNX exports the same function; a parameter made in
        `setup` read as its value, `self.kernel` -> `self.kernel[...]`; a ported class by
        its port's name."""
        marked = self.edits.calls.get(id(original_node))
        if marked is not None and marked.comment:
            self.marks.append(marked.comment)
        if (
            original_node.attr.value == "value"
            and self.edits.variable_reads
            and code_of(original_node.value) in self.edits.variable_reads
        ):  # a Linen variable's `.value`: NNX reads and writes `[...]`
            return cst.Subscript(
                updated_node.value, [cst.SubscriptElement(cst.Index(cst.Ellipsis()))]
            )
        if self_attribute(original_node) in self.edits.param_reads:
            return cst.Subscript(updated_node, [cst.SubscriptElement(cst.Index(cst.Ellipsis()))])
        ported = self._ported(original_node, updated_node)
        if ported is not updated_node:
            return ported
        if resolve(original_node.value, self.scope) is not nn:
            return updated_node
        value = getattr(nn, original_node.attr.value, None)
        same = getattr(nnx, original_node.attr.value, None)
        if value is not None and same is value and not isinstance(value, type):
            return updated_node.with_changes(value=cst.Name("nnx"))
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        if id(original_node) in self.edits.dropped:
            return cst.RemoveFromParent()
        if not self.marks:
            return updated_node
        comments = [cst.EmptyLine(comment=cst.Comment(f"# {m}")) for m in self.marks]
        self.marks = []
        return updated_node.with_changes(leading_lines=[*updated_node.leading_lines, *comments])


def _renamed(args: Any, renamed: Mapping[str, str]) -> list[cst.Arg]:
    """The arguments with the keywords `renamed` names renamed (`rng=` -> `rngs=`)."""
    return [
        a.with_changes(keyword=cst.Name(renamed[a.keyword.value]))
        if a.keyword and a.keyword.value in renamed
        else a
        for a in args
    ]


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


def rewrite(source: ClassSource, function: cst.FunctionDef, edits: Edits) -> cst.FunctionDef:
    """A method of the NNX module: `@nn.compact` dropped, each compact site `self.ATTR`, the
    edited calls (`self.param`, constructors in `setup`) replaced or marked, the parameters
    made in `setup` read as values, ported classes by their ports' names, `nn.remat`,
    `nn.jit`, `nn.scan` and `nn.vmap` of a class as the port file's helpers, lists of
    submodules as `nnx.List`, `nn.FUNCTION` -> `nnx.FUNCTION`, the dropped statements left
    out; the rest as written."""
    written = function.visit(_Rewriter(vars(source.module), edits))
    kept = [d for d in written.decorators if not is_compact(d)]
    return written.with_changes(decorators=kept)
