"""Do two initialisations draw every parameter from the same distribution?

Linen and NNX derive random keys differently, so the same seed gives different weights; the
two initialisations can only be compared in distribution. Per parameter, each side's sample
gives its mean, standard deviation, kurtosis, the fraction of values beyond `TAIL_SIGMAS`
standard deviations, and the fraction of exact zeros; each statistic must agree within
`Z_BOUND` standard errors of its difference, the standard errors derived from the element
counts. A constant parameter (ones, zeros) must be the same constant on both sides.

What that separates, for the sizes the shipped configs use (>= 2,048 elements per leaf):
- scale: a std ratio of 1.5 is a log-difference of 0.41, against a bound of about 0.13 at
  2,048 elements;
- family: kurtosis is 3.0 for a normal, 2.37 for the truncated normal that
  `variance_scaling(..., 'truncated_normal')` draws (cut at 2 sigma, rescaled), 1.8 for a
  uniform; the bound is about 0.32 at 16,384 elements. The tail fraction beyond 2.5 sigma is
  1.2% for a normal and exactly 0 for the truncated normal and the uniform. In bfloat16 the
  truncated normal also draws about 0.8% exact zeros (the normal none, measured over 5 seeds at
  64 x 256), so there the zero fraction is the first statistic to fail;
- zeros against ones, or a constant against a random draw: the constants differ.
- the same key reused along a stacked axis (layers or stages all equal): the count of
  distinct slices along the stacked axes, compared exactly.

With `Z_BOUND` = 6 a correct port raises a false alarm on one statistic with probability about
2e-9; `bench/bug_matrix.py` runs seeds 0-4 on every shipped tiny config (docs/configs.md),
`tests/test_injected_bugs.py` seeds 0-4 on llama2-tiny.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

Z_BOUND = 6.0
TAIL_SIGMAS = 2.5
# Below this many elements the family statistics (kurtosis, tail) are too noisy to tell a
# normal from a truncated normal; they are reported but not gated.
MIN_FAMILY_ELEMENTS = 1024
STACKED_AXES = ("layers", "circular_repeats", "layers_per_stage")


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary statistics of one parameter's initial values."""

    count: int
    mean: float
    std: float
    kurtosis: float  # E[(x-mean)^4] / std^4; 3 for a normal; nan for a constant
    tail: float  # fraction with |x - mean| > TAIL_SIGMAS * std
    zeros: float  # fraction exactly zero
    minimum: float
    maximum: float
    distinct_slices: int  # distinct slices along the stacked axes (1 when none)
    slices: int

    @classmethod
    def of(cls, values: np.ndarray, stacked_dims: tuple[int, ...] = ()) -> Stats:
        x = np.asarray(values, np.float64).reshape(-1)
        mean = float(x.mean()) if x.size else 0.0
        centred = x - mean
        std = float(np.sqrt(np.mean(centred**2))) if x.size else 0.0
        kurtosis = float(np.mean(centred**4) / std**4) if std > 0 else math.nan
        tail = float(np.mean(np.abs(centred) > TAIL_SIGMAS * std)) if std > 0 else 0.0
        distinct, slices = _distinct_slices(np.asarray(values), stacked_dims)
        return cls(
            count=int(x.size),
            mean=mean,
            std=std,
            kurtosis=kurtosis,
            tail=tail,
            zeros=float(np.mean(x == 0)) if x.size else 0.0,
            minimum=float(x.min()) if x.size else 0.0,
            maximum=float(x.max()) if x.size else 0.0,
            distinct_slices=distinct,
            slices=slices,
        )

    @property
    def constant(self) -> bool:
        return self.std == 0.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _distinct_slices(values: np.ndarray, stacked_dims: tuple[int, ...]) -> tuple[int, int]:
    """(distinct, total) slices of `values` along its stacked dims (hash of each slice's bytes)."""
    if not stacked_dims:
        return 1, 1
    rest = [d for d in range(values.ndim) if d not in stacked_dims]
    moved = np.transpose(values, (*stacked_dims, *rest))
    count = math.prod(values.shape[d] for d in stacked_dims)
    flat = np.ascontiguousarray(moved).reshape(count, -1)
    digests = {hashlib.sha1(row.tobytes()).hexdigest() for row in flat}
    return len(digests), count


def stacked_dims(names: tuple[str | None, ...] | None) -> tuple[int, ...]:
    """Positions of the stacked-layer axes among a parameter's logical names."""
    return tuple(i for i, n in enumerate(names or ()) if n in STACKED_AXES)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One statistic compared: its two values, the bound, and whether they agree."""

    statistic: str
    linen: float
    nnx: float
    difference: float
    bound: float
    passed: bool


def _kurtosis_variance(stats: Stats) -> float:
    """Variance of the sample kurtosis: 24/n for a normal; using the sample's own kurtosis
    (higher moments unknown) with the normal value as a floor keeps it conservative."""
    return max(24.0, 4.0 * max(stats.kurtosis, 1.0) ** 2) / max(stats.count, 1)


def compare(linen: Stats, nnx: Stats) -> list[Finding]:
    """Each statistic of the NNX sample against the Linen sample, within Z_BOUND std errors."""
    findings = [
        Finding(
            "distinct stacked slices",
            linen.distinct_slices,
            nnx.distinct_slices,
            abs(linen.distinct_slices - nnx.distinct_slices),
            0.0,
            linen.distinct_slices == nnx.distinct_slices,
        )
    ]
    if linen.constant or nnx.constant:
        same = linen.constant and nnx.constant and linen.mean == nnx.mean
        findings.append(
            Finding("constant value", linen.mean, nnx.mean, abs(linen.mean - nnx.mean), 0.0, same)
        )
        if not same:
            findings.append(
                Finding("std", linen.std, nnx.std, abs(linen.std - nnx.std), 0.0, False)
            )
        return findings

    n_l, n_n = linen.count, nnx.count
    mean_bound = Z_BOUND * math.sqrt(linen.std**2 / n_l + nnx.std**2 / n_n)
    findings.append(
        Finding(
            "mean",
            linen.mean,
            nnx.mean,
            abs(linen.mean - nnx.mean),
            mean_bound,
            abs(linen.mean - nnx.mean) <= mean_bound,
        )
    )
    # Standard error of log(std): sqrt((kurtosis - 1) / (4 n)).
    log_std_se = math.sqrt(
        (max(linen.kurtosis, 1.0) - 1 + 1e-3) / (4 * n_l)
        + (max(nnx.kurtosis, 1.0) - 1 + 1e-3) / (4 * n_n)
    )
    log_ratio = abs(math.log(nnx.std / linen.std))
    findings.append(
        Finding(
            "log std ratio",
            linen.std,
            nnx.std,
            log_ratio,
            Z_BOUND * log_std_se,
            log_ratio <= Z_BOUND * log_std_se,
        )
    )
    zero_p = max((linen.zeros * n_l + nnx.zeros * n_n) / (n_l + n_n), 1.0 / (n_l + n_n))
    zero_bound = Z_BOUND * math.sqrt(zero_p * (1 - zero_p) * (1 / n_l + 1 / n_n))
    findings.append(
        Finding(
            "zero fraction",
            linen.zeros,
            nnx.zeros,
            abs(linen.zeros - nnx.zeros),
            zero_bound,
            abs(linen.zeros - nnx.zeros) <= zero_bound,
        )
    )
    gated = min(n_l, n_n) >= MIN_FAMILY_ELEMENTS
    kurt_bound = Z_BOUND * math.sqrt(_kurtosis_variance(linen) + _kurtosis_variance(nnx))
    kurt_diff = abs(linen.kurtosis - nnx.kurtosis)
    findings.append(
        Finding(
            "kurtosis",
            linen.kurtosis,
            nnx.kurtosis,
            kurt_diff,
            kurt_bound,
            kurt_diff <= kurt_bound or not gated,
        )
    )
    tail_p = max((linen.tail * n_l + nnx.tail * n_n) / (n_l + n_n), 1.0 / (n_l + n_n))
    tail_bound = Z_BOUND * math.sqrt(tail_p * (1 - tail_p) * (1 / n_l + 1 / n_n))
    tail_diff = abs(linen.tail - nnx.tail)
    findings.append(
        Finding(
            f"fraction beyond {TAIL_SIGMAS} sigma",
            linen.tail,
            nnx.tail,
            tail_diff,
            tail_bound,
            tail_diff <= tail_bound or not gated,
        )
    )
    return findings
