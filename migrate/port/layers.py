"""The Linen layers `migrate port` translates, as data: each one's NNX class, the sizes NNX
needs that Linen infers from the first input, the fields renamed between them, and the
arguments NNX takes at call time rather than at construction."""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import numpy as np
from flax import nnx

from migrate.port.trace import fields_of

Sizes = Callable[[Any, Mapping[str, Any]], list[Any]]  # (first input, attributes) -> sizes


def _last(x: Any, attrs: Mapping[str, Any]) -> list[Any]:
    del attrs
    return [int(x.shape[-1])]


def _axis(x: Any, attrs: Mapping[str, Any]) -> list[Any]:
    return [int(x.shape[attrs["axis"]])]


def _general(x: Any, attrs: Mapping[str, Any]) -> list[Any]:
    axes = attrs["axis"] if isinstance(attrs["axis"], tuple | list) else (attrs["axis"],)
    return [tuple(int(x.shape[a]) for a in axes)]


def _none(x: Any, attrs: Mapping[str, Any]) -> list[Any]:
    del x, attrs
    return []


@dataclasses.dataclass(frozen=True)
class Layer:
    """One Linen layer class and its NNX form."""

    linen: type
    nnx: type
    sizes: Sizes  # NNX's leading size arguments, from the first call's input
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)  # Linen -> NNX field
    at_call: frozenset[str] = frozenset()  # fields NNX also takes as call arguments
    call_renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)  # call kwargs
    needs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # field: required value
    feature_last: bool = False  # translated only with feature_axes -1

    @property
    def needs_input(self) -> bool:
        """Whether NNX's constructor needs a size only the first call's input gives (a layer
        that needs none is built from its fields, called or not: `nn.Dropout`, `nn.Embed`)."""
        return self.sizes is not _none

    @property
    def label(self) -> str:
        return f"nn.{self.linen.__name__} -> nnx.{self.nnx.__name__}"

    def nnx_parameters(self) -> Mapping[str, inspect.Parameter]:
        return inspect.signature(self.nnx.__init__).parameters

    def carried(self) -> set[str]:
        """The Linen fields with an NNX constructor argument (under its NNX name)."""
        linen = fields_of(self.linen)
        nnx_names = set(self.nnx_parameters())
        return {f for f in linen if self.renamed.get(f, f) in nnx_names}

    def refusal(self, attrs: Mapping[str, Any]) -> str | None:
        """Why this instance cannot be translated (None: it can)."""
        for field, value in self.needs.items():
            if attrs.get(field) != value:
                return f"{field}={attrs.get(field)!r} (translated only with {field}={value!r})"
        if self.feature_last and attrs.get("feature_axes") not in (-1, (-1,)):
            return f"feature_axes={attrs.get('feature_axes')!r} (translated only with -1)"
        return None


_OUT = {"features": "out_features"}
LAYERS: dict[type, Layer] = {
    layer.linen: layer
    for layer in (
        Layer(nn.Dense, nnx.Linear, _last, _OUT),
        Layer(nn.DenseGeneral, nnx.LinearGeneral, _general, _OUT, needs={"batch_dims": ()}),
        Layer(nn.Conv, nnx.Conv, _last, _OUT),
        Layer(nn.ConvTranspose, nnx.ConvTranspose, _last, _OUT),
        Layer(nn.Embed, nnx.Embed, _none),
        Layer(nn.LayerNorm, nnx.LayerNorm, _last, feature_last=True),
        Layer(nn.RMSNorm, nnx.RMSNorm, _last, feature_last=True),
        Layer(nn.InstanceNorm, nnx.InstanceNorm, _last, feature_last=True),
        Layer(nn.GroupNorm, nnx.GroupNorm, _last, needs={"reduction_axes": None}),
        Layer(
            nn.BatchNorm,
            nnx.BatchNorm,
            _axis,
            at_call=frozenset({"use_running_average"}),
        ),
        Layer(
            nn.Dropout,
            nnx.Dropout,
            _none,
            at_call=frozenset({"deterministic"}),
            call_renamed={"rng": "rngs"},
        ),
    )
}


def literal(value: Any) -> str | None:
    """Python source for `value` where it is a literal (numbers, strings, tuples of them,
    dtypes as `jnp.NAME`, enum members as `CLASS.MEMBER`: `imports_for` names their
    classes); None otherwise."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, bool | int | float | str | type(None)):
        return repr(value)
    if isinstance(value, tuple | list):
        items = [literal(v) for v in value]
        if any(i is None for i in items):
            return None
        inner = ", ".join(items) + ("," if len(items) == 1 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if not isinstance(value, type | np.dtype):
        return None
    try:
        return f"jnp.{np.dtype(value).name}"
    except (TypeError, ValueError):
        return None


def imports_for(value: Any) -> set[tuple[str, str]]:
    """`(module, name)` of each enum class `literal(value)` writes by name."""
    if isinstance(value, enum.Enum):
        return {(type(value).__module__, type(value).__qualname__)}
    if isinstance(value, tuple | list):
        return set().union(*(imports_for(v) for v in value)) if value else set()
    return set()
