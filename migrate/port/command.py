"""`migrate port` and `port()`: read a Linen module, trace it once, write its NNX port, the
weight map and the gate's pytest file beside each other, then run that gate.

The gate is the written test file's `gate()`, loaded from the file and run in this process:
the harness (`parity`) is the port's oracle, and `migrate` imports none of it itself. A file
in the way that `migrate port` did not write is never replaced; one it wrote is replaced only
with `force`."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from migrate.errors import BadInput
from migrate.port import gate_file, model, spec, trace, weights
from migrate.port import source as src
from migrate.port.layers import literal
from migrate.port.ported import HEADER, Placed, Stub

NAMES = ("linen", "snake")  # attribute names: Linen's own (identity map), or snake_case


@dataclasses.dataclass(frozen=True)
class Gate:
    """The written gate's verdict: its exit status and report."""

    status: int
    report: str


@dataclasses.dataclass(frozen=True)
class PortResult:
    """What a port wrote, holds, left as stubs, and the gate's verdict (None: not run)."""

    nnx_path: Path
    weight_map_path: Path
    test_path: Path
    placed: tuple[Placed, ...]  # the root class's submodules and parameters
    stubs: tuple[Stub, ...]  # every class's
    renames: Mapping[tuple[str, ...], tuple[str, ...]]
    gate: Gate | None
    seconds: Mapping[str, float]
    classes: tuple[model.ClassPort, ...] = ()  # bottom-up, the root last
    other_files: tuple[Path, ...] = ()  # the ports of the user's classes in other Linen files

    @property
    def status(self) -> int:
        """0 when the written port passes its gate, 1 otherwise (2 never comes back: raised)."""
        return 1 if self.gate is None else self.gate.status

    def summary(self) -> str:
        written = [self.nnx_path, *self.other_files, self.weight_map_path, self.test_path]
        lines = [f"wrote {', '.join(map(str, written))}"]
        for p in self.placed:
            lines.append(f"  {p.linen:<16} -> self.{p.attribute:<16} {p.form}")
        lines.append(
            f"  weight map: {'identity' if not self.renames else f'renames={dict(self.renames)!r}'}"
        )
        own = [c.cls.__name__ for c in self.classes[:-1] if c.emitted is not None]
        if own:
            lines.append(f"  ported with it: {', '.join(own)}")
        lines += [
            f"  not ported: {c.cls.__name__} ({c.refused})" for c in self.classes if c.refused
        ]
        lines += [f"  stub: {s}" for s in self.stubs] or ["  stubs: none"]
        lines.append("  time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()))
        if self.gate is not None:
            lines.append(self.gate.report)
        return "\n".join(lines)


def _module_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _arrays(inputs: Sequence[spec.ArraySpec]) -> tuple[Any, ...]:
    import jax
    import jax.numpy as jnp

    return tuple(jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in inputs)


def _specs(inputs: Any) -> tuple[spec.ArraySpec, ...]:
    if isinstance(inputs, str):
        return spec.parse_inputs(inputs)
    inputs = inputs if isinstance(inputs, tuple | list) else (inputs,)
    return tuple(
        i if isinstance(i, spec.ArraySpec) else spec.ArraySpec(str(i.dtype), tuple(i.shape))
        for i in inputs
    )


def _ours(path: Path) -> bool:
    try:
        with path.open() as file:
            head = file.read(512)
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith(HEADER) or '"written_by": "migrate port"' in head


def check_destinations(paths: Sequence[Path], force: bool) -> None:
    """Refuse a file in the way: one this tool did not write always, one it wrote without
    `force`; nothing is written until all pass."""
    for path in paths:
        if path.is_dir() or (path.exists() and not _ours(path)):
            raise BadInput(f"{path} exists and was not written by migrate port: not replaced")
        if path.exists() and not force:
            raise BadInput(f"{path} exists (written by migrate port): --force replaces it")


def _instance(module: Any) -> tuple[type, dict[str, Any]]:
    """The class and the field values a port is built and gated with (those set away from
    their defaults)."""
    import flax.linen as nn

    if isinstance(module, nn.Module):
        fields = trace.attributes(module)
        defaults = {
            f.name: f.default
            for f in dataclasses.fields(module)
            if f.default is not dataclasses.MISSING
        }
        return type(module), {k: v for k, v in fields.items() if defaults.get(k, k) != v}
    return module, {}


def _fields_from(target: str) -> dict[str, Any]:
    """`MODULE:FUNCTION`'s fields: the function called with no arguments returns a mapping."""
    module_name, function_name = spec.parse_fields_from(target)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
        fields = function()
    except Exception as error:
        raise BadInput(f"fields_from={target}: {type(error).__name__}: {error}") from None
    if not isinstance(fields, Mapping):
        raise BadInput(f"fields_from={target} returned {type(fields).__name__}, not a mapping")
    return dict(fields)


def port(
    module: Any,
    inputs: Any,
    out_dir: str | Path,
    *,
    call_kwargs: Sequence[Mapping[str, Any]] = ({},),
    names: str = "linen",
    force: bool = False,
    run_gate: bool = True,
    fields_from: str | None = None,
    method: str | None = None,
) -> PortResult:
    """Write the NNX port of `module` (a Linen class or instance of one with its fields set)
    into `out_dir` and gate it: `<module>_nnx.py`, `<module>_weight_map.json`,
    `test_<module>_port.py`.

    `inputs`: a SPEC (`"float32[4,8];int32[4]"`), or arrays / shape-dtype structs, one per
    positional argument; `call_kwargs`: the keyword arguments of each call the gate makes
    (the first one traced for the structure); `fields_from`: `MODULE:FUNCTION` returning the
    fields the module is built with, where they are not literals (a config, a mesh), for the
    port and its written gate; `method`: the method the trace and the gate call (default
    `__call__`). BadInput (exit 2) for what cannot be ported.
    """
    import flax.linen as nn

    if names not in NAMES:
        raise BadInput(f"names={names!r}; expected one of {', '.join(NAMES)}")
    cls, fields = _instance(module)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise BadInput(f"{module!r} is not a Linen module class or instance")
    if fields_from is not None:
        if isinstance(module, nn.Module):
            raise BadInput("fields_from is given with a module instance: give its class")
        fields = _fields_from(fields_from)
    unwritten = sorted(k for k, v in fields.items() if literal(v) is None)  # an enum is one
    if unwritten and fields_from is None:
        raise BadInput(
            f"{cls.__name__}'s field {unwritten[0]} is not a literal the gate can write: "
            "give fields_from=MODULE:FUNCTION returning the fields"
        )
    instance = module if isinstance(module, nn.Module) else _build(cls, fields)
    if method is not None and not callable(getattr(cls, method, None)):
        raise BadInput(f"{cls.__name__} has no method {method!r}")
    if "<locals>" in cls.__qualname__:
        raise BadInput(
            f"{cls.__qualname__} is defined inside a function: the gate cannot import it"
        )
    specs = _specs(inputs)
    calls = list(call_kwargs) or [{}]
    started = time.perf_counter()
    src.read(cls)  # a root that cannot be read is refused before the trace
    arrays = _arrays(specs)
    traces = []
    for kwargs in calls:
        try:
            traces.append(trace.trace(instance, arrays, kwargs, method))
        except Exception as error:  # the module does not run on these inputs: bad input
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise BadInput(f"{cls.__name__} does not run on {'; '.join(map(str, specs))} "
                           f"with {kwargs}: {type(error).__name__}: {first}") from None  # fmt: skip
    traced = time.perf_counter()
    tree = model.port_tree(cls, traces[0], names)
    placed_at = tree.placed_at()
    mapped = weights.build(traces[0], placed_at)

    base = _module_name(cls.__module__)
    out = Path(out_dir)
    paths = (out / f"{base}_nnx.py", out / f"{base}_weight_map.json", out / f"test_{base}_port.py")
    others = {
        name: out / f"{model.nnx_stem(name)}.py" for name in tree.files if name != cls.__module__
    }
    check_destinations([*paths, *others.values()], force)
    origin = f"{cls.__module__}.{cls.__qualname__}"
    bound = min(
        [c.attributes["num_embeddings"] for c in traces[0].nodes.values() if c.cls is nn.Embed]
        + [gate_file.INT_BOUND]
    )
    gate_spec = gate_file.GateSpec(
        cls.__module__, cls.__name__, paths[0].stem, fields, specs, calls,
        [t.stochastic for t in traces], mapped.renames, bound, fields_from, method,
        tree.collections,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(f"{HEADER} from {origin}: its NNX port.\n{tree.code}")
    for name, path in others.items():
        path.write_text(f"{HEADER} from {name}, for {origin}.\n{tree.files[name]}")
    paths[1].write_text(mapped.to_json(origin, f"{paths[0].stem}.{cls.__name__}") + "\n")
    test_header = f"{HEADER} from {origin}: the gate of {paths[0].name}.\n"
    paths[2].write_text(gate_file.render(gate_spec, test_header))
    emitted = time.perf_counter()
    gate = run_written_gate(paths[2]) if run_gate else None
    seconds = {"trace": traced - started, "write": emitted - traced}
    if run_gate:
        seconds["gate"] = time.perf_counter() - emitted
    stubs = tuple(s for _, s in tree.stubs)
    placed = tree.root.emitted.placed
    return PortResult(
        *paths, placed, stubs, mapped.renames, gate, seconds, tree.classes,
        tuple(others.values()),
    )  # fmt: skip


def _build(cls: type, fields: Mapping[str, Any]) -> Any:
    try:
        return cls(**fields)
    except TypeError as error:
        raise BadInput(
            f"{cls.__name__}({', '.join(fields)}): {error} (give the fields as "
            "CLASS(field=literal, ...) or through fields_from=MODULE:FUNCTION)"
        ) from None


def run_written_gate(test_path: Path) -> Gate:
    """The written test file's `gate()`, run in this process (its folder on `sys.path` while
    it imports the port beside it)."""
    folder = str(test_path.parent.resolve())
    name = f"_migrate_port_gate_{test_path.stem}"
    for stale in [name, *(p.stem for p in test_path.parent.glob("*_nnx.py"))]:
        sys.modules.pop(stale, None)  # the ports written there, as written now
    sys.path.insert(0, folder)
    try:
        loaded = importlib.util.spec_from_file_location(name, test_path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
        status, report = module.gate()
    finally:
        sys.path.remove(folder)
    return Gate(status, report)


def run_command(
    target: str,
    inputs: str,
    out_dir: str,
    call_kwargs: str | None,
    names: str,
    force: bool,
    fields_from: str | None = None,
    method: str | None = None,
) -> int:
    """`migrate port TARGET --inputs=SPEC`: the port written and gated, its summary printed;
    exit 0 the gate passes, 1 it fails (BadInput propagates: exit 2)."""
    module_name, class_name, fields = spec.parse_target(target)
    specs = spec.parse_inputs(inputs)
    calls = spec.parse_call_kwargs(call_kwargs)
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # MODULE as `python -m` finds it
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise BadInput(f"cannot import {module_name}: {type(error).__name__}: {error}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise BadInput(f"{module_name} has no {class_name}")
    instance = _build(cls, fields) if fields else cls
    result = port(
        instance, specs, out_dir, call_kwargs=calls, names=names, force=force,
        fields_from=fields_from, method=method,
    )  # fmt: skip
    print(result.summary())
    return result.status
