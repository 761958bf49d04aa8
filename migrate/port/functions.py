"""The user's functions that apply a Linen lifted transform to a module handed to them
(`scan_layers(self.layers, ...)` over `nn.scan(body, variable_axes={"params": 0}, ...)`),
ported beside the classes that call them: `nn.scan` and `nn.vmap` of a function as the port
file's `scan_function` / `vmap_function` (`nnx.scan` / `nnx.vmap` over the module's stacked
variables), `nn.remat` / `nn.checkpoint` / `nn.jit` as `nnx.remat` / `nnx.jit`, the user's
other functions that do the same ported with them. A transform that stacks the module's
variables (`variable_axes`) is read as a `Stacking`: the size and the axis name the calling
class's `__init__` builds the module with (`stacked_modules`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import libcst as cst
from flax import nnx

from migrate.port import ported
from migrate.port import source as src
from migrate.port.ported import code_of

# A Linen transform of a function -> the helper of the port file (`ported.HELPERS`), or NNX's
# own transform where it takes a function of a module as it is.
STACKING = {nn.scan: "scan_function", nn.vmap: "vmap_function"}
DIRECT = {nn.remat: "nnx.remat", nn.checkpoint: "nnx.remat", nn.jit: "nnx.jit"}
# The keywords each one is ported with (another one: the function is not ported).
OPTIONS = {
    nn.scan: {"variable_axes", "split_rngs", "in_axes", "out_axes", "length", "reverse",
              "unroll", "metadata_params", "_split_transpose"},
    nn.vmap: {"variable_axes", "split_rngs", "in_axes", "out_axes", "axis_size", "axis_name",
              "spmd_axis_name", "metadata_params"},
    nn.remat: {"prevent_cse", "static_argnums", "policy"},
    nn.checkpoint: {"prevent_cse", "static_argnums", "policy"},
    nn.jit: {"static_argnums", "static_argnames", "donate_argnums", "device", "backend"},
}  # fmt: skip
SIZE = {nn.scan: "length", nn.vmap: "axis_size"}
# Linen names with another NNX spelling in a ported function.
RENAMED = {"broadcast": "None", "PARTITION_NAME": "nnx.PARTITION_NAME", "Module": "nnx.Module"}
# What a module handed to a function is asked for that only a bound Linen module has.
LINEN_MODULE_API = {*src.LINEN_ATTRIBUTES, *src.LINEN_ONLY, "apply", "init", "bind", "param"}


@dataclasses.dataclass(frozen=True)
class Stacking:
    """A transform that stacks the variables of the module a function is handed: its
    `parameter` holds the module; `size` and `axis_name` are the function's expressions for
    the stacked size (`length=`, `axis_size=`) and the axis's name (`metadata_params`), None
    where it gives none."""

    parameter: str | None
    size: cst.BaseExpression | None
    axis_name: cst.BaseExpression | None


@dataclasses.dataclass(frozen=True)
class FunctionPort:
    """One function's NNX code, or why it is not ported."""

    function: Callable
    code: str | None
    refusal: str | None = None
    calls: tuple[Callable, ...] = ()  # the user's functions its code calls, ported too
    helpers: frozenset[str] = frozenset()  # `ported.HELPERS` it calls
    stacking: Stacking | None = None
    classes: tuple[type, ...] = ()  # the classes it transforms: their ports must exist

    def needed(self) -> tuple[FunctionPort, ...]:
        """This port and those of the functions it calls, each once, callees first."""
        out: dict[Callable, FunctionPort] = {}
        for called in self.calls:
            for needed in port(called).needed():
                out.setdefault(needed.function, needed)
        out.setdefault(self.function, self)
        return tuple(out.values())


@functools.lru_cache(maxsize=256)
def port(function: Callable) -> FunctionPort:
    """`function` written for NNX, or refused with why."""
    parsed = src.parsed_function(function)
    if parsed is None:
        return FunctionPort(function, None, f"the source of {function.__name__} cannot be read")
    writer = _Writer(function, parsed)
    written = parsed.visit(writer)
    if writer.refusal is None:
        for called in writer.calls:
            refusal = port(called).refusal
            if refusal is not None:
                writer.refusal = f"{called.__name__}: {refusal}"
                break
    if writer.refusal is not None:
        return FunctionPort(function, None, writer.refusal)
    return FunctionPort(
        function,
        cst.Module(body=[written]).code,
        None,
        tuple(writer.calls),
        frozenset(writer.helpers),
        writer.stacking,
        tuple(writer.transformed),
    )


class _Writer(cst.CSTTransformer):
    """The rewrite of one function; `refusal` set where a construct has no NNX form here."""

    def __init__(self, function: Callable, parsed: cst.FunctionDef) -> None:
        self.function = function
        self.home = inspect.getmodule(function)
        self.scope: Mapping[str, Any] = vars(self.home)
        self.parameters = {p.name.value for p in _parameters(parsed)}
        self.refusal: str | None = None
        self.calls: list[Callable] = []
        self.helpers: set[str] = set()
        self.stacking: Stacking | None = None
        self.transformed: list[type] = []  # the classes it applies a transform to
        self.classes = src.holding_classes(parsed, self.scope)  # local -> the class it holds
        self.products: dict[str, cst.Call] = {}  # `scanned = nn.scan(...)`: local -> transform
        for target, value in _assignments(parsed):
            if isinstance(value, cst.Call) and src.resolve(value.func, self.scope) in STACKING:
                self.products[target] = value
        self.stacked_calls: dict[int, cst.Call] = {}
        parsed.visit(_ProductCalls(self))

    def refuse(self, why: str) -> None:
        self.refusal = self.refusal or why

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        target = src.resolve(original_node.func, self.scope)
        if target in OPTIONS:
            return self._transform(original_node, updated_node, target)
        own = self.home is not None and src.own_function(target, self.home)
        if own and target not in self.calls and src.lifted_transforms(target):
            self.calls.append(target)
        return updated_node

    def _transform(self, original: cst.Call, updated: cst.Call, transform: Any) -> cst.Call:
        name = f"nn.{transform.__name__}"
        args = original.args
        if not args or args[0].keyword or any(a.keyword is None for a in args[1:]):
            self.refuse(f"{name} with options given by position")
            return updated
        given = {a.keyword.value: a.value for a in args[1:]}
        unknown = sorted(set(given) - OPTIONS[transform])
        if unknown:
            self.refuse(f"{name} with {unknown[0]}=, which has no NNX form here")
            return updated
        first = args[0].value
        held = self.classes.get(first.value) if isinstance(first, cst.Name) else None
        held = held or src.resolve(first, self.scope)
        if isinstance(held, type):  # a transform of a class: the port file's helper for it
            self.transformed.append(held)
            helper = ported.CLASS_TRANSFORMS[transform.__name__]
            self.helpers.add(helper)
            return updated.with_changes(func=cst.Name(helper))
        if transform in STACKING:
            self._stacking(original, transform, given)
            self.helpers.add(STACKING[transform])
            return updated.with_changes(func=cst.Name(STACKING[transform]))
        return updated.with_changes(func=cst.parse_expression(DIRECT[transform]))

    def _stacking(self, call: cst.Call, transform: Any, given: Mapping[str, Any]) -> None:
        axes = given.get("variable_axes")
        if axes is None:
            return
        if not isinstance(axes, cst.Dict) or not all(
            isinstance(e, cst.DictElement) and isinstance(e.value, cst.Integer)
            and e.value.evaluated_value == 0
            for e in axes.elements
        ):  # fmt: skip
            self.refuse(f"variable_axes={code_of(axes)}: only a leading axis 0 is ported")
            return
        if not axes.elements:
            return
        if self.stacking is not None:
            self.refuse("two transforms stacking a module's variables")
            return
        product = self.stacked_calls.get(id(call))
        first = product.args[0].value if product is not None and product.args else None
        parameter = first.value if isinstance(first, cst.Name) else None
        self.stacking = Stacking(
            parameter if parameter in self.parameters else None,
            given.get(SIZE[transform]),
            _partition_name(given.get("metadata_params"), self.scope),
        )

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        base = original_node.value
        if isinstance(base, cst.Name) and base.value in self.parameters:
            if original_node.attr.value in LINEN_MODULE_API:
                self.refuse(f"{code_of(original_node)}: Linen-only module API")
            return updated_node
        if src.resolve(base, self.scope) is not nn:
            return updated_node
        attribute = original_node.attr.value
        if attribute in RENAMED:
            return cst.parse_expression(RENAMED[attribute])
        value = getattr(nn, attribute, None)
        if value in OPTIONS:
            return updated_node  # the call rewrites it
        if value is not None and getattr(nnx, attribute, None) is value:
            return updated_node.with_changes(value=cst.Name("nnx"))
        self.refuse(f"nn.{attribute} has no NNX form here")
        return updated_node


class _ProductCalls(cst.CSTVisitor):
    """Each call of a transform's product (`scanned(layer, ...)`, `nn.scan(...)(layer, ...)`),
    by the transform call's identity: its first argument is the module transformed."""

    def __init__(self, writer: _Writer) -> None:
        self.writer = writer

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Name) and func.value in self.writer.products:
            self.writer.stacked_calls[id(self.writer.products[func.value])] = node
        elif isinstance(func, cst.Call) and src.resolve(func.func, self.writer.scope) in STACKING:
            self.writer.stacked_calls[id(func)] = node


def _parameters(function: cst.FunctionDef) -> list[cst.Param]:
    params = function.params
    return [*params.posonly_params, *params.params, *params.kwonly_params]


def _assignments(function: cst.FunctionDef) -> list[tuple[str, cst.BaseExpression]]:
    found: list[tuple[str, cst.BaseExpression]] = []

    class Assignments(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
                found.append((node.targets[0].target.value, node.value))

    function.body.visit(Assignments())
    return found


def _partition_name(
    metadata: cst.BaseExpression | None, scope: Mapping[str, Any]
) -> cst.BaseExpression | None:
    """The value `metadata_params` gives `nn.PARTITION_NAME` (the stacked axis's name)."""
    if not isinstance(metadata, cst.Dict):
        return None
    for element in metadata.elements:
        if not isinstance(element, cst.DictElement):
            continue
        key = element.key
        named = src.resolve(key, scope) if not isinstance(key, cst.SimpleString) else None
        text = key.evaluated_value if isinstance(key, cst.SimpleString) else named
        if text == nn.PARTITION_NAME:
            return element.value
    return None


def bound_argument(function: Callable, call: cst.Call, parameter: str) -> cst.BaseExpression | None:
    """The expression `call` (a call of `function`) passes for `parameter`: by position or
    keyword; None where it passes none (its default then applies) or passes `*args`."""
    names = list(inspect.signature(function).parameters)
    if parameter not in names:
        return None
    for i, arg in enumerate(call.args):
        if arg.star:
            return None
        if arg.keyword is not None and arg.keyword.value == parameter:
            return arg.value
        if arg.keyword is None and i == names.index(parameter):
            return arg.value
    return None
