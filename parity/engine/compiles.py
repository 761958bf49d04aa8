"""What a stretch of a run cost: XLA compilations (real ones and persistent-cache reads), the
seconds spent compiling, comparing, and the rest (running), read from `jax.monitoring`.

JAX records every backend compile (`/jax/core/compile/backend_compile_duration`, with the
program's name) and, when it was served from the persistent cache instead, a cache hit with the
compile time that read saved. One listener, registered once, keeps them in order; `measure()`
reads the events of the stretch it wraps. Comparisons are timed by `comparing()` around the
record builders, so that a check's wall time splits into compile, compare and run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from migrate.runtime import cli_support

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
TIME_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
# The partitioner's warnings are not monitoring events: `compiler_output` captures them.

_lock = threading.Lock()
_events: list[tuple[str, float, str]] = []  # (event, seconds, program name)
_compare_seconds = [0.0]
_registered = [False]


def _on_duration(event: str, seconds: float, **kwargs: Any) -> None:
    if event in (BACKEND_COMPILE, TIME_SAVED):
        with _lock:
            _events.append((event, float(seconds), str(kwargs.get("fun_name", ""))))


def _on_event(event: str, **kwargs: Any) -> None:
    if event == CACHE_HIT:
        with _lock:
            _events.append((event, 0.0, ""))


def listen() -> None:
    """Register the listeners (once per process)."""
    with _lock:
        if _registered[0]:
            return
        _registered[0] = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


@dataclasses.dataclass
class Cost:
    """A stretch of a run: `compilations` backend compiles of the named `programs` (each one
    either compiled or read from the persistent cache: `cache_reads` of them), their
    `compile_seconds` (reads included), what the cache reads saved (`saved_seconds`: the
    recorded compile time of what was read), comparison and total wall seconds."""

    compilations: int = 0
    cache_reads: int = 0
    compile_seconds: float = 0.0
    saved_seconds: float = 0.0
    compare_seconds: float = 0.0
    wall_seconds: float = 0.0
    programs: list[str] = dataclasses.field(default_factory=list)

    @property
    def run_seconds(self) -> float:
        """Everything that is neither compiling nor comparing: tracing, running, transfers."""
        return max(self.wall_seconds - self.compile_seconds - self.compare_seconds, 0.0)

    def as_json(self) -> dict[str, Any]:
        return {
            "compilations": self.compilations,
            "cache_reads": self.cache_reads,
            "compile_seconds": self.compile_seconds,
            "cache_saved_seconds": self.saved_seconds,
            "run_seconds": self.run_seconds,
            "compare_seconds": self.compare_seconds,
            "wall_seconds": self.wall_seconds,
            "programs": list(self.programs),
        }

    @staticmethod
    def total(costs: list[Cost]) -> Cost:
        out = Cost()
        for c in costs:
            out.compilations += c.compilations
            out.cache_reads += c.cache_reads
            out.compile_seconds += c.compile_seconds
            out.saved_seconds += c.saved_seconds
            out.compare_seconds += c.compare_seconds
            out.wall_seconds += c.wall_seconds
            out.programs += c.programs
        return out


def _cost_of(events: list[tuple[str, float, str]]) -> Cost:
    cost = Cost()
    for event, seconds, name in events:
        if event == BACKEND_COMPILE:
            cost.compilations += 1
            cost.compile_seconds += seconds
            cost.programs.append(name)
        elif event == CACHE_HIT:
            cost.cache_reads += 1
        elif event == TIME_SAVED:
            cost.saved_seconds += seconds
    return cost


@contextlib.contextmanager
def measure() -> Iterator[Cost]:
    """`with measure() as cost:` fills `cost` when the block ends (also when it raises)."""
    listen()
    cost = Cost()
    with _lock:
        first = len(_events)
    compare_before = _compare_seconds[0]
    start = time.perf_counter()
    try:
        yield cost
    finally:
        with _lock:
            found = _cost_of(_events[first:])
        found.wall_seconds = time.perf_counter() - start
        found.compare_seconds = _compare_seconds[0] - compare_before
        for field in dataclasses.fields(Cost):
            setattr(cost, field.name, getattr(found, field.name))


def events_after(index: int) -> tuple[list[tuple[str, float, str]], int]:
    """The events recorded since `index`, and the index to ask from next (a worker sends its
    own with each reply)."""
    with _lock:
        return list(_events[index:]), len(_events)


def record(events: list, source: str) -> None:
    """Events another process recorded (a worker's compiles), counted here as if this process
    had; their programs named `source/NAME`. Its compile seconds add to this run's."""
    parsed = [(str(e), float(s), f"{source}/{n}" if n else "") for e, s, n in events]
    with _lock:  # all or none: a malformed event raises before any is counted
        _events.extend(parsed)


@contextlib.contextmanager
def comparing() -> Iterator[None]:
    """Count the block's seconds as comparing (not nested: the outermost block counts)."""
    if getattr(_nesting, "depth", 0):
        yield
        return
    _nesting.depth = 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _nesting.depth = 0
        _compare_seconds[0] += time.perf_counter() - start


_nesting = threading.local()


def compare_timed(fn: Callable) -> Callable:
    """`fn`, its seconds counted as comparing."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with comparing():
            return fn(*args, **kwargs)

    return timed


# ------------------------------------------------------------------ programs compiled once

# The SPMD partitioner's warning for a reshard it cannot express (it replicates the tensor,
# then partitions it): `... cannot go from sharding {A} to {B} efficiently for HLO operation
# %name = f32[2,16,64]{2,1,0} ...`.
_REMAT = re.compile(
    r"Involuntary full rematerialization.*?cannot go from sharding (?P<source>\{.*?\}) to "
    r"(?P<target>\{.*?\}) efficiently for HLO operation (?P<name>%\S+) = "
    r"(?P<dtype>[a-z]+\d*)\[(?P<shape>[\d,]*)\]"
)
_echo_partitioner_warnings = False  # `echo_partitioner_warnings`


def echo_partitioner_warnings(echo: bool) -> None:
    """Echo the partitioner's warnings as they come (`parity --verbose`), or keep them."""
    global _echo_partitioner_warnings
    _echo_partitioner_warnings = echo


@dataclasses.dataclass(frozen=True)
class Remat:
    """One involuntary full rematerialisation the partitioner announced."""

    operation: str  # HLO instruction name
    dtype: str
    shape: tuple[int, ...]
    source: str  # the sharding it has
    target: str  # the sharding it needs

    @property
    def bytes(self) -> int:
        """The tensor's global size: what each device holds once it is replicated."""
        bits = 8 if self.dtype == "pred" else int(re.sub(r"\D", "", self.dtype) or 8)
        return math.prod(self.shape) * bits // 8

    def describe(self) -> str:
        shape = ",".join(map(str, self.shape))
        tensor = f"{self.operation} {self.dtype}[{shape}] ({self.bytes} B)"
        return f"{tensor}: {self.source} -> {self.target}"


def parse_remats(text: str) -> tuple[Remat, ...]:
    """The partitioner's involuntary-rematerialisation warnings in `text` (compiler output)."""
    found = []
    for line in text.splitlines():
        match = _REMAT.search(line)
        if match:
            shape = tuple(int(d) for d in match["shape"].split(",") if d)
            found.append(
                Remat(match["name"], match["dtype"], shape, match["source"], match["target"])
            )
    return tuple(found)


@contextlib.contextmanager
def compiler_output(noise: re.Pattern | None = None) -> Iterator[list[str]]:
    """Capture what the compiler writes to stderr (file descriptor 2) in the block: the
    partitioner's warnings are kept (echoed only after `echo_partitioner_warnings(True)`),
    lines that match `noise` are kept and never echoed, every other line is passed on to
    stderr when the block ends."""
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured += sink.read().decode("utf-8", "replace").splitlines()
    passed_on = [
        line
        for line in captured
        if (_echo_partitioner_warnings or not _REMAT.search(line))
        and not (noise is not None and noise.search(line))
    ]
    if passed_on:
        print("\n".join(passed_on), file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled in this process: `executable`, the wall `seconds` its compile
    took here, whether that was a persistent-cache read (`cache_read`: no compile), and the
    partitioner's involuntary rematerialisations (for a cache read: as the compile that wrote
    the entry recorded them, `_record_path`; None where none did)."""

    executable: jax.stages.Compiled
    seconds: float
    cache_read: bool
    remats: tuple[Remat, ...] | None = ()

    def describe(self) -> str:
        """How the compile time was obtained, plainly."""
        if self.cache_read:
            return (
                f"read from the persistent compilation cache in {self.seconds:.1f}s, not "
                "compiled (the partitioner's warnings as its compile recorded them)"
            )
        return f"compiled in {self.seconds:.1f}s"


_programs: dict[tuple[str, str, str], Compiled] = {}
RECORDS = "parity-partitioner"  # our folder in the persistent cache's directory


def program_key(lowered: jax.stages.Lowered) -> tuple[str, str, str]:
    """The program (its StableHLO, shardings included) and the argument and result trees a
    compiled executable is called with: two lowerings with the same key are one program."""
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return text, str(lowered.in_tree), str(lowered.out_tree)


def _record_path(key: tuple[str, str, str]) -> Path | None:
    """Where a compile of the program `key` records its partitioner warnings, beside the
    persistent cache that will serve the program (same JAX, flags and backend; keyed by the
    program alone, as the cache is: twins with the same program share it); None without a
    local cache directory."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or not Path(directory).is_dir():
        return None
    program = key[0]
    context = (program, jax.__version__, os.environ.get("XLA_FLAGS", ""), jax.default_backend())
    name = hashlib.sha256(repr(context).encode()).hexdigest()
    return Path(directory) / RECORDS / f"{name}.json"


def _read_record(key: tuple[str, str, str]) -> tuple[Remat, ...] | None:
    path = _record_path(key)
    try:
        found = json.loads(path.read_text()) if path is not None else None
        return tuple(Remat(**{**r, "shape": tuple(r["shape"])}) for r in found)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # no record, or not one of ours: compile again to know


def _write_record(key: tuple[str, str, str], remats: tuple[Remat, ...]) -> None:
    path = _record_path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps([dataclasses.asdict(r) for r in remats]))
        staged.replace(path)  # whole or not at all, for a concurrent reader
    except OSError:
        pass  # a cache we cannot write to: the next run compiles again


def _compile(lowered: jax.stages.Lowered, key: tuple[str, str, str], **options: Any) -> Compiled:
    with measure() as cost, compiler_output() as output:
        executable = lowered.compile(**options)
    if cost.cache_reads:
        return Compiled(executable, cost.wall_seconds, True, _read_record(key))
    remats = parse_remats("\n".join(output))
    _write_record(key, remats)
    return Compiled(executable, cost.wall_seconds, False, remats)


def compile_once(lowered: jax.stages.Lowered, warnings: bool = False) -> tuple[Compiled, bool]:
    """`lowered` compiled, once per distinct program in this process: (the compile, whether
    it was shared: compiled before for another lowering of the same program). `warnings`: the
    partitioner's warnings must be known; a program read from the persistent cache without
    its compile's record of them is compiled again (`compile_for_real`)."""
    key = program_key(lowered)
    compiled = _programs.get(key)
    shared = compiled is not None
    if compiled is None:
        compiled = _compile(lowered, key)
    if warnings and compiled.remats is None:
        compiled, shared = compile_for_real(lowered), False
    _programs[key] = compiled
    return compiled, shared


# A compiler option at its default value: the same program, but another persistent-cache key.
_UNCACHED = {"xla_embed_ir_in_executable": False}


def compile_for_real(lowered: jax.stages.Lowered) -> Compiled:
    """Compile `lowered` by the compiler even where the persistent cache holds it: JAX
    decides whether it uses the cache once per process (`is_cache_used`), so the compile gets a
    key of its own (`_UNCACHED`), and a minimum compile time no compile reaches keeps it from
    being written under that key. Its partitioner warnings are recorded for cache reads."""
    previous = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        compiled = _compile(lowered, program_key(lowered), compiler_options=_UNCACHED)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
    assert not compiled.cache_read, "a compile under a never-written key was read from the cache"
    return compiled


def use_compilation_cache(directory: str, min_compile_seconds: float = 0.0) -> str:
    """Compile through JAX's persistent cache in `directory`; with none given, through a
    temporary one of this run's, deleted when the process exits (`cli_support.remove_at_exit`:
    a lost worker's prompt exit too; only a crash leaves it in the temp folder): identical
    programs of a run (the twins' train steps, Linen's and NNX's) are then compiled once, the
    rest read. The directory used."""
    if not directory:
        directory = tempfile.mkdtemp(prefix="parity-run-cache-")
        cli_support.remove_at_exit(directory)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return directory


def forget_programs() -> None:
    """Drop the programs `compile_once` holds (with `jax.clear_caches`, to free them)."""
    _programs.clear()
