"""Half-migrated models: an NNX model holding Linen layers through `nnx.bridge.ToNNX`, under
the harness's own capture of sown values and submodule outputs.

`nnx.capture` stores its buffers on every module as the attribute `__captures__`; `ToNNX`
hands every attribute of its own to Linen as a variable collection and raises on that one
("Cannot infer collection name from value: (Intermediate(...),)"). The harness calls a merged
copy of the user's model, never the model itself; there each `ToNNX` becomes a subclass whose
call hides the buffers from Linen and puts them back before the capture reads them.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.nnx import bridge

CAPTURES = "__captures__"  # where `nnx.capture` keeps a module's buffers (flax 0.12.8, 0.12.12)
_SHIELDED: dict[type, type] = {}


def _shielded(cls: type) -> type:
    if cls not in _SHIELDED:

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            hidden = self.__dict__.pop(CAPTURES, None)
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                if hidden is not None:
                    self.__dict__[CAPTURES] = hidden

        _SHIELDED[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _SHIELDED[cls]


def shield_bridges(model: nnx.Module) -> None:
    """Let every `ToNNX` inside `model` (a copy the harness made) run under `nnx.capture`."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, bridge.ToNNX) and type(module) not in _SHIELDED.values():
            module.__class__ = _shielded(type(module))
