"""The plan of one NNX class from one Linen class and its trace: the submodules matched to
the trace (a compact `__call__`'s in order, its loops by their names, `setup`'s by attribute,
lists of them by index), their constructors (`constructors.py`), `self.param` as `nnx.Param`
with its sharding names, `self.sow` as `nnx.Intermediate`, Linen-only code marked; and the
edits `rewrite.py` applies to each method."""

from __future__ import annotations

import functools
import types
from collections.abc import Collection, Mapping
from typing import Any

import flax.linen as nn
import libcst as cst

from migrate.port import functions as fn
from migrate.port import rewrite as rw
from migrate.port import source as src
from migrate.port.constructors import Constructors
from migrate.port.layers import LAYERS, imports_for, literal
from migrate.port.lifted import LiftedCalls
from migrate.port.linen_api import VARIABLE_TYPES, LinenApi
from migrate.port.ported import Placed, Stub, code_of, snake
from migrate.port.trace import Trace

PARTITIONING = {nn.with_logical_partitioning, nn.with_partitioning}  # -> `out_sharding=`


class Planner(Constructors, LiftedCalls, LinenApi):
    """What one Linen class becomes, gathered while its sites and calls are planned."""

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
        self.edits: dict[int, rw.CallEdit] = {}
        self.self_edits: dict[int, rw.SelfEdit] = {}
        self.param_reads: set[str] = set()
        self.dropped: set[int] = set()  # statements left out: `init = nn.with_...(f, names)`
        self.listed: set[int] = set()  # lists of submodules made in setup
        body = source.call if source.style == "compact" else source.setup
        self.locals = rw.locals_of(body) if body is not None else {}
        self.placed: list[Placed] = []
        self.stubs: list[Stub] = []
        self.needs: set[tuple[str, str]] = set()
        self.variable_types: dict[str, str] = {}  # a Linen collection -> its Variable class
        self.variable_reads: set[str] = set()  # `self.ema`, `ema`: a Variable's `.value` read
        self.functions: dict[Any, fn.FunctionPort] = {}  # the user's functions ported beside it
        self.stacked: dict[str, tuple[str, str]] = {}  # attribute -> its stacked size and axis
        self.helpers: set[str] = set()  # `ported.HELPERS` its constructors call
        self.branches: dict[int, str] = {}  # `if self.is_initializing():` -> the branch kept
        self.call_renamed: dict[str, Mapping[str, str]] = {}  # setup's layer -> call keywords

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
        substituted = rw.substitute(node, self.values)
        return code_of(substituted) if src.is_static(substituted, self.scope) else None

    @functools.cached_property
    def values(self) -> dict[str, cst.BaseExpression]:
        """The compact `__call__`'s (or `setup`'s) locals assigned once from what `__init__`
        can evaluate."""
        return rw.static_values(self.locals, self.scope)

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
                self.init_lines.append(f"self.{attr} = None  # {form}")
                form = "stub"
            else:
                self.init_lines.append(f"self.{attr} = {expression}")
            self.edits[id(site.node)] = rw.CallEdit(attr, *self.call_changes(site))
            self.placed.append(Placed(child.name, attr, form))

    def loop_names(self, site: src.Site) -> list[str]:
        """The names a submodule made in a `for` loop takes, one per iteration: its `name=`
        evaluated over the loop's iterable (which `__init__` must be able to evaluate)."""
        loop = site.loop
        name = src.name_argument(site.node)
        if not isinstance(loop, cst.For) or name is None:
            raise src.PortError(
                f"line {site.line}: a submodule made in a loop is ported only from a `for` loop "
                'with an explicit name= (name=f"layers_{i}")'
            )
        iterable = self.text(loop.iter)
        if iterable is None:
            raise src.PortError(f"line {site.line}: the loop's iterable reads values of __call__")
        names = self.names_over(code_of(name), loop, iterable)
        if names is None:
            raise src.PortError(f"line {site.line}: its names cannot be evaluated")
        return names

    def names_over(self, name: str, loop: cst.For | None, iterable: str | None) -> list | None:
        """The submodule names `name` gives, evaluated once per iteration of `loop` over
        `iterable` (once where there is no loop); None where they cannot be evaluated."""
        text = f"[{name} for {code_of(loop.target)} in {iterable}]" if loop else f"[{name}]"
        names = self.evaluate(text)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return None
        return names

    def loop_site(self, site: src.Site, names: list[str], written: set[int]) -> None:
        """`for ...: setattr(self, NAME, CONSTRUCTOR)` in `__init__` (every iteration's
        constructor the same code), `getattr(self, NAME)` where `__call__` built it."""
        loop = site.loop
        name = src.name_argument(site.node)
        forms = {self.constructor(site, self.trace.child(n)) for n in names}
        if len(forms) != 1:
            raise src.PortError(f"line {site.line}: its iterations need different constructors")
        ((expression, form),) = forms
        if expression is None:
            raise src.PortError(f"line {site.line}: {form}")
        if id(loop) not in written:
            written.add(id(loop))
            self.init_lines.append(f"for {code_of(loop.target)} in {self.text(loop.iter)}:")
        self.init_lines.append(f"    setattr(self, {code_of(name)}, {expression})")
        getter = f"getattr(self, {code_of(name)})"
        self.edits[id(site.node)] = rw.CallEdit(names[0], *self.call_changes(site), getter)
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
            if site.assigned is None and site.set_name is None:
                raise src.PortError(f"line {site.line}: a submodule not assigned to self.NAME")
            if site.in_loop and site.container is None and site.set_name is None:
                raise src.PortError(
                    f"line {site.line}: a submodule made in a loop in setup, not in a list "
                    "assigned to self.NAME or set by setattr(self, NAME, ...)"
                )
        set_names = {id(s.node): self.set_names(s) for s in sites if s.set_name is not None}
        claimed = {s.explicit_name or s.assigned for s in sites if not s.in_loop}
        claimed |= {n for found in set_names.values() for n in found}
        unclaimed = [c.name for c in self.trace.children if c.name not in claimed] if (
            self.trace is not None
        ) else []  # fmt: skip
        listed = [s for s in sites if s.in_loop and s.set_name is None]
        names: dict[str, list[Placed]] = {}
        for site in sites:
            key = site.assigned or code_of(site.set_name)
            if site.set_name is not None:  # `setattr(self, f"layers_{i}", Block(...))`
                linen_names = set_names[id(site.node)]
            elif site.in_loop:  # `self.NAME = [Block(...) for ...]`: the trace's unclaimed ones
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
            layer = LAYERS.get(site.target) if site.target is not None else None
            translated = expression is not None and not form.startswith("bridged")
            if translated and site.assigned and layer and layer.call_renamed:
                self.call_renamed[site.assigned] = layer.call_renamed  # `rng=k` -> `rngs=k`
            if expression is not None and site.assigned in self.stacked and not site.in_loop:
                size, axis_name = self.stacked[site.assigned]
                expression = (
                    f"stacked_modules(lambda rngs: {expression}, {size}, {axis_name}, rngs)"
                )
                form = f"{form}, stacked"
                self.helpers.add("stacked_modules")
            if expression is None:
                self.self_edits[id(site.node)] = rw.SelfEdit(cst.Name("None"), form)
                form = "stub"
            else:
                bridged = form.startswith("bridged")  # the stub `bridge` just listed
                comment = self.stubs[-1].comment if bridged else None
                replacement = cst.parse_expression(expression)
                self.self_edits[id(site.node)] = rw.SelfEdit(replacement, comment)
            if site.set_name is not None:
                placed = [Placed(n, n, form) for n in linen_names]
            elif site.in_loop:
                placed = [
                    Placed(n, f"{site.assigned}/{i}", form) for i, n in enumerate(linen_names)
                ]
            else:
                placed = [Placed(linen_names[0], site.assigned, form)]
            if child is not None or key not in names:
                names[key] = placed
        self.placed += [p for placed in names.values() for p in placed]

    def set_names(self, site: src.Site) -> list[str]:
        """The names `setattr(self, NAME, ...)` in `setup` gives its submodules: NAME evaluated
        (over its `for` loop's iterable where it is made in one), `setup`'s locals read
        through the fields they hold."""
        loop = site.loop if site.in_loop else None
        if loop is not None and not isinstance(loop, cst.For):
            raise src.PortError(f"line {site.line}: setattr in a loop other than `for`")
        name = code_of(rw.substitute(site.set_name, self.values))
        iterable = code_of(rw.substitute(loop.iter, self.values)) if loop else None
        names = self.names_over(name, loop, iterable)
        if names is None and self.trace is None:
            return []  # never built: the names map no traced weights
        if names is None:
            raise src.PortError(f"line {site.line}: the names setattr gives cannot be evaluated")
        return names

    # self.param, self.sow and the rest of Linen's own methods -------------------------------

    def self_calls(self) -> None:
        claimed = self.linen_api()
        for call in self.source.self_calls:
            if call.function is not None or id(call.node) in claimed:
                continue  # `lifted_calls`, `linen_api`
            if call.transform:
                note = (
                    "a Linen transform of a function inside a method: port it by hand "
                    "(nnx.scan, nnx.vmap, nnx.remat), or move it into a function of the file"
                )
                self.mark(call, call.method, note, linen_code=True)
            elif call.method == "param":
                self.param(call)
            elif call.method == "variable":
                self.variable(call)
            elif call.method == "sow":
                self.sow(call)
            elif call.method in src.LINEN_ONLY or isinstance(call.node, cst.Attribute):
                note = "Linen-only API, left as written: port it by hand"
                self.mark(call, f"self.{call.method}", note, linen_code=True)

    def mark(self, call: src.SelfCall, idiom: str, note: str, linen_code: bool = False) -> None:
        self.stubs.append(Stub(call.line, idiom, note, linen_code))
        self.self_edits[id(call.node)] = rw.SelfEdit(None, self.stubs[-1].comment)

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
            self.self_edits[id(call.node)] = rw.SelfEdit(cst.parse_expression(expression))
            self.param_reads.add(attr)
        else:
            self.init_lines.append(f"self.{attr} = nnx.Param({value}{sharded})")
            read = cst.parse_expression(f"self.{attr}[...]")
            self.self_edits[id(call.node)] = rw.SelfEdit(read)
        self.placed.append(Placed(linen_name, attr, "self.param -> nnx.Param"))

    def variable(self, call: src.SelfCall) -> None:
        """`self.variable("stats", "ema", init, *args)` -> `STATS(init(*args))`, held where
        Linen held it (`setup`: its attribute; compact: under its name); `.value` read and
        written as `[...]`. `batch_stats` and `cache` are NNX's own types, another collection
        a `Variable` subclass the port file defines."""
        args = call.node.args
        names = [a.value for a in args[:2]]
        plain = len(args) >= 3 and not any(a.keyword or a.star for a in args)
        if not plain or not all(isinstance(n, cst.SimpleString) for n in names):
            why = "a computed collection, name or keyword"
            return self.mark(call, "self.variable", why, linen_code=True)
        collection, name = (n.evaluated_value for n in names)
        texts = [self.text(a.value) for a in args[2:]]
        if None in texts:
            why = "its initializer reads values of __call__"
            return self.mark(call, "self.variable", why, linen_code=True)
        setup = self.source.style == "setup"
        attr = call.assigned if setup else name
        if attr is None:
            why = "not assigned to self.NAME in setup"
            return self.mark(call, "self.variable", why, linen_code=True)
        kind = VARIABLE_TYPES.get(collection)
        if kind is None:
            kind = "".join(part.title() for part in collection.split("_")) or "State"
            self.variable_types[collection] = kind
        value = f"{kind}({texts[0]}({', '.join(texts[1:])}))"
        if setup:
            self.self_edits[id(call.node)] = rw.SelfEdit(cst.parse_expression(value))
        else:
            self.init_lines.append(f"self.{attr} = {value}")
            self.self_edits[id(call.node)] = rw.SelfEdit(cst.parse_expression(f"self.{attr}"))
            if call.local is not None:
                self.variable_reads.add(call.local)
        self.variable_reads.add(f"self.{attr}")
        self.placed.append(Placed(name, attr, f"self.variable -> {kind}"))

    def sow(self, call: src.SelfCall) -> None:
        args = call.node.args
        first = args[0].value if args else None
        if not (isinstance(first, cst.SimpleString) and first.evaluated_value == "intermediates"):
            return self.mark(call, "self.sow", "a collection other than intermediates")
        changed = [args[0].with_changes(value=cst.parse_expression("nnx.Intermediate")), *args[1:]]
        self.self_edits[id(call.node)] = rw.SelfEdit(call.node.with_changes(args=changed))

    def initializer(self, init: cst.BaseExpression) -> tuple[str, str | None]:
        """`nn.with_logical_partitioning(fn, names)` -> (`fn`, `names`): the initializer and
        the `out_sharding` metadata the NNX Param carries, also through a local assigned
        once (`init = nn.with_logical_partitioning(...)`, left out where nothing else reads
        it); any other initializer as written."""
        local = self.locals.get(init.value) if isinstance(init, cst.Name) else None
        value = local.value if local else init
        if self.source.style == "compact":
            value = rw.substitute(value, self.values)
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
            whole = isinstance(local.statement.body[0].targets[0].target, cst.Name)
            if uses == local.reads and whole:
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
