"""Dtypes, matmul precision, initializers and remat policies named by a config (both twins)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from migrate.common import axes
from migrate.config.contract import Config

_PRECISION = {
    "default": jax.lax.Precision.DEFAULT,
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}


def activation_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def weight_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.weight_dtype)


def precision(cfg: Config) -> jax.lax.Precision:
    return _PRECISION[cfg.matmul_precision]


def kernel_init(
    in_axis: int | tuple[int, ...],
    out_axis: int | tuple[int, ...],
    batch_axis: int | tuple[int, ...] = (),
):
    """Fan-in truncated-normal init (MaxText's dense default) for a kernel of any rank;
    `batch_axis` (the expert dim of stacked expert kernels) counts in neither fan."""
    return jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
    )


embedding_init = jax.nn.initializers.normal(stddev=1.0)
scale_init = jax.nn.initializers.ones


def remat_policy(cfg: Config):
    """The `jax.checkpoint` policy that `remat_policy` names, or None for no remat."""
    if cfg.remat_policy == "none":
        return None
    if cfg.remat_policy == "save_iteration_and_layer_inputs":
        return jax.checkpoint_policies.save_only_these_names(
            axes.ITERATION_INPUT, axes.DECODER_LAYER_INPUT
        )
    if cfg.remat_policy == "minimal":
        return jax.checkpoint_policies.checkpoint_dots
    return jax.checkpoint_policies.nothing_saveable  # "full"
