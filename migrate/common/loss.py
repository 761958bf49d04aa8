"""The decoder's loss, framework-free (both twins): token-mean cross entropy, over the tokens a
packed batch counts, plus the weighted load-balancing loss of a model with experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from migrate.config.contract import Config


def cross_entropy_loss(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Token-mean cross entropy: microbatching cannot change its scale. With `weights` (a
    packed batch: 0 for padding), the mean over the tokens they count."""
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if weights is None:
        return per_token.mean()
    return jnp.sum(per_token * weights) / jnp.sum(weights)


def training_loss(
    cfg: Config,
    logits: jax.Array,
    aux: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
) -> jax.Array:
    """The loss the optimizer sees: cross entropy (over the tokens `weights` counts), plus
    `load_balance_loss_weight` x the load-balancing loss `aux` in a model with experts."""
    loss = cross_entropy_loss(logits, targets, weights)
    if cfg.num_experts > 1:
        loss = loss + cfg.load_balance_loss_weight * aux
    return loss
