"""pytest helpers: fail a test with `compare_modules`' report when a module pair parts ways.

    def test_my_block_is_migrated():
        with nnx.use_eager_sharding(False):
            block = NNXBlock(4, 16, rngs=nnx.Rngs(0))
        assert_parity(LinenBlock(16), block, (jnp.ones((8, 4)),))

On failure the AssertionError's message is `parity.pairs.format_report`: one line per check,
then every failing record (tensor path, both sides, the error against its tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
from flax import nnx

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
