"""The `init` check: does the NNX twin initialise every parameter as Linen does?

Every other check moves one side's weights into the other, so the two initialisations are never
compared there; a port whose initializer has the wrong scale or family passes them all and then
trains differently from step 0. The two frameworks derive keys differently (the same seed gives
different draws), so this check compares, per parameter, the logical names, shape and dtype
exactly and the distribution statistically (`parity.analysis.initstats`).
"""

from __future__ import annotations

import math
from typing import Any

from migrate.checkpoints import convert
from parity.analysis import compare, initstats
from parity.multiprocess import distributed

METRIC = "stat/bound"


def _flat_leaves(boxed_params: Any) -> tuple[dict, dict]:
    arrays, names = convert.strip_boxes(distributed.to_host(boxed_params))
    return convert.flatten_dict(arrays), convert.flatten_dict(names)


def init_records(linen_params: Any, nnx_params: Any) -> list[dict]:
    """Per parameter: names, shape, dtype, then each distribution statistic; NNX against Linen.

    Both are the common form's `params` trees (Linen boxes; NNX weights moved there by
    `migrate.checkpoints.convert.nnx_to_linen`)."""
    linen_arrays, linen_names = _flat_leaves(linen_params)
    nnx_arrays, nnx_names = _flat_leaves(nnx_params)
    records: list[dict] = []
    for path in sorted(set(linen_arrays) | set(nnx_arrays)):
        where = "/".join(path)
        if path not in linen_arrays or path not in nnx_arrays:
            side = "NNX" if path not in nnx_arrays else "Linen"
            leaf = (linen_arrays if path in linen_arrays else nnx_arrays)[path]
            record = _fact(
                f"{where}: present",
                compare.empty(leaf),  # zero elements: a note, not a difference
                "yes" if side == "NNX" else "no",
                "no" if side == "NNX" else "yes",
            )
            if compare.empty(leaf):
                owner = "Linen" if path in linen_arrays else "NNX"
                record["note"] = compare.one_sided_empty_note(owner)
            records.append(record)
            continue
        linen, nnx = linen_arrays[path], nnx_arrays[path]
        records.append(
            _fact(
                f"{where}: names",
                linen_names[path] == nnx_names[path],
                linen_names[path],
                nnx_names[path],
            )
        )
        records.append(_fact(f"{where}: shape", linen.shape == nnx.shape, linen.shape, nnx.shape))
        records.append(_fact(f"{where}: dtype", linen.dtype == nnx.dtype, linen.dtype, nnx.dtype))
        if linen.shape != nnx.shape:
            continue
        stacked = initstats.stacked_dims(linen_names[path])
        linen_stats = initstats.Stats.of(linen, stacked)
        nnx_stats = initstats.Stats.of(nnx, stacked)
        for finding in initstats.compare(linen_stats, nnx_stats):
            ratio = (
                finding.difference / finding.bound
                if finding.bound > 0
                else (0.0 if finding.passed else math.inf)
            )
            records.append(
                {
                    "tensor": f"{where}: {finding.statistic}",
                    "passed": finding.passed,
                    "linen": finding.linen,
                    "nnx": finding.nnx,
                    "difference": finding.difference,
                    "bound": finding.bound,
                    "max_rel": ratio,
                }
            )
    return records


def _fact(tensor: str, passed: bool, linen: Any, nnx: Any) -> dict:
    return {
        "tensor": tensor,
        "passed": bool(passed),
        "linen": str(linen),
        "nnx": str(nnx),
        "max_rel": 0.0 if passed else math.inf,
    }
