"""Deterministic synthetic batches: the same tokens on both sides, for any step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from migrate.common import axes, sharding
from migrate.config.contract import Config
from parity.multiprocess import distributed

SPLIT_SALT = {"train": 1_000_003, "eval": 2_000_003}


def synthetic_batch(
    cfg: Config, mesh: Mesh, step: int = 0, split: str = "train"
) -> dict[str, jax.Array]:
    """`{'inputs', 'targets'}` int32 `[B, T]`, batch-sharded; targets are inputs shifted left.

    Deterministic in (seed, split, step); `eval` batches never repeat a `train` batch.
    """
    shape = (cfg.global_batch_size, cfg.max_target_length + 1)
    seed = np.int32(cfg.seed + SPLIT_SALT[split])
    inputs, targets = _tokens(seed, np.int32(step), shape, cfg.vocab_size)
    batch_sharding = sharding.named_sharding(
        axes.BATCH_LENGTH_EMBED[:2], mesh, cfg.logical_axis_rules
    )
    return {
        "inputs": distributed.place(inputs, batch_sharding),
        "targets": distributed.place(targets, batch_sharding),
    }


@functools.partial(jax.jit, static_argnums=(2, 3))
def _tokens(
    seed: jax.Array, step: jax.Array, shape: tuple[int, int], vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """(inputs, targets) of one batch, in one program for every seed and step (the key
    derivation and the slicing compiled once, not op by op)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    tokens = jax.random.randint(key, shape, 0, vocab_size, dtype=jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]
