"""Leaf-by-leaf comparison of two trees, with tolerances named by dtype and precision.

Metrics per leaf: max abs error; max relative error measured against the reference leaf's
largest magnitude (`max|a-b| / max|b|`, which stays meaningful where single elements are near
zero); the same expressed in units of float32 epsilon ("ulp at scale"); the count of elements
that differ at all; NaN/Inf on either side. NaN or Inf anywhere always fails.

Imported without JAX (JAX is imported where a tree is walked or an array fetched): the MaxText
gate validates a config's declared tier (`TIERS`) before JAX starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from migrate.config.contract import Config


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Allowed max relative error (against the reference leaf's scale) and why; with
    `max_abs`, a leaf also passes whose largest absolute error is within it (a leaf whose
    scale is near zero, such as a gradient the math says vanishes, has no useful relative
    error)."""

    max_rel: float
    reason: str
    max_abs: float = 0.0


# Linen against NNX: the twins compile to the same XLA program (the `compile` check compares
# the optimised programs' fingerprints), so the results are bit-identical in every dtype and
# matmul precision: the twin checks are exact.
EXACT = Tolerance(0.0, "identical computation: bit-exact")
# Pipelined vs reference: the same math on different shapes ([B/M, T, E] microbatches against
# the full batch). XLA:CPU vectorises reductions (RMSNorm's mean, softmax's sum) differently per
# shape, so results differ by rounding only (RMSNorm's mean alone differs by 2.4e-7 between a
# batch of 16 and eight batches of 2; the dots are bit-identical). Measured worst over every
# shipped float32 config (llama2-tiny, -scan, -delay, -agonce, -tp, -4d), seeds 0-2, both
# stacks, loss, logits, every gradient and the global gradient norm (bench/parity_errors.py,
# docs/configs.md): 1.88e-6 (15.8 ulp at scale, llama2-tiny-scan gradients, jax 0.12);
# `matmul_precision=default` measures the same as `highest` on XLA:CPU (float32 dots run in
# float32 either way), so one tier serves both. 64 ulp at scale is 4.1x that. Pipeline bugs
# (wrong rotation, order, masking) fail it by orders of magnitude (tests/test_injected_bugs.py).
# It also holds a step accumulating gradients over k batches against one step on all of them
# (the `train` check's accumulation records): worst 2.27e-6 over the same configs, seeds 0-2,
# k = 2 and 4 (llama2-tiny-scan's gradients; bench/accumulation_errors.py, docs/configs.md).
F32_RESHAPED = Tolerance(
    64 * float(np.finfo(np.float32).eps),
    "float32, same math on different shapes: 64 ulp at scale",
)
# bfloat16 activations or weights: the reordered float32 work flips bfloat16 roundings (one
# bf16 ulp is 2^-8..2^-7 of a value), which compound over the layers, over the bfloat16
# all-reduces of tensor parallelism, and over the pipeline's accumulation of bfloat16 weight
# gradients across microbatch visits. Measured worst over every shipped tiny config run in
# bfloat16 (activations and weights, default precision; seeds 0-4) and the shipped bf16 config:
# 4.88e-2 (12.5 bf16 ulp at scale, llama2-tiny-tp gradients, jax 0.12); without tensor
# parallelism at most 1.88e-2. 40 bf16 ulp at scale is 3.2x that. The pipeline's logic is held
# to the float32 tier by the float32 configs (the code is dtype-agnostic); this tier still fails
# pipeline bugs such as microbatches out of order by orders of magnitude. Accumulated
# gradients against one step on the whole batch, llama2-tiny-bf16: 1.49e-2 (the same bench).
BF16_RESHAPED = Tolerance(
    40 * float(2.0**-8), "bfloat16 anywhere, same math on different shapes: 40 bf16 ulp at scale"
)


# The tiers a float32 difference is classified by, and a gate config may declare (the MaxText
# gate's `gate: {tier: ...}`), loosest last.
TIERS = {"bit-exact": EXACT, "reordering": F32_RESHAPED}


def tier(max_rel: float) -> str:
    """Which tier a float32 difference holds: `bit-exact`; `reordering` (within
    `F32_RESHAPED`, what the same math in another order measures); `beyond` (neither)."""
    return next((name for name, tol in TIERS.items() if max_rel <= tol.max_rel), "beyond")


def twin_tolerance(cfg: Config) -> Tolerance:
    """Tolerance for Linen against NNX: the twins compile to the same program (the `compile`
    check shows the fingerprint), so they are bit-exact in every dtype and matmul precision."""
    del cfg
    return EXACT


def reshaped_tolerance(cfg: Config) -> Tolerance:
    """Tolerance for the same computation on differently shaped inputs (pipeline against
    reference): float32 throughout, or bfloat16 anywhere (activations or weights)."""
    if cfg.dtype == "float32" and cfg.weight_dtype == "float32":
        return F32_RESHAPED
    return BF16_RESHAPED


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """How one leaf of `actual` differs from the same leaf of `expected`."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float
    ulp_at_scale: float
    mismatches: int
    nonfinite_actual: int
    nonfinite_expected: int

    def passes(self, tol: Tolerance) -> bool:
        return (
            self.nonfinite_actual == 0
            and self.nonfinite_expected == 0
            and (self.max_rel <= tol.max_rel or self.max_abs <= tol.max_abs)
        )


def path_str(path: Iterable[Any]) -> str:
    """`('params', 'layers', 'kernel')`-like key path -> `params/layers/kernel`."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def empty(leaf: Any) -> bool:
    """A leaf of zero elements (a stack of no layers): it has a shape and a dtype, no value."""
    return getattr(leaf, "size", np.size(leaf)) == 0


def one_sided_empty_note(side: str) -> str:
    """What a zero-element leaf on one side only is: a note, not a difference (deepseek's
    `dense_layers` with `first_num_dense_layers: 0`: MaxText 0.2.3 builds them with no layer,
    0.2.5 builds none)."""
    return f"zero elements, on the {side} side only: no value to compare"


class TreeMismatch(ValueError):
    """The twins' trees differ in structure or shape: a parity failure, not a crash."""


def leaf_diff(
    path: str, actual: Any, expected: Any, labels: tuple[str, str] | None = None
) -> LeafDiff:
    from parity.multiprocess.distributed import to_host

    a, b = np.asarray(to_host(actual)), np.asarray(to_host(expected))
    if a.shape != b.shape:
        first, second = labels or ("", "")
        raise TreeMismatch(
            f"{path}: shapes differ: {first} {a.shape} vs {second} {b.shape}".replace("  ", " ")
        )
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(a64) & np.isfinite(b64)
    diff = np.abs(a64 - b64)[finite]
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(b64[finite]).max()) if diff.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    eps = float(np.finfo(np.float32).eps)
    return LeafDiff(
        path=path,
        shape=tuple(a.shape),
        dtype=str(b.dtype),
        max_abs=max_abs,
        max_rel=max_rel,
        ulp_at_scale=max_rel / eps,
        mismatches=int(np.count_nonzero(a64 != b64)),
        nonfinite_actual=int(np.count_nonzero(~np.isfinite(a64))),
        nonfinite_expected=int(np.count_nonzero(~np.isfinite(b64))),
    )


def compare_trees(
    actual: Any, expected: Any, labels: tuple[str, str] | None = None
) -> list[LeafDiff]:
    """One LeafDiff per leaf; the two trees must have the same structure. `labels` name the
    two sides in a mismatch's message (`('NNX', 'Linen')`)."""
    import jax

    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(expected)
    if tree_a != tree_b:
        first, second = labels or ("actual", "expected")
        paths_a = {path_str(p) for p, _ in flat_a}
        paths_b = {path_str(p) for p, _ in flat_b}
        only = [
            f"only in {label}: {sorted(paths)[:10]}"
            for label, paths in ((first, paths_a - paths_b), (second, paths_b - paths_a))
            if paths
        ]
        raise TreeMismatch(
            "tree structures differ: "
            + ("; ".join(only) if only else "same paths, different containers")
            + f"\n  {first}: {tree_a}\n  {second}: {tree_b}"
        )
    return [
        leaf_diff(path_str(p), a, b, labels) for (p, a), (_, b) in zip(flat_a, flat_b, strict=True)
    ]


def worst(diffs: list[LeafDiff]) -> LeafDiff:
    """The leaf with the largest relative error (non-finite leaves first)."""
    return max(diffs, key=lambda d: (d.nonfinite_actual + d.nonfinite_expected > 0, d.max_rel))
