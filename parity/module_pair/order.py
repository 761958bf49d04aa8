"""Where a record sits in a module's execution: the order a Linen module's submodules return,
read by tracing (never running) one call under `nn.intercept_methods`, and a record's rank in
that order, for verdicts that name the earliest place among equal errors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.nnx import bridge


def linen_calls(fn: Callable[..., Any], *args: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """The `/`-joined paths of the Linen modules `fn(*args)` calls, in the order their first
    calls return (`block_0/attn/query`, ..., `block_0/attn`, ..., `block_0`): the order their
    outputs are made; and those that hold an NNX module (`nnx.bridge.ToLinen`). Traced with
    `jax.eval_shape`, never run."""
    seen: dict[str, None] = {}
    bridged = set()

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        path = "/".join(context.module.path)
        seen.setdefault(path, None)
        if isinstance(context.module, bridge.ToLinen):
            bridged.add(path)
        return out

    with nn.intercept_methods(record):
        jax.eval_shape(fn, *args)
    return tuple(p for p in seen if p), frozenset(bridged)


def inside(capture: str, layers: frozenset[str]) -> bool:
    """`capture` (`block_0/norm`, `block_0/norm/1`) is strictly inside one of `layers`."""
    return any(capture.startswith(f"{layer}/") for layer in layers)


class ExecutionRank:
    """A record's place in execution order: the index of the longest module path its tensor
    name contains as whole `/` parts (`linen-init/grads/block_1/attn/key/kernel` ->
    `block_1/attn/key`); names that contain none (the outputs, the loss) rank last. Equal
    ranks keep the records' own order (call order, then Linen's path order): `min` and
    `sorted` are stable, and nothing here depends on hashing."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.index = {tuple(p.split("/")): i for i, p in enumerate(paths)}
        self.longest = max((len(p) for p in self.index), default=0)

    def __call__(self, tensor: str) -> int:
        module = self.module_of(tensor)
        return len(self.index) if module is None else self.index[module]

    def module_of(self, tensor: str) -> tuple[str, ...] | None:
        """The longest module path `tensor` names (the earliest in execution among equals)."""
        parts = tuple(tensor.split("/"))
        for length in range(min(self.longest, len(parts)), 0, -1):
            found = [
                parts[i : i + length]
                for i in range(len(parts) - length + 1)
                if parts[i : i + length] in self.index
            ]
            if found:
                return min(found, key=self.index.__getitem__)
        return None
