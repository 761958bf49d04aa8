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
    """(segment ids, positions) `[rows, length]` of packed rows, drawn as the twins' synthetic
    data draws them (`migrate.common.packing.documents`, on the host)."""
    from migrate.common import packing  # JAX only for a packed batch

    starts = rng.random((rows, length)) < packing.DOCUMENT_START
    starts[:, 0] = True
    padding = rng.integers(0, packing.max_padding(length) + 1, size=(rows, 1))
    return packing.documents(starts, padding, xp=np)
