"""Deterministic synthetic batches: the same tokens on both sides, for any step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
    key = jax.random.fold_in(jax.random.key(cfg.seed + SPLIT_SALT[split]), step)
    shape = (cfg.global_batch_size, cfg.max_target_length + 1)
    tokens = jax.random.randint(key, shape, 0, cfg.vocab_size, dtype=jnp.int32)
    batch_sharding = sharding.named_sharding(
        axes.BATCH_LENGTH_EMBED[:2], mesh, cfg.logical_axis_rules
    )
    return {
        "inputs": distributed.place(tokens[:, :-1], batch_sharding),
        "targets": distributed.place(tokens[:, 1:], batch_sharding),
    }
