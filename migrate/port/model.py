"""A Linen module tree ported bottom-up into one NNX file: the root class and each of the
user's own Linen classes it builds (defined in the root's file), each class ported once and
reused; every traced instance of a class must give the same NNX class (sizes through the
class's fields, not per-instance constants), or the class is refused and its sites bridged."""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Mapping

import flax.linen as nn
import libcst as cst

from migrate.port import emit
from migrate.port import source as src
from migrate.port.trace import Path, Trace


@dataclasses.dataclass(frozen=True)
class ClassPort:
    """One class of the tree: its NNX code, or why it was not ported (its sites bridged)."""

    cls: type
    emitted: emit.Emitted | None
    refused: str | None
    instances: tuple[Path, ...]  # where the trace built it


@dataclasses.dataclass(frozen=True)
class TreePort:
    """The NNX file (imports and classes, in the Linen file's order) and each class's port."""

    code: str
    classes: tuple[ClassPort, ...]  # bottom-up: a class after the classes it builds

    @property
    def root(self) -> ClassPort:
        return self.classes[-1]

    @property
    def stubs(self) -> tuple[tuple[str, emit.Stub], ...]:
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
    """A Linen module class the user defined in `module`."""
    return (
        isinstance(value, type)
        and issubclass(value, nn.Module)
        and value.__module__ == module.__name__
    )


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
    by_line = sorted(
        (c for c in done if c.emitted is not None), key=lambda c: inspect.getsourcelines(c.cls)[1]
    )
    bodies = [c.emitted.code for c in by_line]
    head = imports(module, bodies, {c.__name__ for c in ported})
    return TreePort(f"{head}\n\n\n" + "\n\n".join(bodies), tuple(done))


def imports(module: types.ModuleType, bodies: list[str], defined: set[str]) -> str:
    """The imports the written classes read: NNX's, and the Linen file's globals they use
    (its modules imported as it imports them, its other names from the file itself)."""
    lines = ["import jax", "import jax.numpy as jnp", "from flax import nnx"]
    provided = {"jax", "jnp", "nnx"} | defined
    scope = vars(module)
    read: set[str] = set()
    for body in bodies:
        read |= src.names_in(cst.parse_module(body))
    imported = []
    for name in sorted(read - provided):
        if name not in scope:
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


def nnx_path(path: Path, placed_at: Mapping[Path, Mapping[str, str]]) -> Path:
    """A Linen variable's path (under the root) in the port's naming."""
    out: list[str] = []
    for i, name in enumerate(path):
        out.append(placed_at.get(path[:i], {}).get(name, name))
    return tuple(out)
