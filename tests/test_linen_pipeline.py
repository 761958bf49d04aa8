"""The pipelined Linen decoder equals its non-pipelined twin (docs/pipeline.md, "Numerics"), in the
schedule variants no shipped config runs. Every shipped config's pipeline against its reference,
every gradient leaf, both sides: the `pipeline` check of the config matrix (tests/test_cli.py)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import tiny

from migrate.common import schedule
from parity.analysis import compare
from parity.decoder import twins
from parity.decoder.session import DecoderPair
from parity.engine.numeric import run_records
from parity.engine.side import Run


@functools.cache
def session(name: str, *overrides: str, bubble_fill: float = 0.0) -> DecoderPair:
    return DecoderPair(tiny(name, *overrides), bubble_fill)


def pipelined_and_reference(name: str, *overrides: str, bubble_fill: float = 0.0):
    s = session(name, *overrides, bubble_fill=bubble_fill)
    return s.pipelined_run("linen"), s.reference_run("linen")


def assert_runs_match(actual: Run, expected: Run, tol: compare.Tolerance) -> list[dict]:
    records = run_records("", actual, expected, tol)
    failing = [r for r in records if not r["passed"]]
    assert not failing, failing[:5]
    return records


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [4, 8, 16])  # M = S, 2S, 4S
def test_microbatch_count_changes_nothing(microbatches):
    overrides = ("per_device_batch_size=4", f"num_pipeline_microbatches={microbatches}")
    pipelined, reference = pipelined_and_reference("llama2-tiny", *overrides)
    assert_runs_match(pipelined, reference, compare.F32_RESHAPED)
    baseline, _ = pipelined_and_reference(
        "llama2-tiny", "per_device_batch_size=4", "num_pipeline_microbatches=4"
    )
    assert_runs_match(pipelined, baseline, compare.F32_RESHAPED)


@pytest.mark.slow
def test_nan_hook_is_live_when_bubbles_are_not_masked(monkeypatch):
    """Proves the NaN-bubble test (the `bubbles` check, run on every shipped config by
    tests/test_cli.py) can fail: with every slot marked valid, NaN gets through."""
    real_stage_work = schedule.stage_work

    def every_slot_valid(cfg, iteration):
        micro, repeat, _ = real_stage_work(cfg, iteration)
        return micro, repeat, micro >= 0

    monkeypatch.setattr(schedule, "stage_work", every_slot_valid)
    s = session("llama2-tiny")
    # A fresh jit (not the cached, masked executable) traces the patched schedule.
    step = twins._linen_step.__wrapped__(s.cfg, s.mesh, None)
    _, grads = step(s.linen_variables["params"], s.train_batch, twins.fill_value(float("nan")))
    # The forward pass overwrites the poisoned outputs, but the weight gradients sum
    # input x upstream-gradient over the idle slots too, and NaN x 0 is NaN.
    assert any(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves(grads))


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("scan_pipeline_iterations=false", "num_pipeline_microbatches=4"),  # 11 iterations
        ("set_remat_policy_on_pipeline_iterations=false",),
    ],
    ids=lambda o: o[0],
)
def test_loop_and_remat_variants_equal_the_reference(overrides):
    pipelined, reference = pipelined_and_reference("llama2-tiny", *overrides)
    assert_runs_match(pipelined, reference, compare.F32_RESHAPED)
    same_microbatches = [o for o in overrides if o.startswith("num_pipeline_microbatches")]
    default, _ = pipelined_and_reference("llama2-tiny", *same_microbatches)
    # Remat and unrolling change the schedule of the computation, not its arithmetic.
    assert_runs_match(pipelined, default, compare.F32_RESHAPED)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        # unrolled blocks; M = 4 keeps the window moving (3 blocks) in 15 iterations, not 27
        ("scan_pipeline_iterations=false", "num_pipeline_microbatches=4"),
        ("pipeline_delay_activation_forwarding=true",),  # d = 2: stages lag 2s iterations
    ],
    ids=["unrolled", "delay"],
)
def test_ag_per_repeat_equals_gathering_per_iteration(overrides):
    """`pipeline_fsdp_ag_per_repeat` (R = 3, the window moves) against the reference and the
    per-iteration mode on the same weights: the same values reach the same matmuls."""
    per_repeat, reference = pipelined_and_reference("llama2-tiny-agrepeat", *overrides)
    assert_runs_match(per_repeat, reference, compare.F32_RESHAPED)
    if "scan_pipeline_iterations=false" in overrides:
        return  # unrolled: the reference alone (a second unrolled pipeline costs ~25 s)
    per_iteration, _ = pipelined_and_reference(
        "llama2-tiny-agrepeat", *overrides, "pipeline_fsdp_ag_per_repeat=false"
    )
    assert_runs_match(per_repeat, per_iteration, compare.F32_RESHAPED)
