"""Leaf comparison, tolerance tiers, the NaN policy and vacuity."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import tiny

from migrate.config import rules
from parity.analysis import compare
from parity.engine.numeric import run_records
from parity.engine.pair import lm_vacuity_problems
from parity.engine.result import verdict
from parity.engine.side import Run

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


def test_identical_leaves_have_zero_error():
    a = np.linspace(-1, 1, 10, dtype=np.float32)
    (diff,) = compare.compare_trees({"w": a}, {"w": a.copy()})
    assert (diff.path, diff.max_abs, diff.max_rel, diff.mismatches) == ("w", 0.0, 0.0, 0)
    assert diff.passes(compare.EXACT)


def test_relative_error_is_measured_against_the_reference_scale():
    expected = np.array([4.0, 1e-9], np.float32)
    actual = expected + np.array([0.0, 1e-6], np.float32)
    diff = compare.leaf_diff("w", actual, expected)
    assert diff.max_rel == pytest.approx(1e-6 / 4.0, rel=1e-3)  # not 1e-6 / 1e-9
    assert diff.ulp_at_scale == pytest.approx(diff.max_rel / np.finfo(np.float32).eps)
    assert diff.mismatches == 1
    assert not diff.passes(compare.EXACT) and diff.passes(compare.F32_RESHAPED)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_on_either_side_always_fails(bad):
    clean = np.ones(3, np.float32)
    poisoned = np.array([1.0, bad, 1.0], np.float32)
    loose = compare.Tolerance(math.inf, "anything goes")
    assert not compare.leaf_diff("w", poisoned, clean).passes(loose)
    assert not compare.leaf_diff("w", clean, poisoned).passes(loose)
    assert not compare.leaf_diff("w", poisoned, poisoned).passes(loose)


def test_structure_and_shape_mismatches_raise():
    with pytest.raises(ValueError, match="tree structures differ"):
        compare.compare_trees({"a": np.ones(2)}, {"b": np.ones(2)})
    with pytest.raises(ValueError, match=r"w: shapes differ: \(2,\) vs \(3,\)"):
        compare.leaf_diff("w", np.ones(2), np.ones(3))


def test_twins_are_held_to_zero_difference_in_every_dtype_and_precision():
    cfg = tiny("llama2-tiny")
    for dtype, weight_dtype, precision in itertools.product(
        rules.DTYPES, rules.DTYPES, rules.MATMUL_PRECISIONS
    ):
        variant = cfg.replace(dtype=dtype, weight_dtype=weight_dtype, matmul_precision=precision)
        assert compare.twin_tolerance(variant) is compare.EXACT


def test_pipeline_tier_follows_the_dtypes():
    cfg = tiny("llama2-tiny")
    assert compare.reshaped_tolerance(cfg) is compare.F32_RESHAPED
    assert compare.reshaped_tolerance(cfg.replace(matmul_precision="default")) is (
        compare.F32_RESHAPED
    )
    for dtypes in ({"dtype": "bfloat16"}, {"weight_dtype": "bfloat16"}):
        assert compare.reshaped_tolerance(cfg.replace(**dtypes)) is compare.BF16_RESHAPED
    assert compare.EXACT.max_rel < compare.F32_RESHAPED.max_rel < compare.BF16_RESHAPED.max_rel


def test_dead_models_are_refused_even_when_they_agree():
    vocab = 256
    dead = Run(
        loss=np.float32(math.log(vocab)),
        outputs=np.zeros((2, 3, vocab), np.float32),
        grads={"w": np.zeros((4,), np.float32)},
    )
    problems = lm_vacuity_problems(dead, vocab)
    assert len(problems) == 3
    assert "gradient norm is 0.0" in problems[0]
    assert "logits are all zero" in problems[1]
    assert "sits at ln(vocab)" in problems[2]
    records = run_records("", dead, dead, compare.EXACT)
    assert all(r["passed"] for r in records)  # they agree perfectly...
    result = verdict("forward", records, compare.EXACT, problems)
    assert not result.passed  # ...and still fail
