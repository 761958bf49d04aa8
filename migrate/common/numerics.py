"""Dtypes, matmul precision and initializers named by a config (both twins)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
