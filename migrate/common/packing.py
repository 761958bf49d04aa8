"""Packed sequences (MaxText's `packing`): several documents per row, each token knowing its
position in its document and its document's segment id (both twins).

A batch of packed rows carries MaxText's keys: `inputs_position` (the position within the
document, which the rotary embedding reads) and `inputs_segmentation` (the document's id, 1,
2, ...; 0 is padding), and `targets_segmentation` (the loss counts the tokens whose id is not
0). Attention lets a token see the earlier tokens of its own document only. The decoder carries
both as one `Positions` pytree, which the pipeline splits into microbatches and indexes per
stage as it does the activations; a decoder layer takes them as two arrays (MaxText's
`decoder_positions`, `decoder_segment_ids`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Positions(NamedTuple):
    """What each row of `[B, T]` tokens carries besides its activations, split and indexed
    per microbatch with them: where each token sits (`index`, its position in its document;
    `segment`, its document's id, 0 padding, or None where every row is one document) and the
    row's dropout keys `[B]` (`migrate.common.dropout`; None: no dropout)."""

    index: jax.Array
    segment: jax.Array | None = None
    dropout: jax.Array | None = None


# The synthetic data's documents: each token starts a new one with this probability (lengths
# geometric, mean 4), and a row ends in 0 to a quarter of its length of padding.
DOCUMENT_START = 0.25


def max_padding(length: int) -> int:
    """The most padding tokens a synthetic packed row of `length` tokens ends in."""
    return length // 4


def documents(starts: Any, padding: Any, xp: Any = jnp) -> tuple[Any, Any]:
    """(segment ids, positions) `[rows, T]` of packed rows, from where their documents start
    (`starts`, bool `[rows, T]`, column 0 True) and the padding each ends in (`[rows, 1]`):
    documents 1, 2, ..., then padding (segment 0); positions count from 0 in each document.
    `xp=numpy` computes them on the host (the MaxText gate's batch)."""
    length = starts.shape[1]
    index = xp.broadcast_to(xp.arange(length, dtype=xp.int32), starts.shape)
    real = index < length - padding
    segments = xp.cumsum(starts, axis=1, dtype=xp.int32)
    document_start = xp.maximum.accumulate(xp.where(starts, index, 0), axis=1)
    return xp.where(real, segments, 0), xp.where(real, index - document_start, 0)


def of_tokens(
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_keys: jax.Array | None = None,
) -> Positions:
    """The tokens' `Positions`: `positions` given, or `0 .. T-1` on every row."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return Positions(positions, segment_ids, dropout_keys)


def attention_mask(segment_ids: jax.Array | None, length: int) -> jax.Array:
    """Which keys each query attends to: causal `[T, T]`, or, packed (`segment_ids` `[B, T]`),
    causal within each document `[B, 1, 1, T, T]` (broadcast over kv heads and query
    groups)."""
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    if segment_ids is None:
        return causal
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same)[:, None, None]


def decoder_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The decoder's keyword arguments of a batch: the segment ids and positions of a packed
    batch, nothing for an unpacked one."""
    if "inputs_segmentation" not in batch:
        return {}
    return {"segment_ids": batch["inputs_segmentation"], "positions": batch["inputs_position"]}


def loss_weights(batch: dict[str, Any]) -> jax.Array | None:
    """1 for each target the loss counts (not padding) of a packed batch; None unpacked."""
    if "targets_segmentation" not in batch:
        return None
    return (batch["targets_segmentation"] != 0).astype(jnp.float32)
