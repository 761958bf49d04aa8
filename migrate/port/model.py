"""A Linen module tree ported bottom-up: the root class and each of the user's own Linen
classes it builds (defined in the root's package), each class ported once and reused, one NNX
file per Linen file (`layers.py` -> `layers_nnx.py`, importing the ports of the others); every
traced instance of a class must give the same NNX class (sizes through the class's fields,
not per-instance constants), or the class is refused and its sites bridged."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from collections.abc import Mapping

import flax.linen as nn
import libcst as cst

from migrate.port import emit
from migrate.port import source as src
from migrate.port.ported import (
    CLASS_TRANSFORMS,
    DEFINED_BY,
    HELPERS,
    Emitted,
    Stub,
    variable_class,
)
from migrate.port.trace import Path, Trace


@dataclasses.dataclass(frozen=True)
class ClassPort:
    """One class of the tree: its NNX code, or why it was not ported (its sites bridged)."""

    cls: type
    emitted: Emitted | None
    refused: str | None
    instances: tuple[Path, ...]  # where the trace built it


@dataclasses.dataclass(frozen=True)
class TreePort:
    """The NNX files (each one's imports and classes, in its Linen file's order), by the Linen
    module each ports, and each class's port."""

    files: Mapping[str, str]  # Linen module name -> the NNX file's code
    classes: tuple[ClassPort, ...]  # bottom-up: a class after the classes it builds
    collections: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def code(self) -> str:
        """The root's NNX file."""
        return self.files[self.root.cls.__module__]

    @property
    def root(self) -> ClassPort:
        return self.classes[-1]

    @property
    def stubs(self) -> tuple[tuple[str, Stub], ...]:
        return tuple(
            (c.cls.__name__, s) for c in self.classes if c.emitted for s in c.emitted.stubs
        )

    def placed_at(self) -> dict[Path, dict[str, str]]:
        """Each ported instance's path -> its Linen names -> NNX attributes."""
        out: dict[Path, dict[str, str]] = {}
        for c in self.classes:
            if c.emitted is not None:
                for path in c.instances:
                    out[path] = {p.linen: p.attribute for p in c.emitted.placed}
        return out


def own_class(value: object, module: types.ModuleType) -> bool:
    """A Linen module class the user defined in `module`'s package (`module` itself where
    it has none); a Linen wrapper of an NNX module (`nnx_class`) is no class to port."""
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        return False
    if "nnx_class" in getattr(value, "__dataclass_fields__", {}):
        return False
    package = module.__name__.split(".")[0]
    return value.__module__ == module.__name__ or (
        "." in module.__name__ and value.__module__.split(".")[0] == package
    )


def nnx_stem(module_name: str) -> str:
    """The NNX file's name (no suffix) for the Linen module `module_name`."""
    return f"{module_name.rsplit('.', 1)[-1]}_nnx"


def _bottom_up(root: type, module: types.ModuleType) -> tuple[list[type], dict[type, str]]:
    """The user's classes `root` builds, directly or not, each after those it builds; and
    those whose source cannot be read as a port, with why."""
    order: list[type] = []
    refused: dict[type, str] = {}
    visiting: set[type] = set()

    def visit(cls: type) -> None:
        if cls in order or cls in refused or cls in visiting:
            return
        visiting.add(cls)
        try:
            source = src.read(cls)
        except src.PortError as error:
            if cls is root:
                raise
            refused[cls] = str(error).removeprefix(f"{cls.__qualname__}: ")
        else:
            for site in source.sites:
                if own_class(site.target, module):
                    visit(site.target)
            order.append(cls)
        visiting.discard(cls)

    visit(root)
    return order, refused


def _subtrace(trace: Trace, path: Path) -> Trace:
    for name in path:
        trace = trace.at(name)
    return trace


def port_tree(root: type, trace: Trace, names: str) -> TreePort:
    """Port `root` and the user's classes it builds; PortError where the root cannot be."""
    module = inspect.getmodule(root)
    order, refused = _bottom_up(root, module)
    ported: list[type] = []
    classes: dict[type, ClassPort] = {}
    for cls in order:
        source = src.read(cls)
        instances = tuple(p for p, node in trace.nodes.items() if node.cls is cls)
        try:
            written = {}
            for path in instances or (None,):
                at = _subtrace(trace, path) if path is not None else None
                emitted = emit.emit(source, at, names, ported, refused)
                written.setdefault(emitted.code, (path, emitted))
            left = [s for s in emitted.stubs if s.linen_code]
            if left and cls is not root:  # Linen code the port cannot run: bridge the class
                raise src.PortError(f"{cls.__name__}: line {left[0].line}: {left[0].idiom}")
            if len(written) > 1:
                at = " and ".join("/".join(p) or "the root" for p, _ in written.values())
                raise src.PortError(
                    f"{cls.__name__}: its instances at {at} need different NNX code (a size "
                    "traced per instance, not held by a field)"
                )
        except src.PortError as error:
            if cls is root:
                raise
            refused[cls] = str(error).removeprefix(f"{cls.__name__}: ")
            classes[cls] = ClassPort(cls, None, refused[cls], instances)
            continue
        ported.append(cls)
        classes[cls] = ClassPort(cls, emitted, None, instances)
    done = [classes[c] for c in order if c in classes]
    files, collections = _files(done, ported)
    return TreePort(files, tuple(done), collections)


def _files(
    done: list[ClassPort], ported: list[type]
) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """One NNX file per Linen module: its ported classes in source order, under the imports
    they read (the ports of other modules' classes from those modules' NNX files); and each
    Linen collection's `nnx.Variable` subclass, defined by the first file (bottom-up) whose
    classes hold one, `(file, class)`."""
    names = [c.__name__ for c in ported]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise src.PortError(f"two ported classes are both named {clash[0]}")
    functions = {f.function: f for c in done if c.emitted is not None for f in c.emitted.functions}
    homes = {c.__module__ for c in ported} | {f.__module__ for f in functions}
    stems = {m: nnx_stem(m) for m in homes}
    if len(set(stems.values())) != len(stems):
        raise src.PortError(f"two ported modules share a file name: {sorted(stems)}")
    files: dict[str, str] = {}
    collections: dict[str, tuple[str, str]] = {}
    order = [c.cls.__module__ for c in done if c.emitted is not None]
    for module_name in dict.fromkeys([*(f.__module__ for f in functions), *order]):
        here = sorted(
            (c for c in done if c.emitted is not None and c.cls.__module__ == module_name),
            key=lambda c: inspect.getsourcelines(c.cls)[1],
        )
        written = sorted(
            (f for f in functions.values() if f.function.__module__ == module_name),
            key=lambda f: f.function.__code__.co_firstlineno,
        )
        bodies = [c.emitted.code for c in here]
        elsewhere = {c.__name__: stems[c.__module__] for c in ported if c.__module__ != module_name}
        elsewhere |= {
            f.__name__: stems[f.__module__] for f in functions if f.__module__ != module_name
        }
        elsewhere |= {kind: stem for stem, kind in collections.values()}
        defined = []
        for c in here:
            for collection, kind in c.emitted.variable_types.items():
                if collection not in collections:
                    collections[collection] = (nnx_stem(module_name), kind)
                    defined.append(variable_class(kind, collection))
        module = inspect.getmodule(here[0].cls if here else written[0].function)
        needs = set().union(*(c.emitted.needs for c in here))
        own = {c.cls.__name__ for c in here} | {f.function.__name__ for f in written}
        own |= {kind for stem, kind in collections.values() if stem == nnx_stem(module_name)}
        head = imports(module, [*bodies, *(f.code for f in written)], own, elsewhere, needs)
        called = set().union(*(c.emitted.helpers for c in here), *(f.helpers for f in written))
        helpers = sorted({DEFINED_BY.get(h, h) for h in called})
        bodies = (
            [HELPERS[h] + "\n" for h in helpers]
            + defined
            + [f.code.strip() + "\n" for f in written]
            + bodies
        )
        files[module_name] = f"{head}\n\n\n" + "\n\n".join(bodies)
    return files, collections


def imports(
    module: types.ModuleType,
    bodies: list[str],
    defined: set[str],
    elsewhere: Mapping[str, str] | None = None,
    needs: set[tuple[str, str]] | None = None,
) -> str:
    """The imports the written classes read: NNX's, the ports of classes written in other
    files (`elsewhere`: class name -> file), and the Linen file's globals they use (its
    modules and the names it imports imported as it imports them, its own names from the
    file itself)."""
    lines = ["import jax", "import jax.numpy as jnp", "from flax import nnx"]
    provided = {"jax", "jnp", "nnx"} | defined
    scope = vars(module)
    read: set[str] = set()
    for body in bodies:
        read |= src.names_in(cst.parse_module(body)) - set(CLASS_TRANSFORMS.values())
    imported = []
    named = {name: module_name for module_name, name in needs or ()}
    froms: dict[str, list[str]] = {}
    for name in sorted(read - provided):
        if name in named and scope.get(name) is None:  # an enum class a traced value names
            froms.setdefault(named[name], []).append(name)
            continue
        if name in (elsewhere or {}):
            froms.setdefault(elsewhere[name], []).append(name)
            continue
        if name not in scope:
            continue
        value = scope[name]
        source, original = src.imported_names(module).get(name, (module.__name__, name))
        if isinstance(value, types.ModuleType):
            last = value.__name__.rsplit(".", 1)[-1]
            alias = "" if last == name and "." not in value.__name__ else f" as {name}"
            lines.append(f"import {value.__name__}{alias}")
        elif (
            source != module.__name__ and getattr(sys.modules.get(source), original, None) is value
        ):
            # imported as the Linen file imports it: the port does not need the Linen file
            froms.setdefault(source, []).append(
                name if original == name else f"{original} as {name}"
            )
        else:
            imported.append(name)
    ports = set((elsewhere or {}).values())  # the port's own files after the libraries
    ordered = sorted(froms.items(), key=lambda item: (item[0] in ports, item[0]))
    lines += [f"from {source} import {', '.join(names)}" for source, names in ordered]
    if imported:
        lines.append(f"from {module.__name__} import {', '.join(imported)}")
    return "\n".join(lines)


def nnx_path(path: Path, placed_at: Mapping[Path, Mapping[str, str]]) -> Path:
    """A Linen variable's path (under the root) in the port's naming."""
    out: list[str] = []
    for i, name in enumerate(path):  # an element of a list of submodules: `blocks/0`
        out.extend(placed_at.get(path[:i], {}).get(name, name).split("/"))
    return tuple(out)
