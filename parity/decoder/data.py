"""Deterministic synthetic batches: the same tokens on both sides, for any step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from migrate.common import axes, packing, sharding
from migrate.config.contract import Config

SPLIT_SALT = {"train": 1_000_003, "eval": 2_000_003}


def synthetic_batch(
    cfg: Config, mesh: Mesh, step: int = 0, split: str = "train", rows: int | None = None
) -> dict[str, jax.Array]:
    """`{'inputs', 'targets'}` int32 `[rows, T]`, batch-sharded; targets are inputs shifted
    left. `rows` by default: a train step's (`train_batch_size`, every batch it accumulates
    over), or the model's batch (`global_batch_size`) for `eval`.

    Deterministic in (seed, split, step, rows); `eval` batches never repeat a `train` batch.
    """
    if rows is None:
        rows = cfg.train_batch_size if split == "train" else cfg.global_batch_size
    shape = (rows, cfg.max_target_length + 1)
    seed = np.int32(cfg.seed + SPLIT_SALT[split])
    batch_sharding = sharding.named_sharding(
        axes.BATCH_LENGTH_EMBED[:2], mesh, cfg.logical_axis_rules
    )
    inputs, targets = _tokens(seed, np.int32(step), shape, cfg.vocab_size, batch_sharding)
    if not cfg.packing:
        return {"inputs": inputs, "targets": targets}
    segments, positions = _documents(seed, np.int32(step), shape[0], shape[1] - 1, batch_sharding)
    return {
        "inputs": inputs,
        "targets": targets,
        "inputs_segmentation": segments,
        "inputs_position": positions,
        "targets_segmentation": segments,
    }


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _tokens(
    seed: jax.Array,
    step: jax.Array,
    shape: tuple[int, int],
    vocab_size: int,
    batch_sharding: NamedSharding,
) -> tuple[jax.Array, jax.Array]:
    """(inputs, targets) of one batch, in one program for every seed and step (the key
    derivation and the slicing compiled once, not op by op), made where they live: placed
    afterwards, they would be resharded by a program of their own."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    tokens = jax.random.randint(key, shape, 0, vocab_size, dtype=jnp.int32)
    return jax.lax.with_sharding_constraint((tokens[:, :-1], tokens[:, 1:]), batch_sharding)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _documents(
    seed: jax.Array, step: jax.Array, rows: int, length: int, batch_sharding: NamedSharding
) -> tuple[jax.Array, jax.Array]:
    """(segment ids, positions) `[rows, length]` of packed rows (`packing.documents`),
    their documents and padding drawn from (seed, step)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), 1)
    starts_key, padding_key = jax.random.split(key)
    starts = jax.random.bernoulli(starts_key, packing.DOCUMENT_START, (rows, length))
    padding = jax.random.randint(padding_key, (rows, 1), 0, packing.max_padding(length) + 1)
    packed = packing.documents(starts.at[:, 0].set(True), padding)
    return jax.lax.with_sharding_constraint(packed, batch_sharding)
