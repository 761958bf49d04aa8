"""The statistics behind the `init` check: what they separate, and no false alarms."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from parity.analysis import initstats

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

N = (8, 64, 32)  # 16,384 elements: the size of the tiny configs' kernels


def truncated(rng, size, std=1.0):
    """variance_scaling's truncated normal: cut at 2 sigma, rescaled to the target std."""
    draw = scipy_stats.truncnorm.rvs(-2, 2, size=size, random_state=rng)
    return draw * std / 0.87962566103423978


def failing(a, b, stacked=()):
    found = initstats.compare(initstats.Stats.of(a, stacked), initstats.Stats.of(b, stacked))
    return {f.statistic for f in found if not f.passed}


@pytest.mark.parametrize("seed", range(40))
def test_same_distribution_never_fails(seed):
    rng = np.random.default_rng(seed)
    for draw in (
        lambda: truncated(rng, N, 0.02),
        lambda: rng.normal(0, 1, N),
        lambda: rng.uniform(-1, 1, N),
    ):
        assert failing(draw(), draw(), (0,)) == set()


def test_a_one_and_a_half_times_wider_init_fails_on_the_std():
    rng = np.random.default_rng(0)
    assert "log std ratio" in failing(truncated(rng, N, 0.02), truncated(rng, N, 0.03))


@pytest.mark.parametrize(
    ("other", "statistic"),
    [
        (lambda rng: rng.normal(0, 0.02, N), "kurtosis"),
        (lambda rng: rng.normal(0, 0.02, N), "fraction beyond 2.5 sigma"),
        (lambda rng: rng.uniform(-1, 1, N) * 0.02 * np.sqrt(3), "kurtosis"),
    ],
    ids=["normal-kurtosis", "normal-tail", "uniform"],
)
def test_a_swapped_family_with_the_same_std_fails(other, statistic):
    rng = np.random.default_rng(1)
    reference = truncated(rng, N, 0.02)
    sample = other(rng)
    assert abs(sample.std() / reference.std() - 1) < 0.03  # the scale alone cannot tell
    assert statistic in failing(reference, sample)


def test_constants_must_be_the_same_constant():
    assert failing(np.ones(64), np.ones(64)) == set()
    assert "constant value" in failing(np.ones(64), np.zeros(64))
    assert "constant value" in failing(np.ones(64), np.random.default_rng(0).normal(1, 0.1, 64))


def test_a_key_reused_along_the_stacked_axis_fails():
    rng = np.random.default_rng(2)
    distinct = truncated(rng, N, 0.02)
    copies = np.broadcast_to(truncated(rng, N[1:], 0.02), N)
    assert failing(distinct, copies, stacked=(0,)) == {"distinct stacked slices"}
    assert initstats.Stats.of(copies, (0,)).distinct_slices == 1


def test_stacked_dims_come_from_the_logical_names():
    assert initstats.stacked_dims(("circular_repeats", "layers", "embed", "mlp")) == (0, 1)
    assert initstats.stacked_dims(("embed", "mlp")) == ()
    assert initstats.stacked_dims(None) == ()
