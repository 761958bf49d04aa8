"""The optimizer both twins train with: optax AdamW after global-norm gradient clipping."""

from __future__ import annotations

import optax

from migrate.config.contract import Config


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW with the config's hyperparameters; clipping first unless its threshold is 0."""
    adamw = optax.adamw(
        cfg.learning_rate,
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.adam_weight_decay,
    )
    if cfg.gradient_clipping_threshold > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
    return adamw
