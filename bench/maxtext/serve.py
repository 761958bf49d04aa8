"""The protocol both benchmark workers speak: no project or MaxText imports, so that each side's
worker runs in its own virtual environment.

A worker compiles its function, prints one JSON line (`{"ready": ...}`), then answers each
`round` line on stdin with `{"times": [seconds per step]}`, each `compile` line with
`{"compile_s": seconds}` (lowered and compiled afresh), and stops at `quit` or end of input.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable


def compile_and_report(lowered, hlo_path: str | None) -> tuple[Callable, dict]:
    """Compile `lowered` (a `jax.stages.Lowered`), write its optimised HLO to `hlo_path`, and
    return the executable with its compile seconds and per-device memory."""
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    memory = compiled.memory_analysis()
    return compiled, {
        "compile_s": seconds,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
    }


def serve(
    step: Callable[[], object], recompile: Callable[[], float], steps: int, ready: dict
) -> None:
    """Answer rounds of `steps` timed calls of `step` (which must block until done) and
    compile rounds (`recompile` returns the seconds one fresh compile took)."""
    step()  # warm-up: the first call pays for allocation
    print(json.dumps({"ready": ready}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "compile":
            print(json.dumps({"compile_s": recompile()}), flush=True)
        elif command == "round":
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            print(json.dumps({"times": times}), flush=True)
        else:
            print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)


def timed_compile(lower: Callable[[], object]) -> float:
    """Seconds to compile `lower()` (a `jax.stages.Lowered`) afresh: JAX's in-memory caches
    are cleared first (the executable already held keeps working); lowering is not counted."""
    import jax

    jax.clear_caches()
    lowered = lower()
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start
