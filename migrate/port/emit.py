"""The NNX module's source: each traced submodule planned as an NNX layer (or bridged through
`nnx.bridge.ToNNX`, a marked stub), `__init__(self, <fields>, *, rngs)` written with their
concrete input sizes, and the Linen `__call__` rewritten around them (`source.rewrite_call`)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from typing import Any

import libcst as cst

from migrate.port import source as src
from migrate.port.layers import LAYERS, Layer, literal
from migrate.port.trace import Child, Trace

HEADER = "# Written by `migrate port`"  # the first line of every file it writes
STUB = "migrate port: STUB"


@dataclasses.dataclass(frozen=True)
class Stub:
    """A construct left untranslated: its Linen line, the idiom, and what stands in for it."""

    line: int
    idiom: str
    note: str

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
    """The NNX module's source and what it holds."""

    code: str
    placed: tuple[Placed, ...]
    stubs: tuple[Stub, ...]


def snake(name: str) -> str:
    """`LayerNorm_0` -> `layer_norm_0`."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]


class _Planner:
    def __init__(self, source: src.ClassSource, trace: Trace, names: str) -> None:
        self.source, self.trace, self.names = source, trace, names
        self.scope = vars(source.module)
        self.init_lines: list[str] = []
        self.edits: dict[int, src.CallEdit] = {}
        self.self_edits: dict[int, src.SelfEdit] = {}
        self.placed: list[Placed] = []
        self.stubs: list[Stub] = []

    def attribute(self, linen_name: str) -> str:
        return linen_name if self.names == "linen" else snake(linen_name)

    # Submodules ----------------------------------------------------------------------------

    def sites(self) -> None:
        sites, children = self.source.sites, self.trace.children
        looped = next((s for s in sites if s.in_loop), None)
        if looped is not None:
            raise src.PortError(
                f"line {looped.line}: a submodule created in a loop is not ported yet"
            )
        if len(sites) != len(children):
            lines = ", ".join(str(s.line) for s in sites)
            raise src.PortError(
                f"{len(sites)} submodule constructors in __call__ (lines {lines}) but the "
                f"trace created {len(children)}: conditional submodules are not ported yet"
            )
        for site, child in zip(sites, children, strict=True):
            if site.explicit_name not in (None, child.name):
                raise src.PortError(f"line {site.line}: the trace names it {child.name}")
            self.site(site, child)

    def site(self, site: src.Site, child: Child) -> None:
        attr = self.attribute(child.name)
        layer = LAYERS.get(site.target) if site.target is not None else None
        why = "not a layer `migrate port` translates yet" if layer is None else None
        if layer is not None:
            why = self.layer(site, child, attr, layer)
            if why is None:
                return
        self.bridge(site, child, attr, why)

    def layer(self, site: src.Site, child: Child, attr: str, layer: Layer) -> str | None:
        """Plan `site` as `layer`'s NNX form; the reason it cannot be (None: planned)."""
        refusal = layer.refusal(child.attributes)
        if refusal is not None:
            return refusal
        if not child.called:
            return "never called: its input size is unknown"
        order = _fields(layer.linen)
        given: dict[str, cst.BaseExpression] = {}
        for i, arg in enumerate(site.node.args):
            if arg.star:
                return "*args or **kwargs in its constructor"
            field = arg.keyword.value if arg.keyword else order[i]
            if field != "name":
                given[field] = arg.value
        carried = layer.carried()
        parameters = layer.nnx_parameters()
        init_args: dict[str, str] = {}
        call_args: list[tuple[str, cst.BaseExpression]] = []
        for field, value in given.items():
            if field not in carried:
                return f"{field}= has no NNX argument"
            nnx_name = layer.renamed.get(field, field)
            if src.is_static(value, self.scope):
                init_args[nnx_name] = _code(value)
            elif field in layer.at_call and site.called is not None:
                call_args.append((nnx_name, value))
            else:  # computed in __call__: its traced value
                traced = literal(child.attributes[field])
                if traced is None:
                    return f"{field}= is computed in __call__ and not a literal"
                init_args[nnx_name] = traced
        for field in sorted(carried - set(given)):
            nnx_name = layer.renamed.get(field, field)
            value = child.attributes[field]
            default = parameters[nnx_name].default
            text = literal(value)
            if value is None or text is None or field in layer.at_call:
                continue
            if default is inspect.Parameter.empty or not _same(value, default):
                init_args[nnx_name] = text
        sizes = layer.sizes(child.inputs[0], child.attributes)
        args = [*sizes, *(f"{k}={v}" for k, v in init_args.items()), "rngs=rngs"]
        self.init_lines.append(f"self.{attr} = nnx.{layer.nnx.__name__}({', '.join(args)})")
        self.edits[id(site.node)] = src.CallEdit(attr, tuple(call_args), layer.call_renamed)
        self.placed.append(Placed(child.name, attr, layer.label))
        return None

    def bridge(self, site: src.Site, child: Child, attr: str, why: str) -> None:
        """`site` as the Linen module itself inside `nnx.bridge.ToNNX`, initialised on its
        traced inputs: a marked stub."""
        what = _code(site.node.func)
        idiom = f"{what}(...) ({why})" if site.target is not None else f"{what}(...)"
        kept = [a for a in site.node.args if not (a.keyword and a.keyword.value == "name")]
        linen = _code(site.node.with_changes(args=src.commas(kept)))
        inputs = [_example(x) for x in child.inputs]
        kwargs = [f"{k}={literal(v)}" for k, v in child.literal_kwargs.items()]
        if not src.is_static(site.node, self.scope) or None in inputs or not child.called:
            note = "reads values of __call__ or is never called: port it by hand"
            self.init_lines += [
                f"# {STUB} (Linen line {site.line}): {idiom}: {note}",
                f"self.{attr} = None",
            ]
            self.stubs.append(Stub(site.line, idiom, note))
        else:
            note = "bridged through nnx.bridge.ToNNX; port it by hand"
            self.init_lines += [
                f"# {STUB} (Linen line {site.line}): {idiom}: {note}",
                f"self.{attr} = nnx.bridge.ToNNX({linen}, rngs=rngs)",
                f"nnx.bridge.lazy_init(self.{attr}, {', '.join([*inputs, *kwargs])})",
            ]
            self.stubs.append(Stub(site.line, idiom, note))
        self.edits[id(site.node)] = src.CallEdit(attr)
        self.placed.append(Placed(child.name, attr, "bridged (nnx.bridge.ToNNX)"))

    # self.param, self.sow and the rest of Linen's own methods -------------------------------

    def self_calls(self) -> None:
        for call in self.source.self_calls:
            if call.method == "param":
                self.param(call)
            elif call.method == "sow":
                self.sow(call)
            elif call.method in src.LINEN_ONLY:
                note = "Linen-only API, left as written: port it by hand"
                self.mark(call, f"self.{call.method}", note)

    def mark(self, call: src.SelfCall, idiom: str, note: str) -> None:
        comment = f"{STUB} (Linen line {call.line}): {idiom}: {note}"
        self.self_edits[id(call.node)] = src.SelfEdit(None, comment)
        self.stubs.append(Stub(call.line, idiom, note))

    def param(self, call: src.SelfCall) -> None:
        args = call.node.args
        name = args[0].value if args else None
        if not isinstance(name, cst.SimpleString) or len(args) < 2:
            return self.mark(call, "self.param", "a computed name: port it by hand")
        attr = name.evaluated_value
        shape = self.trace.variables.get("params", {}).get((attr,))
        parts = ["rngs.params()"]
        for i, arg in enumerate(args[2:]):
            if src.is_static(arg.value, self.scope):
                parts.append(_code(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT)))
            elif i == 0 and shape is not None:
                parts.append(repr(tuple(shape.shape)))
            else:
                return self.mark(call, "self.param", "its arguments read values of __call__")
        if not src.is_static(args[1].value, self.scope):
            return self.mark(call, "self.param", "its initializer reads values of __call__")
        init = _code(args[1].value)
        self.init_lines.append(f"self.{attr} = nnx.Param({init}({', '.join(parts)}))")
        read = cst.parse_expression(f"self.{attr}[...]")
        self.self_edits[id(call.node)] = src.SelfEdit(read)
        self.placed.append(Placed(attr, attr, "self.param -> nnx.Param"))

    def sow(self, call: src.SelfCall) -> None:
        args = call.node.args
        first = args[0].value if args else None
        if not (isinstance(first, cst.SimpleString) and first.evaluated_value == "intermediates"):
            return self.mark(call, "self.sow", "a collection other than intermediates")
        changed = [args[0].with_changes(value=cst.parse_expression("nnx.Intermediate")), *args[1:]]
        self.self_edits[id(call.node)] = src.SelfEdit(call.node.with_changes(args=changed))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _example(x: Any) -> str | None:
    if not hasattr(x, "shape"):
        return literal(x)
    return f"jnp.zeros({tuple(x.shape)!r}, jnp.{x.dtype.name})"


def _init(source: src.ClassSource, lines: list[str]) -> cst.FunctionDef:
    """`__init__(self, <fields>, *, rngs)`: each field kept as an attribute, then `lines`."""
    params = [
        _code(f.target) + ": " + _code(f.annotation.annotation)
        + (f" = {_code(f.value)}" if f.value is not None else "")
        for f in source.fields
    ]  # fmt: skip
    names = [_code(f.target) for f in source.fields]
    signature = ", ".join(["self", *params, "*", "rngs: nnx.Rngs"])
    body = [f"self.{n} = {n}" for n in names] + lines
    text = f"def __init__({signature}):\n" + "".join(f"    {line}\n" for line in body or ["pass"])
    return cst.parse_statement(text)


def emit(source: src.ClassSource, trace: Trace, names: str = "linen") -> Emitted:
    """The NNX module file's source for `source`, planned against `trace`."""
    planner = _Planner(source, trace, names)
    planner.sites()
    planner.self_calls()
    taken = [p.attribute for p in planner.placed]
    clash = sorted({a for a in taken if taken.count(a) > 1} | (set(taken) & _own(source)))
    if clash:
        raise src.PortError(f"attribute names collide in the port: {', '.join(clash)}")
    call = src.rewrite_call(source, planner.edits, planner.self_edits)
    init = _init(source, planner.init_lines)
    body = []
    for statement in source.class_def.body.body:
        if isinstance(statement, cst.SimpleStatementLine) and any(
            statement.body[0] is f for f in source.fields
        ):
            continue
        if statement is source.call:
            blank = [cst.EmptyLine()] if body else []
            body += [init.with_changes(leading_lines=blank), call]
            if not call.leading_lines:
                body[-1] = call.with_changes(leading_lines=[cst.EmptyLine()])
        else:
            body.append(statement)
    nnx_base = cst.Arg(cst.parse_expression("nnx.Module"))
    class_def = source.class_def.with_changes(
        bases=[nnx_base], body=source.class_def.body.with_changes(body=body), decorators=[]
    )
    class_code = cst.Module(body=[class_def]).code
    head = _imports(source, class_def)
    code = f"{head}\n\n\n{class_code}"
    return Emitted(code, tuple(planner.placed), tuple(planner.stubs))


def _own(source: src.ClassSource) -> set[str]:
    methods = {s.name.value for s in source.class_def.body.body if isinstance(s, cst.FunctionDef)}
    return methods | {_code(f.target) for f in source.fields}


def _imports(source: src.ClassSource, class_def: cst.ClassDef) -> str:
    """The imports the written class reads: NNX's, and the source module's globals it uses."""
    lines = ["import jax", "import jax.numpy as jnp", "from flax import nnx"]
    provided = {"jax", "jnp", "nnx"}
    module, scope = source.module, vars(source.module)
    imported = []
    for name in sorted(src.names_in(class_def) - provided):
        if name not in scope or name == source.cls.__name__:
            continue
        value = scope[name]
        if isinstance(value, types.ModuleType):
            last = value.__name__.rsplit(".", 1)[-1]
            alias = "" if last == name and "." not in value.__name__ else f" as {name}"
            lines.append(f"import {value.__name__}{alias}")
        else:
            imported.append(name)
    if imported:
        lines.append(f"from {module.__name__} import {', '.join(imported)}")
    return "\n".join(lines)
