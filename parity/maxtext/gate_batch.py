"""The MaxText gate's synthetic batch: MaxText's batch keys (tokens, positions, segment ids,
targets), the same arrays on both sides, deterministic in (seed, split, step); packed rows with
`packing: true`."""

from __future__ import annotations

from typing import Any

import numpy as np


def batch(keys: dict[str, Any], devices: int, seed: int, step: int, split: str) -> dict:
    """MaxText's training batch for the synthetic data: tokens, positions, segment ids and
    targets, deterministic in (seed, split, step) and the same on both sides."""
    size = int(keys["per_device_batch_size"] * devices)
    length, vocab = int(keys["max_target_length"]), int(keys["vocab_size"])
    rng = np.random.default_rng([seed, {"train": 0, "eval": 1}[split], step])
    tokens = rng.integers(0, vocab, size=(size, length + 1), dtype=np.int32)
    if keys.get("packing") is True:
        segments, positions = packed_rows(rng, size, length)
    else:
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (size, length)).copy()
        segments = np.ones((size, length), np.int32)
    return {
        "inputs": tokens[:, :-1],
        "inputs_position": positions,
        "inputs_segmentation": segments,
        "targets": tokens[:, 1:],
        "targets_segmentation": segments,
    }


def packed_rows(rng: np.random.Generator, rows: int, length: int) -> tuple[np.ndarray, ...]:
    """(segment ids, positions) `[rows, length]` of packed rows, as the twins' synthetic data
    packs them (`parity.decoder.data`): documents 1, 2, ... of geometric lengths (a token
    starts one with probability 1/4), then 0 to length/4 tokens of padding (segment 0);
    positions count from 0 in each document."""
    starts = rng.random((rows, length)) < 0.25
    starts[:, 0] = True
    segments = np.cumsum(starts, axis=1, dtype=np.int32)
    padding = rng.integers(0, length // 4 + 1, size=(rows, 1))
    real = np.arange(length)[None, :] < length - padding
    index = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    positions = np.where(real, index - start, 0).astype(np.int32)
    return np.where(real, segments, 0).astype(np.int32), positions
