"""The parity harness. `compare_modules` (from `parity.pairs`) is loaded on first use, so that
`import parity` and the `parity` command stay free of JAX until the CLI has set XLA_FLAGS."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parity.pairs import compare_modules

__all__ = ["compare_modules"]


def __getattr__(name: str) -> Any:
    if name == "compare_modules":
        from parity.pairs import compare_modules

        return compare_modules
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
