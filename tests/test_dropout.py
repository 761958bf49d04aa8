"""Dropout in both twins (`migrate.common.dropout`): the same masks from the same keys in Linen
and NNX, masks that follow the row and not the batch it travels in, a gate that holds the
twins and the pipeline under dropout and catches keys that do not advance, and a resumed run
that draws what an uninterrupted one draws."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIG_DIR, run_cli
from flax import nnx

from migrate.checkpoints import checkpoint_io, meta
from migrate.checkpoints.train_state import Spec, TrainState
from migrate.common import dropout, optim, sharding
from migrate.config.loading import load_config
from parity import cli
from parity.decoder import twins
from parity.decoder.data import synthetic_batch

TINY = str(CONFIG_DIR / "llama2-tiny.yml")
RATE = 0.25


def _linen_drop(x, keys, site):
    module = nn.Dropout(RATE, broadcast_dims=dropout.BROADCAST_DIMS)
    drop = lambda row, key: module.apply({}, row, deterministic=False, rng=key)
    return dropout.per_row(drop, x, keys, site)


def _nnx_drop(x, keys, site):
    module = nnx.Dropout(RATE, broadcast_dims=dropout.BROADCAST_DIMS)
    drop = lambda row, key: module(row, deterministic=False, rngs=key)
    return dropout.per_row(drop, x, keys, site)


def test_both_frameworks_draw_one_mask_per_row_from_its_own_key():
    rows, length, width = 8, 5, 64
    x = jnp.ones((rows, length, width))
    keys = dropout.row_keys(jax.random.key(3, impl=dropout.IMPL), rows)
    linen = np.asarray(_linen_drop(x, keys, dropout.SITE_MLP))
    assert linen.tobytes() == np.asarray(_nnx_drop(x, keys, dropout.SITE_MLP)).tobytes()
    # One mask per row, shared by every position (MaxText's broadcast_dims=(-2,)), kept
    # values scaled by 1 / (1 - rate).
    assert (linen == linen[:, :1]).all()
    assert set(np.unique(linen)) == {0.0, np.float32(1 / (1 - RATE))}
    assert abs((linen == 0).mean() - RATE) < 0.1
    # A row's mask is its key's: the same rows in another batch (a microbatch, another order)
    # drop alike; another site or layer draws another mask.
    picked = np.array([5, 2, 7])
    alone = np.asarray(_linen_drop(x[picked], keys[picked], dropout.SITE_MLP))
    assert alone.tobytes() == linen[picked].tobytes()
    other_site = np.asarray(_linen_drop(x, keys, dropout.SITE_LAYER_OUTPUT))
    other_layer = np.asarray(_linen_drop(x, dropout.fold_rows(keys, 1), dropout.SITE_MLP))
    assert (other_site != linen).any() and (other_layer != linen).any()


def test_dropout_keys_are_validated():
    with pytest.raises(ValueError, match=r"dropout_rate=1.0: must be in \[0, 1\)"):
        load_config(TINY, ["dropout_rate=1.0"])
    with pytest.raises(ValueError, match=r"dropout_rate=-0.1"):
        load_config(TINY, ["dropout_rate=-0.1"])
    assert not dropout.active(load_config(TINY, ["dropout_rate=0.1", "enable_dropout=false"]))
    assert dropout.active(load_config(TINY, ["dropout_rate=0.1"]))


def test_a_train_step_draws_from_the_configs_seed():
    """The harness shares one compiled program across seeds (`twins.compute_config`), but not
    where dropout is on: there the seed keys the masks."""
    cfg = load_config(TINY, ["dropout_rate=0.1", "seed=3"])
    assert twins.compute_config(cfg).seed == 3
    assert twins.compute_config(cfg.replace(dropout_rate=0.0)).seed == 0
    keys = [jax.random.key_data(dropout.step_key(cfg.replace(seed=s), 0)) for s in (0, 3)]
    assert (np.asarray(keys[0]) != np.asarray(keys[1])).any()


@pytest.mark.slow
def test_the_gate_holds_the_twins_and_the_pipeline_under_dropout(tmp_path):
    """Both twins bit-exact under dropout (forward, gradients, train steps, every draw of the
    `random` check), the pipelined decoder equal to the reference with the same masks."""
    checks = "forward,grads,pipeline,bubbles,train,random"
    status, report = run_cli(tmp_path, TINY, "dropout_rate=0.1", f"--checks={checks}")
    assert status == cli.EXIT_PASS, [c for c in report["checks"] if not c["passed"]]
    random = next(c for c in report["checks"] if c["name"] == "random")
    assert "decoder: 4 draws, same keys" in random["message"]
    # Not vacuous: dropout moves the logits, and the masks follow the key.
    cfg = load_config(TINY, ["dropout_rate=0.1"])
    mesh = sharding.make_mesh(cfg)
    variables = twins.linen_initial_variables(cfg, mesh)
    batch = synthetic_batch(cfg, mesh)
    dropped = twins.run_linen(cfg, mesh, variables, batch).outputs
    kept = twins.run_linen(cfg.replace(enable_dropout=False), mesh, variables, batch).outputs
    assert np.abs(dropped - kept).max() > 0.1


@pytest.mark.slow
def test_a_resumed_run_draws_what_an_uninterrupted_one_draws(tmp_path):
    """Two steps with dropout against one step, a checkpoint, its restore and one more step:
    the same weights, bit for bit (the optimizer state carries the step count the masks are
    keyed by; the twins' steps are bit-exact to each other: the `train` check)."""
    cfg = load_config(TINY, ["dropout_rate=0.1"])
    mesh = sharding.make_mesh(cfg)
    step, _ = twins.linen_train_fns(cfg, mesh)
    batches = [synthetic_batch(cfg, mesh, step=s) for s in range(2)]

    def first_step() -> TrainState:
        params = twins.fresh_copy(twins.linen_initial_variables(cfg, mesh)["params"])
        params, opt_state, _ = step(params, optim.make_optimizer(cfg).init(params), batches[0])
        return TrainState({"params": params}, opt_state, 1)

    once = first_step()
    assert int(optim.step_count(once.opt_state)) == 1
    checkpoint_io.save(tmp_path / "ckpt", Spec("linen", "pipeline", cfg), once)
    uninterrupted, _, metrics = step(once.params["params"], once.opt_state, batches[1])
    expected = jax.device_get(nn.meta.unbox(uninterrupted))

    # The checkpoint records the keys' seed: a run resumed under a config of another seed
    # takes the checkpoint's (`stored_config`), and so the same masks.
    recorded = meta.read_meta(tmp_path / "ckpt")
    assert recorded[meta.RNG] == {"seed": cfg.seed, "dropout_impl": dropout.IMPL}
    assert meta.stored_config(recorded, cfg.replace(seed=7)).seed == cfg.seed
    resumed = checkpoint_io.restore(tmp_path / "ckpt", Spec("linen", "pipeline", cfg), mesh)
    params, _, resumed_metrics = step(resumed.params["params"], resumed.opt_state, batches[1])
    assert np.asarray(resumed_metrics["loss"]).tobytes() == np.asarray(metrics["loss"]).tobytes()
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b),
        jax.device_get(nn.meta.unbox(params)),
        expected,
    )
    # A step drawn with another count's masks is another step: the count is what keys them.
    fresh = first_step()
    fresh_opt = jax.tree.map(
        lambda x: jnp.zeros_like(x) if x.dtype == jnp.int32 and x.ndim == 0 else x,
        fresh.opt_state,
    )
    _, _, restarted = step(fresh.params["params"], fresh_opt, batches[1])
    assert np.asarray(restarted["loss"]).tobytes() != np.asarray(metrics["loss"]).tobytes()
