"""`migrate port`: write the NNX port of a Linen module, its weight map and its gate.
`port` (from `migrate.port.command`) is loaded on first use, so that `import migrate.port`
stays free of JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from migrate.port.command import port

__all__ = ["port"]


def __getattr__(name: str) -> Any:
    if name == "port":
        from migrate.port.command import port

        return port
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
