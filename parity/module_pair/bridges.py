"""Half-migrated models: an NNX model holding Linen layers through `nnx.bridge.ToNNX`, under
the harness's own capture of sown values and submodule outputs.

`nnx.capture` stores its buffers on every module as the attribute `__captures__`; `ToNNX`
hands every attribute of its own to Linen as a variable collection and raises on that one
("Cannot infer collection name from value: (Intermediate(...),)"). The harness calls a merged
copy of the user's model, never the model itself; there each `ToNNX` becomes a subclass whose
call hides the buffers from Linen and puts them back before the capture reads them.

And what the Linen layer sows: `ToNNX` calls it with `mutable=False` unless told otherwise, so
its sown values are dropped, and a correct half-migrated model would differ from the Linen
original in every value the layer sows. During a harness call each bridged layer is called
with the sown collections mutable (when its caller did not choose), and the values it stored
are taken off the layer again and handed to the harness with the layer's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from flax import nnx
from flax.nnx import bridge

CAPTURES = "__captures__"  # where `nnx.capture` keeps a module's buffers (flax 0.12.8, 0.12.12)
_SHIELDED: dict[type, type] = {}
# id(bridged layer) -> (its path in the model, where its sown values go, the sown collections)
_ACTIVE: dict[int, tuple[tuple[str, ...], list, Mapping[str, type]]] = {}


def _shielded(cls: type) -> type:
    if cls not in _SHIELDED:

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            hidden = self.__dict__.pop(CAPTURES, None)
            active = _ACTIVE.get(id(self))
            sowing = active is not None and kwargs.get("mutable") is None
            if sowing:
                kwargs["mutable"] = list(active[2])
            try:
                out = cls.__call__(self, *args, **kwargs)
                if sowing:  # before the buffers are back: they hold Variables of these types
                    path, collected, collections = active
                    collected.append((path, nnx.pop(self, nnx.Any(*collections.values()))))
            finally:
                if hidden is not None:
                    self.__dict__[CAPTURES] = hidden
            return out

        _SHIELDED[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _SHIELDED[cls]


def shield_bridges(model: nnx.Module) -> None:
    """Let every `ToNNX` inside `model` (a copy the harness made) run under `nnx.capture`."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, bridge.ToNNX) and type(module) not in _SHIELDED.values():
            module.__class__ = _shielded(type(module))


@contextlib.contextmanager
def bridged_sown(model: nnx.Module, collections: Mapping[str, type]) -> Iterator[list]:
    """While open, every `ToNNX` inside `model` (shielded) hands what its Linen layer sows in
    `collections` (name -> NNX Variable type) to the yielded list, as (its path, an
    `nnx.State` of those Variables)."""
    collected: list = []
    layers = [
        (tuple(str(k) for k in path), module)
        for path, module in nnx.iter_modules(model)
        if isinstance(module, bridge.ToNNX)
    ]
    for path, module in layers:
        _ACTIVE[id(module)] = (path, collected, dict(collections))
    try:
        yield collected
    finally:
        for _, module in layers:
            _ACTIVE.pop(id(module), None)


def with_prefixes(collected: list) -> nnx.State:
    """The collected states, each under its layer's path, as one `nnx.State`; a layer called
    twice sows twice, and its values join in call order (as Linen's `sow` appends them)."""
    flat: dict[tuple, Any] = {}
    for path, state in collected:
        for inner, variable in nnx.to_flat_state(state):
            key = (*path, *inner)
            if key in flat:
                variable = variable.replace(flat[key].get_value() + variable.get_value())
            flat[key] = variable
    return nnx.from_flat_state(list(flat.items()))
