"""A Linen class's source, read with libcst: its fields, its `setup` or compact `__call__`
(or neither: a plain module), the submodules they build in evaluation order (a class, a class
held by a local, a transform's product, a factory called with `name=`), and the Linen-only
code of every method (`self.param`, `self.variables`, a helper applying a lifted transform
to a submodule). `rewrite.py` writes the NNX methods from it."""

from __future__ import annotations

import builtins
import dataclasses
import functools
import importlib.util
import inspect
import textwrap
import types
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from migrate.errors import BadInput

LINEN_ONLY = ("make_rng", "is_initializing", "is_mutable_collection", "put_variable")
# Attributes of a bound Linen module that an NNX module has not: `self.variables` and the rest.
LINEN_ATTRIBUTES = ("variables", "scope", "is_initializing", "has_rng", "has_variable")
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
    assigned: str | None = None  # in `setup`: the attribute it is assigned to, `self.NAME = ...`
    via_local: bool = False  # constructed through a local holding the class (`cls(...)`)
    factory: bool = False  # a function called with `name="..."` that may return a module
    loop: cst.CSTNode | None = None  # the innermost loop it is made in (`for ... in ...:`)
    container: int | None = None  # in `setup`: the id of the list `self.NAME = [...]` built in
    function: Any = None  # the user's function returning a transform of the class: `f(...)(...)`
    set_name: cst.BaseExpression | None = None  # in `setup`: `setattr(self, NAME, <the site>)`


@dataclasses.dataclass(frozen=True)
class SelfCall:
    """A `self.param(...)`, `self.sow(...)` or other Linen-only method called (or attribute
    read: `self.variables`) in a method."""

    node: cst.Call | cst.Attribute
    line: int
    method: str
    assigned: str | None = None  # in `setup`: `self.NAME = self.param(...)`
    function: Any = None  # a function of the user's applying a lifted transform, called
    transform: bool = False  # `method`: a Linen transform of a function, applied in a method
    enclosing: cst.FunctionDef | None = None  # the method making a `function`'s call
    local: str | None = None  # in a compact `__call__`: `NAME = self.variable(...)`


@dataclasses.dataclass(frozen=True)
class ClassSource:
    """The parsed class and what `migrate port` reads off it."""

    cls: type
    module: types.ModuleType
    first_line: int
    class_def: cst.ClassDef
    call: cst.FunctionDef | None  # the compact `__call__` (None: a setup-style or plain module)
    fields: tuple[cst.AnnAssign, ...]
    sites: tuple[Site, ...]  # submodule constructors in the compact `__call__` or in `setup`
    self_calls: tuple[SelfCall, ...]
    setup: cst.FunctionDef | None = None
    class_locals: Mapping[str, type] = dataclasses.field(default_factory=dict)

    @property
    def style(self) -> str:
        """`compact`, `setup` (submodules and parameters made in `setup`) or `plain` (neither:
        a module with no variables of its own, like a rotary embedding)."""
        return "compact" if self.call is not None else "setup" if self.setup else "plain"


@functools.lru_cache(maxsize=256)
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
    setup = methods.get("setup")
    call = methods.get("__call__")
    if call is not None and not any(is_compact(d) for d in call.decorators):
        call = None
    if call is not None and setup is not None:
        raise PortError(f"{cls.__qualname__}: both setup and a compact __call__")
    others = [m for name, m in methods.items() if name != "__call__"]
    if any(is_compact(d) for m in others for d in m.decorators):
        raise PortError(f"{cls.__qualname__}: compact methods besides __call__ are not ported yet")
    if "__call__" not in methods and setup is None:
        raise PortError(f"{cls.__qualname__}: no __call__ and no setup to port")
    fields = tuple(
        s.body[0]
        for s in class_def.body.body
        if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.AnnAssign)
    )
    module = inspect.getmodule(cls)
    class_locals: dict[str, type] = {}
    finder = _Finder(vars(module), positions, first - 1)
    for body in (call, setup):
        if body is not None:
            finder.class_locals = holding_classes(body, vars(module))
            class_locals.update(finder.class_locals)
            finder.method = body
            body.visit(finder)
    finder.sites_too = False  # the other methods: their Linen-only calls only
    for method in class_def.body.body:
        if isinstance(method, cst.FunctionDef) and method not in (call, setup):
            finder.method = method
            method.visit(finder)
    own = set(methods) | {f.target.value for f in fields if isinstance(f.target, cst.Name)}
    for attribute in finder.attributes:
        if attribute.method not in own:
            finder.self_calls.append(attribute)
    for calling, function, method in finder.handed:
        transforms = lifted_transforms(function) if own_function(function, module) else ()
        if transforms:
            applied = ", ".join(f"nn.{t.__name__}" for t in transforms)
            idiom = f"{function.__name__}(...) applies {applied}"
            line = finder._line(calling)
            finder.self_calls.append(
                SelfCall(calling, line, idiom, function=function, enclosing=method)
            )
    return ClassSource(
        cls, module, first, class_def, call, fields, tuple(finder.sites),
        tuple(finder.self_calls), setup, class_locals,
    )  # fmt: skip


def self_attribute(node: cst.CSTNode) -> str | None:
    """`NAME` where `node` is `self.NAME`, else None."""
    if (
        isinstance(node, cst.Attribute)
        and isinstance(node.value, cst.Name)
        and node.value.value == "self"
    ):
        return node.attr.value
    return None


def name_argument(call: cst.Call) -> cst.BaseExpression | None:
    """The expression a call passes as `name=` (a Linen submodule's name), if any."""
    return next((a.value for a in call.args if a.keyword and a.keyword.value == "name"), None)


def is_compact(decorator: cst.Decorator) -> bool:
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


def names_read(node: cst.CSTNode) -> list[cst.Name]:
    """The `Name` nodes an expression reads (attributes' and keywords' own names left out)."""
    found: list[cst.Name] = []

    class Names(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)
            return False

        def visit_Arg(self, node: cst.Arg) -> bool:  # a keyword is no name read
            node.value.visit(self)
            return False

        def visit_Name(self, node: cst.Name) -> None:
            found.append(node)

    node.visit(Names())
    return found


def names_in(node: cst.CSTNode) -> set[str]:
    """The bare names an expression reads."""
    return {name.value for name in names_read(node)}


def is_static(node: cst.CSTNode, scope: Mapping[str, Any]) -> bool:
    """An expression `__init__` can evaluate: it reads only `self`, globals and builtins."""
    return all(n == "self" or n in scope or hasattr(builtins, n) for n in names_in(node))


def own_function(value: Any, home: types.ModuleType) -> bool:
    """A plain function defined in `home`'s package (the user's code, not a library's)."""
    if not isinstance(value, types.FunctionType) or value.__module__ is None:
        return False
    return value.__module__.split(".")[0] == home.__name__.split(".")[0]


@functools.lru_cache(maxsize=256)
def parsed_function(function: Any) -> cst.FunctionDef | None:
    """A function's source, parsed (None where it cannot be read)."""
    try:
        tree = cst.parse_module(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, cst.ParserSyntaxError):
        return None
    found = tree.body[0] if tree.body else None
    return found if isinstance(found, cst.FunctionDef) else None


def called_by(function: Any) -> list[Any]:
    """What each call in a function's source calls, resolved in its module."""
    parsed = parsed_function(function)
    if parsed is None:
        return []
    scope = vars(inspect.getmodule(function) or builtins)
    found: list[Any] = []

    class Calls(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            found.append(resolve(node.func, scope))

    parsed.visit(Calls())
    return found


def lifted_transforms(function: Any, seen: frozenset = frozenset()) -> tuple[Any, ...]:
    """The Linen lifted transforms (`nn.scan`, `nn.vmap`, ...) a function of the user's code
    applies, itself or through the user's functions it calls, in the order its source calls
    them (none: a plain function)."""
    if function in seen or function.__module__.split(".")[0] in ("flax", "jax"):
        return ()
    home = inspect.getmodule(function)
    found: dict[Any, None] = {}
    for called in called_by(function):
        if called in TRANSFORMS:
            found[called] = None
        elif home is not None and own_function(called, home):
            found.update(dict.fromkeys(lifted_transforms(called, seen | {function})))
    return tuple(found)


@functools.lru_cache(maxsize=256)
def transformed_class(function: Any) -> type | None:
    """The Linen class a function of the user's applies a Linen lifted transform to (and
    returns, transformed: `return nn.vmap(StageLayers, ...)`), if any."""
    parsed = parsed_function(function)
    if parsed is None:
        return None
    scope = vars(inspect.getmodule(function) or builtins)
    found: list[type] = []

    class Calls(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            first = node.args[0].value if node.args else None
            if resolve(node.func, scope) in TRANSFORMS and first is not None:
                held = resolve(first, scope)
                if isinstance(held, type) and issubclass(held, nn.Module):
                    found.append(held)

    parsed.visit(Calls())
    return found[0] if found else None


@functools.lru_cache(maxsize=64)
def imported_names(module: types.ModuleType) -> dict[str, tuple[str, str]]:
    """The names a module's top-level `from X import Y [as Z]` statements bind: `Z -> (X, Y)`,
    `X` absolute (relative imports resolved against the module's package)."""
    try:
        tree = cst.parse_module(inspect.getsource(module))
    except (OSError, TypeError, cst.ParserSyntaxError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    for statement in tree.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if not isinstance(small, cst.ImportFrom) or isinstance(small.names, cst.ImportStar):
                continue
            dots = "." * len(small.relative)
            named = code_of_name(small.module) if small.module is not None else ""
            try:
                source = importlib.util.resolve_name(dots + named, module.__package__)
            except (ImportError, ValueError):
                continue
            for alias in small.names:
                original = code_of_name(alias.name)
                bound = alias.asname.name.value if alias.asname is not None else original
                found[bound] = (source, original)
    return found


def code_of_name(node: cst.Attribute | cst.Name) -> str:
    """`a.b.c` as written."""
    if isinstance(node, cst.Name):
        return node.value
    return f"{code_of_name(node.value)}.{node.attr.value}"


def holding_classes(function: cst.FunctionDef, scope: Mapping[str, Any]) -> dict[str, type]:
    """The locals `function` assigns a Linen class only (`block = Block`, then maybe
    `block = nn.remat(block, ...)`), each with its class."""
    found: dict[str, type | None] = {}

    class Visitor(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if len(node.targets) != 1 or not isinstance(node.targets[0].target, cst.Name):
                return
            name, value = node.targets[0].target.value, node.value
            held = resolve(value, scope)
            if isinstance(value, cst.Call) and resolve(value.func, scope) in TRANSFORMS:
                first = value.args[0].value if value.args else None
                held = found.get(first.value) if isinstance(first, cst.Name) else None
                held = held or (resolve(first, scope) if first is not None else None)
            is_class = isinstance(held, type) and issubclass(held, nn.Module)
            if not is_class or found.get(name, held) is not held:
                found[name] = None
            else:
                found[name] = held

    function.body.visit(Visitor())
    return {name: cls for name, cls in found.items() if cls is not None}


TRANSFORMS = {nn.scan, nn.vmap, nn.remat, nn.checkpoint, nn.jit, nn.map_variables, nn.remat_scan}


class _Finder(cst.CSTVisitor):
    """Submodule constructors and `self.` method calls, in evaluation order."""

    def __init__(self, scope: Mapping[str, Any], positions: Mapping, offset: int) -> None:
        self.scope, self.positions, self.offset = scope, positions, offset
        self.sites: list[Site] = []
        self.self_calls: list[SelfCall] = []
        self.loops: list[cst.CSTNode] = []
        self.calling: dict[int, cst.Call] = {}
        self.assigned: str | None = None
        self.local: str | None = None
        self.container: int | None = None
        self.class_locals: Mapping[str, type] = {}
        self.sites_too = True
        self.attributes: list[SelfCall] = []
        self.handed: list[tuple[cst.Call, Any, cst.FunctionDef | None]] = []  # a function called
        self.method: cst.FunctionDef | None = None  # the method being read
        self.called: set[int] = set()  # `self.is_initializing` in `self.is_initializing()`
        self.setting: dict[int, cst.BaseExpression] = {}  # `setattr(self, NAME, value)`: value

    def _of_class(self, call: cst.Call) -> bool:
        """A transform applied to a Linen class (or a local holding one): a site's, not code."""
        first = call.args[0].value if call.args else None
        if isinstance(first, cst.Name) and first.value in self.class_locals:
            return True
        held = resolve(first, self.scope) if first is not None else None
        return isinstance(held, type) and issubclass(held, nn.Module)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if self_attribute(node) in LINEN_ATTRIBUTES and id(node) not in self.called:
            self.attributes.append(SelfCall(node, self._line(node), node.attr.value))

    def visit_Assign(self, node: cst.Assign) -> None:
        target = node.targets[0].target if len(node.targets) == 1 else None
        self.local = target.value if isinstance(target, cst.Name) else None
        self.assigned = self_attribute(target) if target is not None else None
        if self.assigned is not None and isinstance(node.value, cst.List | cst.ListComp):
            self.container = id(node.value)

    def leave_Assign(self, original_node: cst.Assign) -> None:
        self.assigned = self.container = self.local = None

    def _line(self, node: cst.CSTNode) -> int:
        return self.positions[node].start.line + self.offset

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, LOOPS):
            self.loops.append(node)
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if isinstance(original_node, LOOPS):
            self.loops.pop()
        super().on_leave(original_node)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Call):
            self.calling[id(node.func)] = node
        func = node.func
        self.called.add(id(func))
        args = node.args
        if isinstance(func, cst.Name) and func.value == "setattr" and len(args) == 3:
            target, name, value = (a.value for a in args)
            if isinstance(target, cst.Name) and target.value == "self":
                self.setting[id(value)] = name
        method = self_attribute(func)
        if method is not None:
            self.self_calls.append(
                SelfCall(node, self._line(node), method, self.assigned, local=self.local)
            )
            return
        target = resolve(func, self.scope)
        if isinstance(target, types.FunctionType):
            self.handed.append((node, target, self.method))
        if target in TRANSFORMS and not self._of_class(node):
            name = f"nn.{target.__name__} of a function"
            self.self_calls.append(SelfCall(node, self._line(node), name, transform=True))
        if not self.sites_too:
            return
        via_local = isinstance(func, cst.Name) and func.value in self.class_locals
        if via_local:
            target = self.class_locals[func.value]
        function = resolve(func.func, self.scope) if isinstance(func, cst.Call) else None
        made = transformed_class(function) if isinstance(function, types.FunctionType) else None
        if made is not None:  # `stacked_stages(cfg)(cfg, mesh)`: the class it transforms
            target, via_local = made, True
        else:
            function = None
        product = isinstance(func, cst.Call) and resolve(func.func, self.scope) in TRANSFORMS
        name = name_argument(node)
        explicit = name.evaluated_value if isinstance(name, cst.SimpleString) else None
        module_class = isinstance(target, type) and issubclass(target, nn.Module)
        factory = not (product or module_class) and explicit is not None
        if not (product or module_class or factory):
            return
        self.sites.append(
            Site(
                node,
                self._line(node),
                target if module_class else None,
                explicit,
                self.calling.get(id(node)),
                bool(self.loops),
                self.assigned,
                via_local=via_local,
                factory=factory,
                function=function,
                set_name=self.setting.get(id(node)),
                container=self.container,
                loop=self.loops[-1] if self.loops else None,
            )
        )
