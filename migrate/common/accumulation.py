"""Gradient accumulation (MaxText's `gradient_accumulation_steps`): one optimizer step's loss
and gradients accumulated over k batches, then averaged.

Framework-free: both twins' train steps wrap their own loss function (Linen's over boxed
parameters, NNX's over the Param state; both are pytrees) in `value_and_grad`, so the two
accumulate in one order and stay bit-exact. The step's batch is split as MaxText splits it:
row `r` goes to accumulation step `r mod k` (a reshape `[B/k, k]` and a swap), so every device
keeps its own rows of a batch-sharded array and no data moves. With equal token counts per
batch the average of the k losses is the whole batch's loss; MaxText divides the summed
per-token losses by the summed token counts, which is the same here (no padding). The
load-balancing loss of a model with experts is averaged over the k batches, as MaxText does;
it is not the whole batch's (routing statistics are per batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def split_batch(batch: Any, steps: int) -> Any:
    """Every `[k*B, ...]` leaf of `batch` as `[k, B, ...]`, row `r` in accumulation step
    `r mod k` (MaxText's split)."""

    def split(rows: jax.Array) -> jax.Array:
        per_step = rows.shape[0] // steps
        return jnp.swapaxes(rows.reshape(per_step, steps, *rows.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def value_and_grad(loss_fn: Callable, steps: int) -> Callable:
    """`(params, batch, dropout_keys=None) -> ((loss, (outputs, aux)), grads)`, what
    `jax.value_and_grad(loss_fn, has_aux=True)` gives, over `steps` accumulated batches:
    loss, aux and gradients averaged over them (`outputs` None: no step returns its logits).
    `loss_fn(params, batch, dropout_keys=...) -> (loss, (outputs, aux))`; the rows' dropout
    keys are split with their rows. One step: `jax.value_and_grad` itself, the program
    unchanged."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def grads_of(params: Any, batch: Any, dropout_keys: jax.Array | None) -> Any:
        if dropout_keys is None:  # a loss without dropout need not take the keys
            return grad_fn(params, batch)
        return grad_fn(params, batch, dropout_keys=dropout_keys)

    if steps == 1:

        @functools.wraps(grad_fn)  # the program keeps the loss's name
        def one_step(params: Any, batch: Any, dropout_keys: jax.Array | None = None) -> Any:
            return grads_of(params, batch, dropout_keys)

        return one_step

    def accumulated(
        params: Any, batch: Any, dropout_keys: jax.Array | None = None
    ) -> tuple[tuple[jax.Array, Any], Any]:
        parts = split_batch(batch, steps)
        part_keys = None if dropout_keys is None else split_batch(dropout_keys, steps)
        first = jax.tree.map(lambda x: x[0], parts)
        (loss_shape, (_, aux_shape)), grad_shape = jax.eval_shape(grad_fn, params, first)
        zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)

        def accumulate(sums: tuple, part_and_keys: tuple) -> tuple[tuple, None]:
            loss_sum, aux_sum, grad_sum = sums
            part, keys = part_and_keys
            (loss, (_, aux)), grads = grads_of(params, part, keys)
            add = lambda total, x: jax.tree.map(jnp.add, total, x)
            return (loss_sum + loss, add(aux_sum, aux), add(grad_sum, grads)), None

        start = (zeros(loss_shape), zeros(aux_shape), zeros(grad_shape))
        (loss_sum, aux_sum, grad_sum), _ = jax.lax.scan(accumulate, start, (parts, part_keys))
        mean = lambda tree: jax.tree.map(lambda x: x / steps, tree)
        return (loss_sum / steps, (None, mean(aux_sum))), mean(grad_sum)

    return accumulated
