"""How a module pair is called: `Call` (arguments, per-side arguments, modes, randomness) and
the Linen collection <-> NNX Variable type map; framework-free, shared by both module sides.

A comparison is a sequence of calls, run in order on both sides with the state each call
updates (batch statistics, caches, NNX's RNG counters) carried into the next: a train-mode
call, then an eval-mode call, compares the running averages the first one wrote. A call's
array arguments are traced (they are the program's inputs); everything else (flags such as
`train=True`, strings, None) is static.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

# Linen collection -> NNX Variable type: the defaults; `collections=` adds or overrides.
# A collection whose type is an `nnx.Intermediate` (sub)class holds sown values: compared
# after each call, never moved as weights.
DEFAULT_COLLECTIONS: Mapping[str, type] = {
    "params": nnx.Param,
    "batch_stats": nnx.BatchStat,
    "cache": nnx.Cache,
    "intermediates": nnx.Intermediate,
}


def is_sown(variable_type: type) -> bool:
    return issubclass(variable_type, nnx.Intermediate)


@dataclasses.dataclass(frozen=True)
class Randomness:
    """Where a stochastic call takes its randomness on each side.

    Linen draws by stream (`apply(..., rngs={stream: key})`, the default) or takes a raw key
    as the keyword argument `linen_arg` (`nn.Dropout`'s `rng`). NNX uses the module's own
    `nnx.Rngs` streams (their counters carried from call to call, the default) or takes the
    raw key as the keyword argument `nnx_arg` (`nnx.Dropout`'s `rngs`); with
    `nnx_arg_as="rngs"` that argument is an `nnx.Rngs` made from the key, its default stream
    and each of `linen_streams` (a port whose `__call__` takes `rngs: nnx.Rngs`).

    With both `linen_arg` and `nnx_arg` the two sides get the same raw key per call, so their
    masks align: the call is compared exactly, like a deterministic one. Otherwise no key
    derivation lines the two up (Linen folds the scope path into the key, an `nnx.Rngs` stream
    folds in its counter), and the `random` check compares the sides' output distributions
    over `draws` independent draws instead.
    """

    linen_streams: tuple[str, ...] = ("dropout",)
    linen_arg: str | None = None
    nnx_arg: str | None = None
    draws: int = 128
    nnx_arg_as: str = "key"  # or "rngs": `nnx_arg` gets nnx.Rngs(key, **{stream: key})

    @property
    def aligned(self) -> bool:
        """The same raw key reaches both modules' masks (an `nnx.Rngs` derives its own)."""
        return self.linen_arg is not None and self.nnx_arg is not None and self.nnx_arg_as == "key"

    def nnx_value(self, key: Any) -> Any:
        """What the NNX module's `nnx_arg` gets for `key`."""
        if self.nnx_arg_as == "rngs":
            return nnx.Rngs(key, **dict.fromkeys(self.linen_streams, key))
        return key


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of both modules: `module(*args, **kwargs)`.

    `linen` and `nnx` are keyword arguments only that side gets, where the APIs differ
    (Linen's `train=True` against an NNX module's own flag); `nnx_attributes` are set on the
    NNX module for this call only (`Module.set_attributes`, the mode switch `nnx.view` uses:
    `{"deterministic": False, "use_running_average": False}`); `method` calls that method
    instead of `__call__` on both sides (`"attend"`); `randomness` makes the call stochastic;
    `name` labels its records (default `call0`, `call1`, ...).
    """

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    linen: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    nnx: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    nnx_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    method: str | None = None
    randomness: Randomness | None = None
    name: str = ""

    def side_kwargs(self, framework: str) -> dict[str, Any]:
        """The keyword arguments `framework`'s module gets."""
        return {**self.kwargs, **(self.linen if framework == "linen" else self.nnx)}

    @property
    def compared_exactly(self) -> bool:
        """Deterministic, or stochastic with the same key on both sides."""
        return self.randomness is None or self.randomness.aligned


def named(calls: Sequence[Call]) -> tuple[Call, ...]:
    """The calls with their default names filled in (`call0`, ...)."""
    return tuple(
        c if c.name else dataclasses.replace(c, name=f"call{i}") for i, c in enumerate(calls)
    )


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def is_float(leaf: Any) -> bool:
    """A floating-point array (or tracer): one whose gradient can be taken."""
    return jax.numpy.issubdtype(jax.numpy.result_type(leaf), jax.numpy.inexact)


@dataclasses.dataclass(frozen=True)
class CallInputs:
    """One side's arguments of one call, split into the arrays (traced, labelled by where
    they sit: `0`, `mask`, `0/1`) and the static rest, and put back together inside a trace.
    `shared` are the labels of the arrays both sides get."""

    treedef: Any
    leaves: tuple[Any, ...]
    labels: tuple[str | None, ...]  # per leaf: its label when an array, else None
    shared: frozenset[str]

    @classmethod
    def of(cls, call: Call, framework: str) -> CallInputs:
        tree = (tuple(call.args), call.side_kwargs(framework))
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        labels = tuple(_label(path) if is_array(leaf) else None for path, leaf in flat)
        shared_tree = (tuple(call.args), dict(call.kwargs))
        shared = {
            _label(path)
            for path, leaf in jax.tree_util.tree_flatten_with_path(shared_tree)[0]
            if is_array(leaf)
        }
        return cls(treedef, tuple(leaf for _, leaf in flat), labels, frozenset(shared))

    def arrays(self) -> dict[str, Any]:
        """The traced part: label -> array."""
        return {lab: leaf for lab, leaf in zip(self.labels, self.leaves, strict=True) if lab}

    def rebuild(self, arrays: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) with the traced `arrays` in place of the originals."""
        leaves = [
            arrays[lab] if lab else leaf for lab, leaf in zip(self.labels, self.leaves, strict=True)
        ]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        return tuple(args), dict(kwargs)


def _label(path: tuple) -> str:
    """`((SequenceKey(0), SequenceKey(0)) -> '0'`, `(SequenceKey(1), DictKey('mask')) ->
    'mask'`: positional arguments by index, keyword arguments by name, nested by `/`."""
    keys = []
    for key in path[1:]:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                keys.append(str(getattr(key, attr)))
                break
        else:
            keys.append(str(key))
    return "/".join(keys)


def call_keys(calls: Sequence[Call], seed: int) -> tuple[Any, ...]:
    """The raw key each call gets when its randomness is aligned (the same on both sides),
    else None: one fresh key per call, so that a stream that never advances shows."""
    base = jax.random.fold_in(jax.random.key(seed), 0x5EED)
    return tuple(
        jax.random.fold_in(base, i) if c.randomness is not None else None
        for i, c in enumerate(calls)
    )


def draw_keys(seed: int, call_index: int, count: int) -> jax.Array:
    """The keys of the `random` check's draws of one call (both sides' Linen-style streams
    and raw key arguments take draw `d`'s key)."""
    base = jax.random.fold_in(jax.random.key(seed), 0xD4A5)
    return jax.random.split(jax.random.fold_in(base, call_index), count)
