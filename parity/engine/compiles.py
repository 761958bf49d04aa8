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
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
TIME_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
# The partitioner's warnings are not monitoring events: `parity.decoder.cost` captures them.

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


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled in this process: `executable`, the wall `seconds` its compile
    took here, and whether that was a persistent-cache read (`cache_read`; then
    `recorded_seconds` is the compile time the cache entry recorded, else `seconds`)."""

    executable: jax.stages.Compiled
    seconds: float
    cache_read: bool
    recorded_seconds: float

    def describe(self) -> str:
        """How the compile time was obtained, plainly."""
        if self.cache_read:
            return (
                f"read from the persistent compilation cache in {self.seconds:.1f}s (its "
                f"compile took {self.recorded_seconds:.1f}s when cached)"
            )
        return f"compiled in {self.seconds:.1f}s"


_programs: dict[tuple[str, str, str], Compiled] = {}


def program_key(lowered: jax.stages.Lowered) -> tuple[str, str, str]:
    """The program (its StableHLO, shardings included) and the argument and result trees a
    compiled executable is called with: two lowerings with the same key are one program."""
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return text, str(lowered.in_tree), str(lowered.out_tree)


def compile_once(lowered: jax.stages.Lowered) -> tuple[Compiled, bool]:
    """`lowered` compiled, once per distinct program in this process: (the compile, whether
    it was shared: compiled before for another lowering of the same program)."""
    key = program_key(lowered)
    if key in _programs:
        return _programs[key], True
    with measure() as cost:
        executable = lowered.compile()
    _programs[key] = Compiled(
        executable,
        cost.wall_seconds,
        cost.cache_reads > 0,
        cost.saved_seconds + cost.compile_seconds if cost.cache_reads else cost.wall_seconds,
    )
    return _programs[key], False


def forget_programs() -> None:
    """Drop the programs `compile_once` holds (with `jax.clear_caches`, to free them)."""
    _programs.clear()
