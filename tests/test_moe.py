"""Mixture-of-experts layers (mixtral-tiny): routing ties, the load-balancing loss's accounting
in the pipeline (summed over layers, averaged over microbatches, bubbles never counted), and
the loss the optimizer sees."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIG_DIR, tiny

from migrate import cli as migrate_cli
from migrate.common import moe
from migrate.config.contract import ConfigError
from parity.decoder.session import BUBBLE_POISON, DecoderPair
from parity.engine import run_loop

pytestmark = pytest.mark.slow


@functools.cache
def tied_pair() -> DecoderPair:
    """mixtral-tiny with every router kernel zero: every expert ties for every token."""
    pair = DecoderPair(tiny("mixtral-tiny"))
    variables = pair.weights("linen", "linen")
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0 if "gate" in jax.tree_util.keystr(path) else x, variables
    )
    pair.use_weights("linen", zeroed)
    return pair


def test_load_balance_loss_is_switch_form():
    """`E * sum_e f_e * p_e` per sequence, averaged over sequences; uniform routing gives k."""
    probs = jnp.full((3, 5, 4), 0.25)
    routed = jnp.zeros((3, 5, 4)).at[..., :2].set(1.0)  # k=2: experts 0 and 1 for every token
    assert float(moe.load_balance_loss(probs, routed)) == 2.0
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (3, 5, 4)), axis=-1)
    routed = jax.nn.one_hot(jnp.argmax(probs, -1), 4)
    expected = np.mean([4 * np.sum(routed[b].mean(0) * probs[b].mean(0)) for b in range(3)])
    np.testing.assert_allclose(float(moe.load_balance_loss(probs, routed)), expected, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_route_picks_what_top_k_picks_ties_included(k):
    """`moe.route` = `jax.lax.top_k`'s experts (ties to the lower index), renormalised."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (2, 7, 5)), axis=-1)
    tied = jnp.full((2, 7, 5), 0.2).at[0, 0].set(jnp.array([0.1, 0.3, 0.3, 0.1, 0.2]))
    for p in (probs, tied):
        combine, routed = moe.route(p, k)
        values, experts = jax.lax.top_k(p, k)
        expected = jnp.sum(jax.nn.one_hot(experts, 5), axis=-2)
        np.testing.assert_array_equal(routed, expected)
        weights = jnp.sum(jax.nn.one_hot(experts, 5) * values[..., None], axis=-2)
        np.testing.assert_allclose(combine, weights / values.sum(-1, keepdims=True), rtol=1e-6)


def test_routing_ties_are_bit_exact_between_linen_and_nnx():
    """A zero router: softmax is uniform, top_k breaks every tie the same way on both sides."""
    pair = tied_pair()
    linen, nnx = pair.run("linen", "linen"), pair.run("nnx", "linen")
    assert float(linen.loss) == float(nnx.loss)
    np.testing.assert_array_equal(linen.outputs, nnx.outputs)
    np.testing.assert_array_equal(linen.aux_loss, nnx.aux_loss)
    for a, b in zip(jax.tree.leaves(linen.grads), jax.tree.leaves(nnx.grads), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(linen.grad_norm) > 0
    # Given weights (as --checkpoint's): run once, named as given, not as an initialisation.
    forward = run_loop.call(pair, "forward")
    assert forward.passed and {d["tensor"].split("/")[0] for d in forward.details} == {"given"}
    assert run_loop.call(pair, "init").status == "skipped"


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_aux_loss_sums_layers_averages_microbatches_never_counts_bubbles(framework):
    """Tied routing makes every layer's loss exactly k (ties go to experts 0..k-1 with mean
    probability 1/E), so the decoder's is exactly N*k: in the reference, in the pipeline and in
    the pipeline whose buffers hold NaN. A bubble slot computes on zeros, where the zero router
    also gives k per layer: counting the (S-1)*d*S bubble slots would add to it."""
    pair = tied_pair()
    cfg = pair.cfg
    expected = cfg.base_num_decoder_layers * cfg.num_experts_per_tok
    bubble_slots = (
        cfg.num_stages * cfg.num_iterations
        - cfg.num_microbatches * cfg.num_repeats * cfg.num_stages
    )
    assert bubble_slots > 0  # the config has bubbles to count
    pipelined = pair.run(framework, "linen")
    reference = pair.reference_run(framework)
    poisoned = pair.filled_run(framework, BUBBLE_POISON)
    for run in (pipelined, reference, poisoned):
        assert float(run.aux_loss) == expected
    assert math.isfinite(float(poisoned.loss)) and float(poisoned.loss) == float(pipelined.loss)


def test_the_optimizer_sees_the_weighted_aux_loss():
    """The train step's loss is cross entropy + load_balance_loss_weight x aux; with weight 0 the
    aux loss is reported but adds nothing."""
    pair = DecoderPair(tiny("mixtral-tiny"))
    weighted = pair.run("linen", "linen")
    unweighted = DecoderPair(tiny("mixtral-tiny", "load_balance_loss_weight=0")).run(
        "linen", "linen"
    )
    assert float(weighted.aux_loss) == float(unweighted.aux_loss) > 0
    np.testing.assert_allclose(
        float(weighted.loss) - float(unweighted.loss),
        pair.cfg.load_balance_loss_weight * float(weighted.aux_loss),
        rtol=1e-4,
    )
    # The router's gradient carries the aux term too.
    gate = lambda run: np.concatenate(
        [
            np.ravel(x)
            for path, x in jax.tree_util.tree_leaves_with_path(run.grads)
            if "gate" in jax.tree_util.keystr(path)
        ]
    )
    assert not np.array_equal(gate(weighted), gate(unweighted))


def test_the_expert_axis_splits_the_batch_and_the_config_says_so():
    """Outside the MoE blocks the expert axis splits the batch (MaxText's layout): every
    microbatch must split over data x fsdp x expert, checked before anything is allocated."""
    with pytest.raises(ConfigError, match="each microbatch must split over data x fsdp x expert"):
        tiny("mixtral-tiny", "num_pipeline_microbatches=8")  # microbatches of 2 rows, 4 shards
    with pytest.raises(ConfigError, match="the experts must split evenly over the expert axis"):
        tiny("mixtral-tiny", "num_experts=3", "num_experts_per_tok=1")


def test_checkpoints_convert_and_restage_the_expert_weights(tmp_path, capsys):
    """`migrate init`/`convert` on mixtral-tiny: Linen -> NNX verified bit for bit, re-staged
    (R=2 L=1 -> R=1 L=2) and to the reference layout, the expert kernels stacked with the layer
    axes throughout."""
    config = f"--config={CONFIG_DIR / 'mixtral-tiny.yml'}"

    def migrate(*args: str) -> int:
        argv = migrate_cli.FLAGS(["migrate", *args])
        try:
            return migrate_cli.run(argv)
        finally:
            migrate_cli.FLAGS.unparse_flags()

    linen, nnx, restaged, ref = (tmp_path / n for n in ("linen", "nnx", "s", "ref"))
    assert migrate("init", config, "--framework=linen", str(linen)) == migrate_cli.EXIT_OK
    args = ("convert", config, "--from=linen", "--to=nnx", "--verify", str(linen), str(nnx))
    assert migrate(*args) == migrate_cli.EXIT_OK, capsys.readouterr().err
    assert "checked before writing: bit-exact" in capsys.readouterr().out
    overrides = ("num_pipeline_repeats=1", "num_layers_per_pipeline_stage=2")
    args = ("convert", config, "--from=nnx", "--to=nnx", str(nnx), str(restaged), *overrides)
    assert migrate(*args) == migrate_cli.EXIT_OK, capsys.readouterr().err
    assert "nnx, pipeline S=2 R=1 L=2" in capsys.readouterr().out
    args = ("convert", config, "--from=nnx", "--to=linen", "--layout=reference")
    assert migrate(*args, "--verify", str(restaged), str(ref)) == migrate_cli.EXIT_OK
    assert "linen, reference N=4" in capsys.readouterr().out
