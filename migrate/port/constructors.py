"""How the planner writes one submodule's constructor in `__init__`: a Linen layer as its
NNX layer (sizes from the trace), a user's class as its port, an NNX module a Linen wrapper
holds as itself, anything else bridged through `nnx.bridge.ToNNX` (a marked stub); each
argument as written where `__init__` can evaluate it, else its traced value."""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any

import flax.linen as nn
import libcst as cst

from migrate.port import rewrite as rw
from migrate.port import source as src
from migrate.port.layers import LAYERS, Layer, literal
from migrate.port.ported import Stub, code_of
from migrate.port.trace import Child, Trace, fields_of


def without_name(node: cst.Call) -> list[cst.Arg]:
    """A constructor call's arguments but `name=` (NNX has no names)."""
    return [a for a in node.args if not (a.keyword and a.keyword.value == "name")]


class Constructors:
    """The constructor half of `planner.Planner`, on the planner's state."""

    source: src.ClassSource
    trace: Trace | None
    scope: Mapping[str, Any]
    ported: Collection[type]  # the user's classes ported beside this one
    refused: Mapping[type, str]  # those that were not, and why
    init_lines: list[str]
    stubs: list[Stub]
    needs: set[tuple[str, str]]  # (module, name) the port imports
    fields: Mapping[str, Any]
    text: Callable[[cst.BaseExpression], str | None]
    literal: Callable[[Any], str | None]
    size: Callable[[Any], str]
    evaluate: Callable[[str], Any]
    keyed_at_every_call: Callable[[src.Site], bool]

    def constructor(self, site: src.Site, child: Child | None) -> tuple[str | None, str]:
        """The NNX expression that builds `site` and its form (None and the stub's mark where
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
            if layer.needs_input and (child is None or not child.called):
                why = "never traced: its input size is unknown"
            else:
                expression, why = self.layer(site, child or untraced(layer), layer)
                if expression is not None:
                    return expression, layer.label
        return self.bridge(site, child, why)

    def own(self, site: src.Site, child: Child | None, target: type) -> tuple[str | None, str]:
        """`TARGET(arguments, rngs=rngs)`: the port of a user's class, its arguments as written
        where `__init__` can evaluate them, their traced values (as keywords) otherwise."""
        args = without_name(site.node)
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
                field = arg.keyword.value if arg.keyword else fields_of(target)[i]
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
        order = fields_of(layer.linen)
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
                if field not in child.attributes:
                    return None, f"{field}= is computed in __call__, which never built it"
                traced = self.literal(child.attributes[field])
                if traced is None:
                    return None, f"{field}= is computed in __call__ and not a literal"
                init_args[nnx_name] = traced
        for field in sorted(carried - set(given)):
            nnx_name = layer.renamed.get(field, field)
            if field not in child.attributes:
                return None, f"{field}= has no default and was never traced"
            value = child.attributes[field]
            default = parameters[nnx_name].default
            text = self.literal(value)
            if value is None or text is None or field in layer.at_call:
                continue
            if default is inspect.Parameter.empty or not _same(value, default):
                init_args[nnx_name] = text
        first_input = child.inputs[0] if child.inputs else None
        sizes = [self.size(s) for s in layer.sizes(first_input, child.attributes)]
        # A dropout given its key at every call holds no key stream: its state is its weights'.
        keyed = layer.linen is nn.Dropout and self.keyed_at_every_call(site)
        rngs = [] if keyed else ["rngs=rngs"]
        args = [*sizes, *(f"{k}={v}" for k, v in init_args.items()), *rngs]
        return f"nnx.{layer.nnx.__name__}({', '.join(args)})", None

    def call_changes(self, site: src.Site) -> tuple[tuple, Mapping[str, str]]:
        """The keyword arguments a compact site's call takes in NNX (`deterministic=` moved
        from the constructor), and the call's keywords renamed (`rng` -> `rngs`)."""
        layer = LAYERS.get(site.target) if site.target is not None else None
        if layer is None or site.called is None:
            return (), {}
        moved = []
        for i, arg in enumerate(site.node.args):
            field = arg.keyword.value if arg.keyword else fields_of(layer.linen)[i]
            if field in layer.at_call and not src.is_static(arg.value, self.scope):
                moved.append((layer.renamed.get(field, field), arg.value))
        return tuple(moved), layer.call_renamed

    def example(self, x: Any) -> str | None:
        """Source for an example input like the traced `x`: zeros of an array's shape and
        dtype, a literal, or a tuple or named tuple of those (`packing.Positions(index=...)`);
        None where none can be written."""
        if hasattr(x, "shape"):
            return f"jnp.zeros({tuple(x.shape)!r}, jnp.{x.dtype.name})"
        if not isinstance(x, tuple):
            return literal(x)
        parts = [self.example(v) for v in x]
        if None in parts:
            return None
        if type(x) is tuple:
            return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"
        name = self.class_name(type(x)) if hasattr(x, "_fields") else None
        if name is None:
            return None
        return f"{name}({', '.join(f'{f}={p}' for f, p in zip(x._fields, parts, strict=True))})"

    def stub(self, site: src.Site, note: str, idiom: str | None = None) -> tuple[None, str]:
        """No constructor for `site`: the stub listed, and its mark."""
        idiom = idiom or f"{code_of(site.node.func)}(...)"
        self.stubs.append(Stub(site.line, idiom, f"{note}: port it by hand"))
        return None, self.stubs[-1].comment

    def bridge(
        self, site: src.Site, child: Child | None, why: str | None
    ) -> tuple[str | None, str]:
        """`site` as the Linen module itself inside `nnx.bridge.ToNNX`, initialised on its
        traced inputs: a marked stub."""
        what = code_of(site.node.func)
        idiom = f"{what}(...) ({why})" if site.target is not None else f"{what}(...)"
        linen = self.text(site.node.with_changes(args=rw.commas(without_name(site.node))))
        inputs = [self.example(x) for x in child.inputs] if child is not None else [None]
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
            return self.stub(site, why_not, idiom)
        self.stubs.append(
            Stub(site.line, idiom, "bridged through nnx.bridge.ToNNX; port it by hand")
        )
        if self.source.style == "compact":
            self.init_lines.append(f"# {self.stubs[-1].comment}")
        bridged = f"nnx.bridge.ToNNX({linen}, rngs=rngs)"
        expression = f"nnx.bridge.lazy_init({', '.join([bridged, *inputs, *kwargs])})"
        return expression, "bridged (nnx.bridge.ToNNX)"


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


def untraced(layer: Layer) -> Child:
    """A layer the trace never built (a branch not taken), as far as its source tells: its
    Linen defaults, which the arguments written at the site then override. Only a layer whose
    NNX constructor needs no traced size is built so (`Layer.needs_input`)."""
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(layer.linen)
        if f.default is not dataclasses.MISSING and f.name not in ("parent", "name")
    }
    return Child(name="", cls=layer.linen, attributes=defaults)
