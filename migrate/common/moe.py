"""Top-k routing and the load-balancing loss of the MoE blocks: framework-free, one definition
for both twins (`migrate/linen/layers.py`, `migrate/nnx/layers.py` `MoeBlock`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`(combine, routed)` of router probabilities `[..., E]`: `routed` is 1 for each token's k
    most probable experts (ties to the lower expert index, as `jax.lax.top_k`), else 0;
    `combine` their probabilities renormalised to sum to 1 (mixtral), 0 elsewhere.

    k passes of `argmax` rather than `jax.lax.top_k`: the same choice, but a reduction along
    the expert axis alone, which XLA keeps local to every batch shard; XLA partitions `top_k`
    on the pipeline's `[S, b, t, E]` probabilities by gathering them across the stages, a
    second collective per iteration across stages (measured on mixtral-tiny).
    """
    chosen = jnp.zeros(probs.shape, dtype=bool)
    for _ in range(k):
        best = jnp.argmax(jnp.where(chosen, -jnp.inf, probs), axis=-1)
        chosen = chosen | (jnp.arange(probs.shape[-1]) == best[..., None])
    kept = jnp.where(chosen, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True), chosen.astype(probs.dtype)


def load_balance_loss(probs: jax.Array, routed: jax.Array) -> jax.Array:
    """Switch/MaxText load-balancing loss `E * sum_e f_e * p_e` per sequence of `[b, t, E]`
    router probabilities and 0/1 routing (`f_e` the fraction of the sequence's tokens routed to
    expert e, `p_e` its mean probability), averaged over the b sequences: a float32 scalar.
    Uniform routing gives k, its minimum."""
    fraction_routed = jnp.mean(routed, axis=1)  # [b, E]
    mean_prob = jnp.mean(probs, axis=1)
    return probs.shape[-1] * jnp.mean(jnp.sum(fraction_routed * mean_prob, axis=-1))
