"""Layer placement and the GPipe schedule: one source of truth for pipelines, converters, tests.

Stage s during repeat r runs global layers `(r*S + s)*L + j`, j in 0..L-1, so a reference stack
`[N, ...]` is the row-major flattening of the pipeline stack `[R, S, L, ...]`. The schedule both
twins run (iterations, circular storage, the forwarding delay, bubbles) is docs/pipeline.md's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from migrate.config.contract import Config


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
    """Global layer -> (repeat, stage, slot), for every pipelined layer (the first P; where the
    others run: `migrate.common.placement`)."""
    return {
        layer_index(r, s, j, cfg.num_stages, cfg.layers_per_stage): (r, s, j)
        for r in range(cfg.num_repeats)
        for s in range(cfg.num_stages)
        for j in range(cfg.layers_per_stage)
    }


def stage_work(cfg: Config, iteration: jnp.ndarray | int, xp: Any = jnp):
    """What every stage does at `iteration`: (microbatch ids, repeat ids, valid mask), each [S].
    `xp=numpy` computes them on the host for a Python `iteration` (no XLA program).

    Stage s works on `processed = t - d*s`: microbatch `processed % M`, repeat
    `processed // M`. Slots with `processed` outside `0 .. M*R - 1` are bubbles (valid False);
    their ids are clipped into range so that indexing stays in bounds.
    """
    stages = xp.arange(cfg.num_stages)
    processed = iteration - cfg.forwarding_delay * stages
    valid = (processed >= 0) & (processed < cfg.num_microbatches * cfg.num_repeats)
    processed = xp.clip(processed, 0, cfg.num_microbatches * cfg.num_repeats - 1)
    return processed % cfg.num_microbatches, processed // cfg.num_microbatches, valid


def first_layers(cfg: Config, repeat_ids: jnp.ndarray) -> jnp.ndarray:
    """The global index of every stage's first layer at its repeat `repeat_ids` `[S]`:
    `(r*S + s)*L` (`migrate.common.layout`'s placement)."""
    stages = jnp.arange(cfg.num_stages)
    return (repeat_ids * cfg.num_stages + stages) * cfg.layers_per_stage


def last_stage_microbatch(cfg: Config, iteration: jnp.ndarray | int):
    """(microbatch id, valid) of what the last stage finishes at `iteration`: scalars.

    Derived from the iteration counter alone (`processed = t - d*(S-1)`), so every device
    computes them locally; reading them out of `stage_work`'s stage-sharded `[S]` arrays would
    cost a collective per iteration. Equal to `stage_work(cfg, t)[0][-1], [2][-1]`.
    """
    work = cfg.num_microbatches * cfg.num_repeats
    processed = iteration - cfg.forwarding_delay * (cfg.num_stages - 1)
    valid = (processed >= 0) & (processed < work)
    return jnp.clip(processed, 0, work - 1) % cfg.num_microbatches, valid


def first_stage_store(micro_inputs: jax.Array, num_stages: int, fill: jax.Array) -> jax.Array:
    """`[M, ...] -> [S, M, ...]`: stage 0's store of its M microbatches, `fill` elsewhere.

    Stage 0 reads microbatch `t % M` from row 0 at iteration t: the fresh input during the first
    repeat; each is overwritten by its output when the rotation wraps it around from the last
    stage (circular storage and the finished outputs in one buffer). With the stage axis
    sharded over stages, every read and write of the store is local to stage 0's devices; the
    other rows exist only to keep the stage axis uniform and are never selected.
    """
    first = (jnp.arange(num_stages) == 0).reshape(-1, *([1] * micro_inputs.ndim))
    return jnp.where(first, micro_inputs[None], fill)


def first_stage_input(
    store: jax.Array, shift: jax.Array, num_microbatches: int, iteration: jnp.ndarray | int
) -> jax.Array:
    """Every stage's input `[S, ...]`: stage 0 takes microbatch `t % M` from its store, the
    others what their left neighbour forwarded (`shift`). A select per stage row: local."""
    first = (jnp.arange(shift.shape[0]) == 0).reshape(-1, *([1] * (shift.ndim - 1)))
    return jnp.where(first, store[:, iteration % num_microbatches], shift)


def store_finished(
    cfg: Config, store: jax.Array, rotated: jax.Array, iteration: jnp.ndarray | int
) -> jax.Array:
    """`store` with the last stage's output of `iteration` written into stage 0's row.

    `rotated` is this iteration's stage outputs rotated one stage right, so its row 0 already
    holds the last stage's output (the rotation wraps around): each stage row writes its own
    row of `rotated`, and nothing moves between stages. Bubbles write nothing.
    """
    finished, finished_valid = last_stage_microbatch(cfg, iteration)
    kept = store[:, finished]
    return store.at[:, finished].set(jnp.where(finished_valid, rotated, kept))


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


def permutation(
    move: Callable[[jax.Array], jax.Array], inverse: Callable[[jax.Array], jax.Array]
) -> Callable[[jax.Array], jax.Array]:
    """`move`, a pure data movement, with `inverse` as its transpose under autodiff.

    A permutation's transpose is its inverse; saying so changes no value (no arithmetic either
    way) but lets XLA emit the backward of the stage rotation as one collective-permute, where
    autodiff's own transpose of `jnp.roll` (two pads and a sum) partitions into two.
    Reverse mode only: `jax.jvp` through it raises.
    """

    @jax.custom_vjp
    def moved(x: jax.Array) -> jax.Array:
        return move(x)

    moved.defvjp(lambda x: (move(x), None), lambda _, cotangent: (inverse(cotangent),))
    return moved


def window_start(cfg: Config, block: jnp.ndarray | int) -> jnp.ndarray | int:
    """First repeat of the two-repeat weight window that `pipeline_fsdp_ag_per_repeat` gathers
    for block `block` (iterations `block*M .. block*M + M - 1`; block R is the drain).

    During block b stage s works on repeat b, or still on b - 1 for its first `d*s` iterations
    (`d*(S-1) < M` by the config rules), so repeats `b-1, b` cover every stage; clipped into
    `0 .. R-2` at both ends, where only one of them is in use. Needs R >= 2.
    """
    if isinstance(block, int):
        return min(max(block - 1, 0), cfg.num_repeats - 2)
    return jnp.clip(block - 1, 0, cfg.num_repeats - 2)


def iterate(step: Callable, state, first: jnp.ndarray | int, count: int, scanned: bool):
    """`count` pipeline iterations `first, first + 1, ...` of `step(state, t) -> (state, out)`:
    a `lax.scan` or unrolled; returns the final state and the stacked outputs (None if None)."""
    if scanned:
        return jax.lax.scan(step, state, first + jnp.arange(count))
    outputs = []
    for k in range(count):
        state, out = step(state, jnp.asarray(first + k))
        outputs.append(out)
    if not outputs or outputs[0] is None:
        return state, None
    return state, jnp.stack(outputs)
