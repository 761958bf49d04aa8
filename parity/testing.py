"""pytest helpers: fail a test with `compare_modules`' report when a module pair parts ways.

    def test_my_block_is_migrated():
        with nnx.use_eager_sharding(False):
            block = NNXBlock(4, 16, rngs=nnx.Rngs(0))
        assert_parity(LinenBlock(16), block, (jnp.ones((8, 4)),))

On failure the AssertionError's message is `parity.pairs.format_report`: one line per check,
then every failing record (tensor path, both sides, the error against its tolerance).

A long session gating many pairs: call `free_compiled_programs_near_map_limit()` after each
test (an autouse fixture), or XLA:CPU segfaults once the process maps too many regions.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from parity.engine import compiles
from parity.engine.result import CheckResult
from parity.pairs import compare_modules, format_report


def assert_passed(results: Sequence[CheckResult], title: str = "parity") -> None:
    """Raise AssertionError with the rendered report unless every check passed."""
    __tracebackhide__ = True  # pytest shows the report, not this frame
    if not results or not all(r.passed for r in results):
        raise AssertionError(format_report(results, title) if results else f"{title}: no checks")


def assert_parity(
    linen_module: nn.Module, nnx_module: nnx.Module, inputs: Any, **options: Any
) -> list[CheckResult]:
    """`compare_modules(linen_module, nnx_module, inputs, **options)`, asserted to pass.

    Returns the results (for further assertions on their records) when every check passes.
    """
    __tracebackhide__ = True
    results = compare_modules(linen_module, nnx_module, inputs, **options)
    title = f"{type(linen_module).__name__} (Linen) vs {type(nnx_module).__name__} (NNX)"
    assert_passed(results, title)
    return results


_MAPS = Path("/proc/self/maps")
_MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")


def mapped_regions() -> int:
    """How many memory regions this process maps (0 where /proc does not say)."""
    if not _MAPS.exists():
        return 0
    with _MAPS.open() as maps:
        return sum(1 for _ in maps)


def free_compiled_programs_near_map_limit(fraction: float = 0.5) -> bool:
    """Drop JAX's in-memory caches once this process maps more than `fraction` of Linux's
    `vm.max_map_count` regions; True when it did.

    Every XLA:CPU executable maps its JIT code and data as separate regions (tens to thousands
    per program) and keeps them while it is cached. A process compiling many programs (this
    project's suite: ~6,000 regions per shipped config's checks) crosses the default limit
    of 65,530, an mmap fails inside XLA, and the process segfaults. Cleared executables are
    freed once nothing else holds them; a later call recompiles them (a hit in the persistent
    compilation cache, where one is set)."""
    limit = int(_MAX_MAP_COUNT.read_text()) if _MAX_MAP_COUNT.exists() else 0
    if not limit or mapped_regions() <= fraction * limit:
        return False
    jax.clear_caches()
    compiles.forget_programs()
    gc.collect()
    return True
