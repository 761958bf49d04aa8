"""The optimizer both twins train with: optax AdamW after global-norm gradient clipping, and
where its state lives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
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


def state_shardings(
    tx: optax.GradientTransformation,
    abstract_params: Any,
    param_shardings: Any,
    mesh: jax.sharding.Mesh,
    is_leaf: Callable[[Any], bool],
) -> Any:
    """The shardings of `tx`'s state: each moment sharded like its parameter, everything else
    (step counts) replicated over `mesh`."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    mapped = []  # `eval_shape` returns arrays only: the shardings come out by this list

    def under_a_trace() -> tuple[()]:
        # `tree_map_params` runs `tx.init` on placeholders: run eagerly, its step count would be
        # a program compiled for one scalar.
        mapped.append(
            optax.tree_map_params(
                tx,
                lambda _, param_sharding: param_sharding,
                jax.eval_shape(tx.init, abstract_params),
                param_shardings,
                transform_non_params=lambda _: replicated,
                is_leaf=is_leaf,
            )
        )
        return ()

    jax.eval_shape(under_a_trace)
    return mapped[0]


def step_count(opt_state: Any) -> jax.Array:
    """The optimizer steps taken so far: AdamW's step count in `opt_state` (0 before the first
    step; a checkpoint of the state carries it)."""
    return optax.tree_utils.tree_get(opt_state, "count")
