"""The pipelined Linen decoder equals its non-pipelined twin (PIPELINE.md "The reference")."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import TINY_CONFIGS, tiny

from migrate import schedule
from parity import checks, compare


@functools.cache
def runs(name: str, *overrides: str, bubble_fill: float = 0.0):
    """(pipelined, reference) runs, compiled once per session."""
    return checks.linen_pipeline_runs(tiny(name, *overrides), bubble_fill)


def _assert_equal_within(actual: checks.Run, expected: checks.Run, tol: compare.Tolerance):
    result = checks.compare_runs("pipeline", tiny("llama2-tiny"), actual, expected, tol)
    failing = [r for r in result.details if not r["passed"]]
    assert result.passed, (result.message, failing[:5])
    return result


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_pipeline_equals_reference(name):
    cfg = tiny(name)
    pipelined, reference = runs(name)
    result = _assert_equal_within(pipelined, reference, compare.reshaped_tolerance(cfg))
    # Every gradient leaf is compared, in the reference layout: 9 per layer + 3 outside.
    assert sum(r["tensor"].startswith("grads/") for r in result.details) == 12
    assert result.value <= 1e-5


def test_the_comparison_is_not_vacuous():
    _, reference = runs("llama2-tiny")
    grad_norms = [float(np.linalg.norm(np.asarray(g))) for g in jax.tree.leaves(reference.grads)]
    assert min(grad_norms) > 0


@pytest.mark.parametrize("microbatches", [4, 8, 16])  # M = S, 2S, 4S
def test_microbatch_count_changes_nothing(microbatches):
    overrides = ("per_device_batch_size=4", f"num_pipeline_microbatches={microbatches}")
    pipelined, reference = runs("llama2-tiny", *overrides)
    _assert_equal_within(pipelined, reference, compare.F32_RESHAPED)
    baseline, _ = runs("llama2-tiny", "per_device_batch_size=4", "num_pipeline_microbatches=4")
    _assert_equal_within(pipelined, baseline, compare.F32_RESHAPED)


@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-delay"])
def test_nan_in_the_bubbles_reaches_no_output_or_gradient(name):
    poisoned, _ = runs(name, bubble_fill=float("nan"))
    clean, _ = runs(name)
    # Bit-identical to the zero-filled run: bubble values are masked, never mixed in.
    result = checks.compare_runs("pipeline", tiny(name), poisoned, clean, compare.EXACT)
    assert result.passed, result.message
    assert all(r["nonfinite"] == 0 and r["mismatches"] == 0 for r in result.details)


def test_nan_hook_is_live_when_bubbles_are_not_masked(monkeypatch):
    """Proves the NaN test above can fail: with every slot marked valid, NaN gets through."""
    real_stage_work = schedule.stage_work

    def every_slot_valid(cfg, iteration):
        micro, repeat, valid = real_stage_work(cfg, iteration)
        return micro, repeat, valid | True

    monkeypatch.setattr(schedule, "stage_work", every_slot_valid)
    poisoned, _ = checks.linen_pipeline_runs(tiny("llama2-tiny"), float("nan"))
    # The forward pass overwrites the poisoned outputs, but the weight gradients sum
    # input x upstream-gradient over the idle slots too, and NaN x 0 is NaN.
    assert any(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves(poisoned.grads))


@pytest.mark.parametrize(
    "overrides",
    [
        ("scan_pipeline_iterations=false",),
        ("set_remat_policy_on_pipeline_iterations=false",),
    ],
    ids=lambda o: o[0],
)
def test_loop_and_remat_variants_equal_the_reference(overrides):
    pipelined, reference = runs("llama2-tiny", *overrides)
    _assert_equal_within(pipelined, reference, compare.F32_RESHAPED)
    default, _ = runs("llama2-tiny")
    # Remat and unrolling change the schedule of the computation, not its arithmetic.
    _assert_equal_within(pipelined, default, compare.F32_RESHAPED)
