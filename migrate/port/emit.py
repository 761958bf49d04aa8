"""One NNX class written from one Linen class: each traced submodule planned as an NNX layer,
as the port of a user's own class, or bridged through `nnx.bridge.ToNNX` (a marked stub);
`__init__(self, <fields>, *, rngs)` written with their concrete input sizes (a compact
module's constructors moved there, a `setup` body inlined there), and every method rewritten
around them (`source.rewrite`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
from collections.abc import Collection, Mapping
from typing import Any

import flax.linen as nn
import libcst as cst

from migrate.port import source as src
from migrate.port.layers import LAYERS, Layer, imports_for, literal
from migrate.port.trace import Child, Trace

HEADER = "# Written by `migrate port`"  # the first line of every file it writes
STUB = "migrate port: STUB"
PARTITIONING = {nn.with_logical_partitioning, nn.with_partitioning}  # -> `out_sharding=`
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


def snake(name: str) -> str:
    """`LayerNorm_0` -> `layer_norm_0`."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]


def _without_name(node: cst.Call) -> list[cst.Arg]:
    return [a for a in node.args if not (a.keyword and a.keyword.value == "name")]


class _Planner:
    def __init__(
        self,
        source: src.ClassSource,
        trace: Trace | None,
        names: str,
        ported: Collection[type],
        refused: Mapping[type, str],
    ) -> None:
        self.source, self.trace, self.names = source, trace, names
        self.ported, self.refused = ported, refused
        self.scope = vars(source.module)
        self.init_lines: list[str] = []
        self.edits: dict[int, src.CallEdit] = {}
        self.self_edits: dict[int, src.SelfEdit] = {}
        self.param_reads: set[str] = set()
        self.dropped: set[int] = set()  # statements left out: `init = nn.with_...(f, names)`
        self.listed: set[int] = set()  # lists of submodules made in setup
        body = source.call if source.style == "compact" else source.setup
        self.locals = src.locals_of(body) if body is not None else {}
        self.placed: list[Placed] = []
        self.stubs: list[Stub] = []
        self.needs: set[tuple[str, str]] = set()

    def literal(self, value: Any) -> str | None:
        """`literal(value)`, the classes it names imported by the port."""
        text = literal(value)
        if text is not None:
            self.needs |= imports_for(value)
        return text

    @property
    def fields(self) -> Mapping[str, Any]:
        """The traced instance's field values (none for a class the trace never built)."""
        return self.trace.module.attributes if self.trace is not None else {}

    def attribute(self, linen_name: str) -> str:
        return linen_name if self.names == "linen" else snake(linen_name)

    def text(self, node: cst.BaseExpression) -> str | None:
        """`node` as `__init__` evaluates it: as written in `setup`; in a compact `__call__`,
        with the locals assigned once from such values substituted (`cfg.dtype` ->
        `self.config.dtype`), None where it reads values of the call."""
        if self.source.style == "setup":
            return code_of(node)
        substituted = src.substitute(node, self.values)
        return code_of(substituted) if src.is_static(substituted, self.scope) else None

    @functools.cached_property
    def values(self) -> dict[str, cst.BaseExpression]:
        """The compact `__call__`'s locals assigned once from what `__init__` can evaluate."""
        values: dict[str, cst.BaseExpression] = {}
        for name, local in self.locals.items():
            substituted = src.substitute(local.value, values)
            if src.is_static(substituted, self.scope):
                values[name] = substituted
        return values

    def size(self, value: int | tuple[int, ...]) -> str:
        """A traced size, through the module's own field where one holds it."""
        fields = self.fields
        own = next((k for k, v in fields.items() if type(v) is type(value) and v == value), None)
        return f"self.{own}" if own is not None else repr(value)

    # Submodules of a compact __call__ ------------------------------------------------------

    def compact_sites(self) -> None:
        children = list(self.trace.children)
        traced = {c.name for c in children}
        sites = [s for s in self.source.sites if not s.factory or s.explicit_name in traced]
        looped = {id(s.node): self.loop_names(s) for s in sites if s.in_loop}
        in_loops = {n for names in looped.values() for n in names}
        rest = [c for c in children if c.name not in in_loops]
        single = [s for s in sites if not s.in_loop]
        if len(single) != len(rest):
            lines = ", ".join(str(s.line) for s in single)
            raise src.PortError(
                f"{len(single)} submodule constructors in __call__ (lines {lines}) but the "
                f"trace created {len(rest)}: conditional submodules are not ported yet"
            )
        matched = iter(zip(single, rest, strict=True))
        loops_written: set[int] = set()
        for site in sites:
            if site.in_loop:
                self.loop_site(site, looped[id(site.node)], loops_written)
                continue
            site, child = next(matched)
            if site.explicit_name not in (None, child.name):
                raise src.PortError(f"line {site.line}: the trace names it {child.name}")
            attr = self.attribute(child.name)
            expression, form = self.constructor(site, child)
            if expression is None:
                self.init_lines.append(f"self.{attr} = {form}")
                form = "stub"
            else:
                self.init_lines.append(f"self.{attr} = {expression}")
            self.edits[id(site.node)] = src.CallEdit(attr, *self.call_changes(site))
            self.placed.append(Placed(child.name, attr, form))

    def loop_names(self, site: src.Site) -> list[str]:
        """The names a submodule made in a `for` loop takes, one per iteration: its `name=`
        evaluated over the loop's iterable (which `__init__` must be able to evaluate)."""
        loop = site.loop
        name = next(
            (a.value for a in site.node.args if a.keyword and a.keyword.value == "name"), None
        )
        if not isinstance(loop, cst.For) or name is None:
            raise src.PortError(
                f"line {site.line}: a submodule made in a loop is ported only from a `for` loop "
                'with an explicit name= (name=f"layers_{i}")'
            )
        iterable = self.text(loop.iter)
        if iterable is None:
            raise src.PortError(f"line {site.line}: the loop's iterable reads values of __call__")
        target = code_of(loop.target)
        names = self.evaluate(f"[{code_of(name)} for {target} in {iterable}]")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise src.PortError(f"line {site.line}: its names cannot be evaluated")
        return names

    def loop_site(self, site: src.Site, names: list[str], written: set[int]) -> None:
        """`for ...: setattr(self, NAME, CONSTRUCTOR)` in `__init__` (every iteration's
        constructor the same code), `getattr(self, NAME)` where `__call__` built it."""
        loop = site.loop
        name = next(a.value for a in site.node.args if a.keyword and a.keyword.value == "name")
        forms = {self.constructor(site, self.trace.child(n)) for n in names}
        if len(forms) != 1:
            raise src.PortError(f"line {site.line}: its iterations need different constructors")
        ((expression, form),) = forms
        if expression is None:
            raise src.PortError(f"line {site.line}: {form.split('# ', 1)[1]}")
        if id(loop) not in written:
            written.add(id(loop))
            self.init_lines.append(f"for {code_of(loop.target)} in {self.text(loop.iter)}:")
        self.init_lines.append(f"    setattr(self, {code_of(name)}, {expression})")
        getter = f"getattr(self, {code_of(name)})"
        self.edits[id(site.node)] = src.CallEdit(names[0], *self.call_changes(site), getter)
        self.placed += [Placed(n, n, form) for n in names]

    def evaluate(self, text: str) -> Any:
        """`text` evaluated with `self` the traced module's fields (None where it raises)."""
        fields = self.fields
        try:  # the user's own expression, from their own source, on their own values
            return eval(text, dict(self.scope), {"self": types.SimpleNamespace(**fields)})
        except Exception:
            return None

    # Submodules made in setup --------------------------------------------------------------

    def setup_sites(self) -> None:
        traced = {c.name for c in self.trace.children} if self.trace is not None else set()
        sites = [s for s in self.source.sites if not s.factory or s.explicit_name in traced]
        for site in sites:
            if site.assigned is None:
                raise src.PortError(f"line {site.line}: a submodule not assigned to self.NAME")
            if site.in_loop and site.container is None:
                raise src.PortError(
                    f"line {site.line}: a submodule made in a loop in setup, not in a list "
                    "assigned to self.NAME"
                )
        claimed = {s.explicit_name or s.assigned for s in sites if not s.in_loop}
        unclaimed = [c.name for c in self.trace.children if c.name not in claimed] if (
            self.trace is not None
        ) else []  # fmt: skip
        listed = [s for s in sites if s.in_loop]
        names: dict[str, list[Placed]] = {}
        for site in sites:
            if site.in_loop:  # `self.NAME = [Block(...) for ...]`: the trace's unclaimed ones
                linen_names = [
                    n for n in unclaimed if len(listed) == 1 or n.startswith(site.assigned)
                ]
                self.listed.add(site.container)
            else:
                linen_names = [site.explicit_name or site.assigned]  # `name=` wins in Linen
            child = self.trace.child(linen_names[0]) if self.trace and linen_names else None
            if child is not None and site.target is not None and child.cls is not site.target:
                child = None  # the branch the trace did not take
            expression, form = self.constructor(site, child)
            if expression is None:
                comment = form.split("# ", 1)[1]
                self.self_edits[id(site.node)] = src.SelfEdit(cst.Name("None"), comment)
                form = "stub"
            else:
                self.self_edits[id(site.node)] = src.SelfEdit(cst.parse_expression(expression))
            if site.in_loop:
                placed = [
                    Placed(n, f"{site.assigned}/{i}", form) for i, n in enumerate(linen_names)
                ]
            else:
                placed = [Placed(linen_names[0], site.assigned, form)]
            if child is not None or site.assigned not in names:
                names[site.assigned] = placed
        self.placed += [p for placed in names.values() for p in placed]

    # One constructor -----------------------------------------------------------------------

    def constructor(self, site: src.Site, child: Child | None) -> tuple[str | None, str]:
        """The NNX expression that builds `site` and its form (None and the stub's text where
        it cannot be built)."""
        target = site.target
        if child is not None and "nnx_class" in child.attributes:
            return self.wrapped(site, child)
        if target is not None and target in self.ported:
            return self.own(site, child, target)
        layer = LAYERS.get(target) if target is not None else None
        why = "not a layer `migrate port` translates yet" if layer is None else None
        if target in self.refused:
            why = f"not ported: {self.refused[target]}"
        if layer is not None:
            if child is None or not child.called:
                why = "never traced: its input size is unknown"
            else:
                expression, why = self.layer(site, child, layer)
                if expression is not None:
                    return expression, layer.label
        return self.bridge(site, child, why)

    def own(self, site: src.Site, child: Child | None, target: type) -> tuple[str | None, str]:
        """`TARGET(arguments, rngs=rngs)`: the port of a user's class, its arguments as written
        where `__init__` can evaluate them, their traced values (as keywords) otherwise."""
        args = _without_name(site.node)
        if any(a.star for a in args):
            return self.stub(site, "*args or **kwargs in its constructor")
        texts = [self.text(a.value) for a in args]
        if None not in texts:
            written = [
                f"{a.keyword.value}={t}" if a.keyword else t
                for a, t in zip(args, texts, strict=True)
            ]
        elif child is None:
            return self.stub(site, "reads values of __call__ and is never traced")
        else:
            written = []
            for i, (arg, text) in enumerate(zip(args, texts, strict=True)):
                field = arg.keyword.value if arg.keyword else _fields(target)[i]
                text = text or self.literal(child.attributes.get(field))
                if text is None:
                    return self.stub(site, f"{field}= reads values of __call__, not a literal")
                written.append(f"{field}={text}")
        func = code_of(site.node.func) if site.via_local else target.__name__
        return f"{func}({', '.join([*written, 'rngs=rngs'])})", f"{target.__name__} (ported)"

    def wrapped(self, site: src.Site, child: Child) -> tuple[str | None, str]:
        """An NNX module the Linen code wraps (`nnx.bridge.ToLinen`, a `to_linen` factory) is
        its own port: `NNX_CLASS(arguments, rngs=rngs)`, each argument the call's own
        expression for it where that gives the traced value, the module's field holding the
        value, or the value as a literal; a value equal to the class's default left out."""
        attributes = child.attributes
        nnx_class = attributes["nnx_class"]
        name = self.class_name(nnx_class)
        if name is None:
            return self.stub(site, f"{nnx_class.__name__} cannot be named in the port")
        given = {a.keyword.value: a.value for a in site.node.args if a.keyword}
        try:
            defaults = inspect.signature(nnx_class.__init__).parameters
        except (TypeError, ValueError):
            defaults = {}
        written = []
        for value in attributes.get("args", ()):
            text = self.value_text(None, value)
            if text is None:
                return self.stub(site, "a positional argument that is no literal")
            written.append(text)
        for key, value in dict(attributes.get("kwargs", {})).items():
            default = defaults.get(key)
            if key not in given and default is not None and _same_object(value, default.default):
                continue  # the wrapper's own default, the NNX class's too
            text = self.value_text(given.get(key), value)
            if text is None:
                return self.stub(site, f"{key}= is no literal, field or expression of the call")
            written.append(f"{key}={text}")
        if not attributes.get("skip_rng", False):
            written.append("rngs=rngs")
        return f"{name}({', '.join(written)})", f"{name} (NNX, unwrapped)"

    def value_text(self, node: cst.BaseExpression | None, value: Any) -> str | None:
        """How `__init__` writes a traced `value`: the call's expression `node` where it
        evaluates to that value, the module's field holding it, or a literal."""
        if node is not None:
            text = self.text(node)
            if text is not None and self.evaluates_to(text, value):
                return text
        fields = self.fields
        held = next((k for k, v in fields.items() if v is value and literal(v) is None), None)
        if held is not None:
            return f"self.{held}"
        return self.literal(value)

    def evaluates_to(self, text: str, value: Any) -> bool:
        """Whether `text`, evaluated with `self` the traced module's fields, gives `value`."""
        found = self.evaluate(text)
        try:
            return (found is not None or value is None) and (
                _same_object(found, value) or bool(found == value)
            )
        except Exception:
            return False

    def class_name(self, cls: type) -> str | None:
        """How the port names `cls`: through its module where the Linen file imports it
        (`linears.MlpBlock`), by a name it imports, or imported by the port itself."""
        home = inspect.getmodule(cls)
        for name, value in self.scope.items():
            if value is home and home is not None:
                return f"{name}.{cls.__name__}"
        if self.scope.get(cls.__name__) is cls:
            return cls.__name__
        if cls.__name__ in self.scope:
            return None
        self.needs.add((cls.__module__, cls.__name__))
        return cls.__name__

    def layer(self, site: src.Site, child: Child, layer: Layer) -> tuple[str | None, str | None]:
        """`nnx.LAYER(sizes, arguments, rngs=rngs)` for `site`, or None and the reason it
        cannot be."""
        refusal = layer.refusal(child.attributes)
        if refusal is not None:
            return None, refusal
        order = _fields(layer.linen)
        given: dict[str, cst.BaseExpression] = {}
        for i, arg in enumerate(site.node.args):
            if arg.star:
                return None, "*args or **kwargs in its constructor"
            field = arg.keyword.value if arg.keyword else order[i]
            if field != "name":
                given[field] = arg.value
        carried = layer.carried()
        parameters = layer.nnx_parameters()
        init_args: dict[str, str] = {}
        for field, value in given.items():
            if field not in carried:
                return None, f"{field}= has no NNX argument"
            nnx_name = layer.renamed.get(field, field)
            text = self.text(value)
            if text is not None:
                init_args[nnx_name] = text
            elif field in layer.at_call and site.called is not None:
                continue  # moved to the call (`call_changes`)
            else:  # computed in __call__: its traced value
                traced = self.literal(child.attributes[field])
                if traced is None:
                    return None, f"{field}= is computed in __call__ and not a literal"
                init_args[nnx_name] = traced
        for field in sorted(carried - set(given)):
            nnx_name = layer.renamed.get(field, field)
            value = child.attributes[field]
            default = parameters[nnx_name].default
            text = self.literal(value)
            if value is None or text is None or field in layer.at_call:
                continue
            if default is inspect.Parameter.empty or not _same(value, default):
                init_args[nnx_name] = text
        sizes = [self.size(s) for s in layer.sizes(child.inputs[0], child.attributes)]
        args = [*sizes, *(f"{k}={v}" for k, v in init_args.items()), "rngs=rngs"]
        return f"nnx.{layer.nnx.__name__}({', '.join(args)})", None

    def call_changes(self, site: src.Site) -> tuple[tuple, Mapping[str, str]]:
        """The keyword arguments a compact site's call takes in NNX (`deterministic=` moved
        from the constructor), and the call's keywords renamed (`rng` -> `rngs`)."""
        layer = LAYERS.get(site.target) if site.target is not None else None
        if layer is None or site.called is None:
            return (), {}
        moved = []
        for i, arg in enumerate(site.node.args):
            field = arg.keyword.value if arg.keyword else _fields(layer.linen)[i]
            if field in layer.at_call and not src.is_static(arg.value, self.scope):
                moved.append((layer.renamed.get(field, field), arg.value))
        return tuple(moved), layer.call_renamed

    def stub(self, site: src.Site, note: str) -> tuple[None, str]:
        idiom = f"{code_of(site.node.func)}(...)"
        self.stubs.append(Stub(site.line, idiom, f"{note}: port it by hand"))
        return None, f"None  # {STUB} (Linen line {site.line}): {idiom}: {note}"

    def bridge(
        self, site: src.Site, child: Child | None, why: str | None
    ) -> tuple[str | None, str]:
        """`site` as the Linen module itself inside `nnx.bridge.ToNNX`, initialised on its
        traced inputs: a marked stub."""
        what = code_of(site.node.func)
        idiom = f"{what}(...) ({why})" if site.target is not None else f"{what}(...)"
        linen = self.text(site.node.with_changes(args=src.commas(_without_name(site.node))))
        inputs = [_example(x) for x in child.inputs] if child is not None else [None]
        kwargs = (
            [f"{k}={self.literal(v)}" for k, v in child.literal_kwargs.items()] if child else []
        )
        if linen is None or None in inputs or child is None or not child.called:
            if child is None:
                why_not = "never built on these inputs (a branch the trace did not take)"
            elif not child.called:
                why_not = "never called, so its inputs are unknown"
            else:
                why_not = "its constructor or inputs read values of __call__"
            note = f"{why_not}: port it by hand"
            self.stubs.append(Stub(site.line, idiom, note))
            return None, f"None  # {STUB} (Linen line {site.line}): {idiom}: {note}"
        note = "bridged through nnx.bridge.ToNNX; port it by hand"
        self.stubs.append(Stub(site.line, idiom, note))
        if self.source.style == "compact":
            self.init_lines.append(f"# {STUB} (Linen line {site.line}): {idiom}: {note}")
        bridged = f"nnx.bridge.ToNNX({linen}, rngs=rngs)"
        expression = f"nnx.bridge.lazy_init({', '.join([bridged, *inputs, *kwargs])})"
        return expression, "bridged (nnx.bridge.ToNNX)"

    # self.param, self.sow and the rest of Linen's own methods -------------------------------

    def self_calls(self) -> None:
        for call in self.source.self_calls:
            if call.method == "param":
                self.param(call)
            elif call.method == "sow":
                self.sow(call)
            elif call.lifted:
                note = "a Linen lifted transform on a module: port it by hand (nnx.scan, nnx.vmap)"
                self.mark(call, call.method, note, linen_code=True)
            elif call.method in src.LINEN_ONLY or isinstance(call.node, cst.Attribute):
                note = "Linen-only API, left as written: port it by hand"
                self.mark(call, f"self.{call.method}", note, linen_code=True)

    def mark(self, call: src.SelfCall, idiom: str, note: str, linen_code: bool = False) -> None:
        comment = f"{STUB} (Linen line {call.line}): {idiom}: {note}"
        self.self_edits[id(call.node)] = src.SelfEdit(None, comment)
        self.stubs.append(Stub(call.line, idiom, note, linen_code))

    def param(self, call: src.SelfCall) -> None:
        args = call.node.args
        name = args[0].value if args else None
        if not isinstance(name, cst.SimpleString) or len(args) < 2:
            return self.mark(call, "self.param", "a computed name: port it by hand")
        linen_name = name.evaluated_value
        setup = self.source.style == "setup"
        if setup and call.assigned is None:
            return self.mark(call, "self.param", "not assigned to self.NAME in setup")
        attr = call.assigned if setup else linen_name
        variables = self.trace.variables.get("params", {}) if self.trace is not None else {}
        shape = variables.get((linen_name,))
        parts = ["rngs.params()"]
        for i, arg in enumerate(args[2:]):
            text = self.text(arg.value)
            if text is not None:
                parts.append(text)
            elif i == 0 and shape is not None:
                parts.append(repr(tuple(shape.shape)))
            else:
                return self.mark(call, "self.param", "its arguments read values of __call__")
        if self.text(args[1].value) is None:
            return self.mark(call, "self.param", "its initializer reads values of __call__")
        init, sharding = self.initializer(args[1].value)
        value = f"{init}({', '.join(parts)})"
        sharded = f", out_sharding={sharding}" if sharding else ""
        if setup:
            expression = f"nnx.Param({value}{sharded})"
            self.self_edits[id(call.node)] = src.SelfEdit(cst.parse_expression(expression))
            self.param_reads.add(attr)
        else:
            self.init_lines.append(f"self.{attr} = nnx.Param({value}{sharded})")
            read = cst.parse_expression(f"self.{attr}[...]")
            self.self_edits[id(call.node)] = src.SelfEdit(read)
        self.placed.append(Placed(linen_name, attr, "self.param -> nnx.Param"))

    def sow(self, call: src.SelfCall) -> None:
        args = call.node.args
        first = args[0].value if args else None
        if not (isinstance(first, cst.SimpleString) and first.evaluated_value == "intermediates"):
            return self.mark(call, "self.sow", "a collection other than intermediates")
        changed = [args[0].with_changes(value=cst.parse_expression("nnx.Intermediate")), *args[1:]]
        self.self_edits[id(call.node)] = src.SelfEdit(call.node.with_changes(args=changed))

    def initializer(self, init: cst.BaseExpression) -> tuple[str, str | None]:
        """`nn.with_logical_partitioning(fn, names)` -> (`fn`, `names`): the initializer and
        the `out_sharding` metadata the NNX Param carries, also through a local assigned
        once (`init = nn.with_logical_partitioning(...)`, left out where nothing else reads
        it); any other initializer as written."""
        local = self.locals.get(init.value) if isinstance(init, cst.Name) else None
        value = local.value if local else init
        if self.source.style == "compact":
            value = src.substitute(value, self.values)
        partitioned = _partitioned(value, self.scope)
        if partitioned is None:
            return self.text(init) or code_of(init), None
        if local is not None:
            uses = sum(
                1
                for c in self.source.self_calls
                if c.method == "param" and len(c.node.args) > 1
                and isinstance(c.node.args[1].value, cst.Name)
                and c.node.args[1].value.value == init.value
            )  # fmt: skip
            if uses == local.reads:
                self.dropped.add(id(local.statement))
        return partitioned


def _partitioned(init: cst.BaseExpression, scope: Mapping[str, Any]) -> tuple[str, str] | None:
    if (
        isinstance(init, cst.Call)
        and src.resolve(init.func, scope) in PARTITIONING
        and len(init.args) == 2
        and not any(a.keyword for a in init.args)
    ):
        return code_of(init.args[0].value), code_of(init.args[1].value)
    return None


def _same_object(a: Any, b: Any) -> bool:
    return a is b or _same(a, b) or _same_function(a, b)


def _same_function(a: Any, b: Any) -> bool:
    """Two closures of one function over equal values (two `nd_dense_init(1.0, ...)`)."""
    if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)):
        return False
    if a.__code__ is not b.__code__ or a.__defaults__ != b.__defaults__:
        return False
    cells = zip(a.__closure__ or (), b.__closure__ or (), strict=True)
    return all(_same_object(x.cell_contents, y.cell_contents) for x, y in cells)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _example(x: Any) -> str | None:
    if not hasattr(x, "shape"):
        return literal(x)
    return f"jnp.zeros({tuple(x.shape)!r}, jnp.{x.dtype.name})"


def _init(
    source: src.ClassSource, lines: list[str], setup: cst.FunctionDef | None
) -> cst.FunctionDef:
    """`__init__(self, <fields>, *, rngs)`: each field kept as an attribute, then `lines` (a
    compact module's constructors) or the `setup` body as rewritten."""
    params = [
        code_of(f.target) + ": " + code_of(f.annotation.annotation)
        + (f" = {code_of(f.value)}" if f.value is not None else "")
        for f in source.fields
    ]  # fmt: skip
    names = [code_of(f.target) for f in source.fields]
    signature = ", ".join(["self", *params, "*", "rngs: nnx.Rngs"])
    body = [f"self.{n} = {n}" for n in names] + lines
    text = f"def __init__({signature}):\n" + "".join(f"    {line}\n" for line in body or ["pass"])
    init = cst.parse_statement(text)
    if setup is None:
        return init
    statements = [s for s in init.body.body if body] + list(setup.body.body)
    docstring = _docstring(statements)
    if docstring is not None:  # setup's docstring first
        statements = [docstring] + [s for s in statements if s is not docstring]
    return init.with_changes(body=init.body.with_changes(body=statements))


def _docstring(statements: list[cst.BaseStatement]) -> cst.BaseStatement | None:
    for s in statements:
        if (
            isinstance(s, cst.SimpleStatementLine)
            and isinstance(s.body[0], cst.Expr)
            and isinstance(s.body[0].value, cst.SimpleString | cst.ConcatenatedString)
        ):
            return s
    return None


def emit(
    source: src.ClassSource,
    trace: Trace | None,
    names: str = "linen",
    ported: Collection[type] = (),
    refused: Mapping[type, str] | None = None,
) -> Emitted:
    """The NNX class for `source`, planned against `trace` (None: a class the trace never
    built, ported from its source alone); `ported`: the user's classes ported beside it,
    `refused`: those that could not be, and why (their sites are bridged)."""
    planner = _Planner(source, trace, names, ported, refused or {})
    if source.style == "compact":
        if trace is None:
            raise src.PortError(f"{source.cls.__name__}: compact and never traced")
        planner.compact_sites()
    elif source.style == "setup":
        planner.setup_sites()
    planner.self_calls()
    taken = [p.attribute for p in planner.placed]
    clash = sorted({a for a in taken if taken.count(a) > 1} | (set(taken) & _own(source)))
    if clash:
        raise src.PortError(f"attribute names collide in the port: {', '.join(clash)}")
    ported_names = {cls: cls.__name__ for cls in ported}
    held = frozenset(n for n, c in source.class_locals.items() if c in ported_names)
    remat: list[int] = []

    def edits(**changes: Any) -> src.Edits:
        common = dict(calls=planner.self_edits, ported=ported_names, class_locals=held)
        return src.Edits(**{**common, **changes}, remat=remat)

    setup = None
    if source.setup is not None:
        setup = src.rewrite(
            source,
            source.setup,
            edits(dropped=frozenset(planner.dropped), listed=frozenset(planner.listed)),
        )
    init = _init(source, planner.init_lines, setup)
    body: list[cst.CSTNode] = []
    placed_init = False
    for statement in source.class_def.body.body:
        if isinstance(statement, cst.SimpleStatementLine) and any(
            statement.body[0] is f for f in source.fields
        ):
            continue
        if isinstance(statement, cst.FunctionDef) and statement.name.value == "setup":
            continue
        if isinstance(statement, cst.FunctionDef):
            if not placed_init:  # `__init__` before the first method
                body.append(init.with_changes(leading_lines=_blank(body)))
                placed_init = True
            reads = frozenset(planner.param_reads)
            if statement is source.call:
                dropped = frozenset(planner.dropped)
                changes = edits(sites=planner.edits, param_reads=reads, dropped=dropped)
            else:
                changes = edits(param_reads=reads)
            method = src.rewrite(source, statement, changes)
            if not method.leading_lines:
                method = method.with_changes(leading_lines=_blank(body))
            body.append(method)
        else:
            body.append(statement)
    if not placed_init:
        body.append(init.with_changes(leading_lines=_blank(body)))
    nnx_base = cst.Arg(cst.parse_expression("nnx.Module"))
    class_def = source.class_def.with_changes(
        bases=[nnx_base], body=source.class_def.body.with_changes(body=body), decorators=[]
    )
    code = cst.Module(body=[class_def]).code
    needs = frozenset(planner.needs)
    helpers = frozenset({"remat_class"} if remat else ())
    return Emitted(code, tuple(planner.placed), tuple(planner.stubs), needs, helpers)


def _blank(before: list[cst.CSTNode]) -> list[cst.EmptyLine]:
    return [cst.EmptyLine(indent=False)] if before else []


def _own(source: src.ClassSource) -> set[str]:
    methods = {s.name.value for s in source.class_def.body.body if isinstance(s, cst.FunctionDef)}
    return methods | {code_of(f.target) for f in source.fields}
