"""Gradient accumulation (`migrate.common.accumulation`, MaxText's
`gradient_accumulation_steps`): MaxText's split of a step's rows, the average over the
accumulated batches against one pass over all of them, and the `train` verdict that holds the
twins' accumulating step to one step on the whole batch (`DecoderPair.accumulation_records`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIG_DIR, run_cli

from migrate.common import accumulation
from parity import cli
from parity.analysis import compare
from parity.decoder import twins
from parity.decoder.session import MOE_ACCUMULATION_NOTE, DecoderPair, with_accumulation
from parity.engine.result import CheckResult, keyed_records

TINY = str(CONFIG_DIR / "llama2-tiny.yml")


def test_row_r_goes_to_accumulation_step_r_mod_k():
    rows = jnp.arange(12 * 2).reshape(12, 2)
    parts = accumulation.split_batch({"inputs": rows}, 3)["inputs"]
    assert parts.shape == (3, 4, 2)
    for r in range(12):
        np.testing.assert_array_equal(parts[r % 3, r // 3], rows[r])


def mean_squared_error(params, batch):
    """A two-layer model's loss, with the `(loss, (outputs, aux))` the twins' loss returns."""
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    outputs = hidden @ params["w2"]
    loss = jnp.mean((outputs - batch["y"]) ** 2)
    return loss, (outputs, jnp.mean(hidden))


def problem(seed: int = 0) -> tuple[dict, dict]:
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {"w1": jax.random.normal(keys[0], (5, 7)), "w2": jax.random.normal(keys[1], (7, 3))}
    batch = {"x": jax.random.normal(keys[2], (24, 5)), "y": jax.random.normal(keys[3], (24, 3))}
    return params, batch


@pytest.mark.parametrize("steps", [2, 3, 8])
def test_the_average_over_k_batches_is_one_pass_over_all_of_them(steps):
    params, batch = problem()
    (loss, (_, aux)), grads = jax.value_and_grad(mean_squared_error, has_aux=True)(params, batch)
    accumulated = jax.jit(accumulation.value_and_grad(mean_squared_error, steps))
    (acc_loss, (outputs, acc_aux)), acc_grads = accumulated(params, batch)
    assert outputs is None  # no step returns its outputs
    tol = compare.F32_RESHAPED
    records = keyed_records("accumulated", (acc_loss, acc_aux, acc_grads), (loss, aux, grads), tol)
    assert records and all(r["passed"] for r in records), records


def test_one_step_is_jax_value_and_grad_unchanged():
    params, batch = problem()
    one = accumulation.value_and_grad(mean_squared_error, 1)
    plain = jax.value_and_grad(mean_squared_error, has_aux=True)
    program = lambda fn: jax.jit(fn).lower(params, batch).as_text()
    assert program(one) == program(plain)


def test_an_accumulation_that_drops_a_batch_fails_the_reshaped_tier():
    """The tier the `train` check holds accumulation to tells a real accumulation bug from
    rounding: the gradients of three of four batches are orders of magnitude outside it."""
    params, batch = problem()
    _, grads = jax.value_and_grad(mean_squared_error, has_aux=True)(params, batch)

    def three_of_four(params, batch):
        parts = accumulation.split_batch(batch, 4)
        loss_grad = jax.grad(lambda p, b: mean_squared_error(p, b)[0])
        per_batch = [loss_grad(params, jax.tree.map(lambda x, i=i: x[i], parts)) for i in range(3)]
        return jax.tree.map(lambda *g: sum(g) / 4, *per_batch)

    records = keyed_records("dropped", three_of_four(params, batch), grads, compare.F32_RESHAPED)
    assert not any(r["passed"] for r in records)
    assert min(r["max_rel"] for r in records) > 100 * compare.F32_RESHAPED.max_rel


def passing_train() -> CheckResult:
    return CheckResult("train", True, "max_rel", 0.0, 0.0, "step 0/loss", message="bit-exact")


def test_failing_accumulation_records_fail_the_train_verdict_and_say_where():
    tol = compare.F32_RESHAPED
    good = {"tensor": "accumulation/loss", "passed": True, "max_rel": 1e-7}
    bad = {"tensor": "accumulation/opt_state/mu/w", "passed": False, "max_rel": 0.3}
    passed = with_accumulation(passing_train(), [good], tol)
    assert passed.passed and passed.status == "passed" and passed.value == 0.0
    assert "gradients match one step on the whole batch (max_rel 1e-07" in passed.message
    failed = with_accumulation(passing_train(), [good, bad], tol)
    assert not failed.passed and failed.status == "failed"
    assert failed.where == "accumulation/opt_state/mu/w"
    assert "differ from one step on the whole batch (max_rel 0.3" in failed.message
    assert failed.details[-2:] == (good, bad)
    twins_failed = CheckResult("train", False, "max_rel", 1.0, 0.0, "step 0/params/w")
    assert with_accumulation(twins_failed, [bad], tol).where == "step 0/params/w"
    assert with_accumulation(passing_train(), [], tol) == passing_train()


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.slow
@pytest.mark.compat  # a scan over Linen's boxes and NNX's Param state: each stack's Flax
def test_the_twins_accumulating_steps_are_bit_exact_and_match_one_step_on_the_whole_batch(
    tmp_path,
):
    status, report = run_cli(
        tmp_path, TINY, "gradient_accumulation_steps=2", "--checks=train,program", "--steps=2"
    )
    assert status == cli.EXIT_PASS, report
    train = check(report, "train")
    assert "accumulated gradients match one step on the whole batch" in train["message"]
    oracle = [d for d in train["details"] if d["tensor"].startswith("accumulation: 2 batches")]
    tensors = {d["tensor"].split("step 0/")[1].split("/")[0] for d in oracle}
    assert tensors == {"loss", "grad_norm", "opt_state"}
    assert all(d["passed"] for d in oracle)
    moments = [d["tensor"] for d in oracle if "/opt_state/" in d["tensor"]]
    assert not any("/nu/" in t for t in moments)
    parameters = [d for d in train["details"] if d["tensor"].startswith("step 0/params/")]
    first_moments = [t for t in moments if "/mu/" in t]
    assert len(first_moments) == len(parameters) > 0  # every parameter's gradient
    twins = [d for d in train["details"] if d["tensor"].startswith("step ")]
    assert twins and all(d["max_rel"] == 0.0 for d in twins)  # the twins: bit-exact
    assert report["run"]["resolved_config"]["derived"]["train_batch_size"] == 32


def summed_not_averaged(monkeypatch) -> None:
    """The bug both twins share when they share the helper: the accumulated loss and
    gradients summed over the k batches, never divided by k."""
    original = accumulation.value_and_grad

    def value_and_grad(loss_fn, steps):
        accumulated = original(loss_fn, steps)

        def summed(params, batch, dropout_keys=None):
            (loss, (outputs, aux)), grads = accumulated(params, batch, dropout_keys)
            return (loss * steps, (outputs, aux)), jax.tree.map(lambda g: g * steps, grads)

        return summed

    monkeypatch.setattr(accumulation, "value_and_grad", value_and_grad)


@pytest.fixture
def fresh_train_steps():
    """Both twins' cached train steps forgotten around the test (`parity.decoder.twins` caches
    them per config): the injected bug must be traced, and must not leak into later tests."""
    twins.clear_nnx_caches()
    twins._linen_train_fns.cache_clear()
    yield
    twins.clear_nnx_caches()
    twins._linen_train_fns.cache_clear()


@pytest.mark.slow
def test_an_accumulation_bug_both_twins_share_fails_train_at_the_oracle(
    tmp_path, monkeypatch, fresh_train_steps
):
    """Twins agreeing is not the step being right: a wrong accumulation in both passes every
    twin comparison, and fails against one step on the whole batch."""
    summed_not_averaged(monkeypatch)
    args = (TINY, "gradient_accumulation_steps=2", "--checks=train", "--steps=1")
    status, report = run_cli(tmp_path, *args)
    assert status == cli.EXIT_FAIL
    train = check(report, "train")
    assert train["worst"]["where"].startswith("accumulation: 2 batches vs one of 32 rows")
    assert "differ from one step on the whole batch" in train["message"]
    twins = [d for d in train["details"] if d["tensor"].startswith("step ")]
    assert twins and all(d["passed"] for d in twins)


def test_with_experts_the_train_verdict_says_why_accumulation_is_not_compared():
    """No run: the pair's `train` as the run loop prepares it, on a stand-in check function."""
    from conftest import tiny

    from parity.engine import registry

    pair = DecoderPair.__new__(DecoderPair)  # the config is all `prepared` reads
    pair.cfg, pair._weights_label = tiny("mixtral-tiny", "gradient_accumulation_steps=2"), None
    train = registry.get("train")
    prepared = pair.prepared(train, lambda pair, *args, **kwargs: passing_train())
    result = prepared(pair)
    assert result.passed and result.message == f"bit-exact; {MOE_ACCUMULATION_NOTE}"
