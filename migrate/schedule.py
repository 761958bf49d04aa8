"""Layer placement and the GPipe schedule: one source of truth for pipelines, converters, tests.

Stage s during repeat r runs global layers `(r*S + s)*L + j`, j in 0..L-1, so a reference stack
`[N, ...]` is the row-major flattening of the pipeline stack `[R, S, L, ...]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from migrate.config import Config


def layer_index(repeat: int, stage: int, slot: int, num_stages: int, layers_per_stage: int) -> int:
    """Global layer run by `stage` during `repeat` in in-stage position `slot`."""
    if not 0 <= slot < layers_per_stage:
        raise ValueError(f"slot {slot} outside 0..{layers_per_stage - 1}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    return (repeat * num_stages + stage) * layers_per_stage + slot


def stage_layers(cfg: Config, stage: int) -> list[int]:
    """Every global layer that `stage` runs, in the order it runs them."""
    return [
        layer_index(r, stage, j, cfg.num_stages, cfg.layers_per_stage)
        for r in range(cfg.num_repeats)
        for j in range(cfg.layers_per_stage)
    ]


def placement(cfg: Config) -> dict[int, tuple[int, int, int]]:
    """Global layer -> (repeat, stage, slot), for every layer of the decoder."""
    return {
        layer_index(r, s, j, cfg.num_stages, cfg.layers_per_stage): (r, s, j)
        for r in range(cfg.num_repeats)
        for s in range(cfg.num_stages)
        for j in range(cfg.layers_per_stage)
    }


def stage_work(cfg: Config, iteration: jnp.ndarray | int):
    """What every stage does at `iteration`: (microbatch ids, repeat ids, valid mask), each [S].

    Stage s works on `processed = t - d*s`: microbatch `processed % M`, repeat
    `processed // M`. Slots with `processed` outside `0 .. M*R - 1` are bubbles (valid False);
    their ids are clipped into range so that indexing stays in bounds.
    """
    stages = jnp.arange(cfg.num_stages)
    processed = iteration - cfg.forwarding_delay * stages
    valid = (processed >= 0) & (processed < cfg.num_microbatches * cfg.num_repeats)
    processed = jnp.clip(processed, 0, cfg.num_microbatches * cfg.num_repeats - 1)
    return processed % cfg.num_microbatches, processed // cfg.num_microbatches, valid


def last_stage_microbatch(cfg: Config, iteration: jnp.ndarray | int):
    """(microbatch id, valid) of what the last stage finishes at `iteration`."""
    microbatch_ids, _, valid = stage_work(cfg, iteration)
    return microbatch_ids[-1], valid[-1]


def split_microbatches(x: jax.Array, num_microbatches: int) -> jax.Array:
    """`[B, ...] -> [M, B/M, ...]`, microbatch m holding rows `b % M == m`.

    Strided rather than contiguous, so that each microbatch spreads over the batch shards and
    splitting needs no communication.
    """
    per_microbatch = x.shape[0] // num_microbatches
    return x.reshape(per_microbatch, num_microbatches, *x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of `split_microbatches`: `[M, B/M, ...] -> [B, ...]` in the original row order."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
