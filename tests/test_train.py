"""The twins' train steps: shardings declared by the logical names and pinned, in and out."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import pytest
from conftest import tiny

from migrate import optim, sharding
from migrate.linen import train as linen_train
from migrate.nnx import train as nnx_train
from parity import checks, runs
from parity.data import synthetic_batch


@functools.cache
def session(name: str) -> checks.Session:
    return checks.Session(tiny(name))


def _specs(shardings) -> list[str]:
    return [str(s.spec) for s in jax.tree.leaves(shardings)]


def test_declared_shardings_follow_the_names_and_moments_follow_their_parameters():
    cfg = tiny("llama2-tiny-tp")
    mesh = sharding.abstract_mesh(cfg)
    tx = optim.make_optimizer(cfg)
    linen_abstract = runs.linen_abstract_variables(cfg, mesh)["params"]
    params, opt_state = linen_train.train_state_shardings(linen_abstract, mesh, cfg, tx)
    boxes = jax.tree.leaves(
        linen_abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    assert _specs(params) == [
        str(sharding.logical_to_spec(box.names, cfg.logical_axis_rules)) for box in boxes
    ]
    adam = opt_state[1][0]
    assert _specs(adam.mu) == _specs(params) and _specs(adam.nu) == _specs(params)
    assert str(adam.count.spec) == "P()"  # step counts are replicated
    assert "P(None, 'stage', None)" in _specs(params)  # stage norms: not sharded over tensor

    _, nnx_abstract = runs.nnx_abstract(cfg, mesh)
    nnx_params, nnx_opt_state = nnx_train.train_state_shardings(nnx_abstract, mesh, cfg, tx)
    assert _specs(nnx_params) == _specs(params)
    assert _specs(nnx_opt_state) == _specs(opt_state)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_pinned_train_step_keeps_the_declared_shardings_step_after_step(framework):
    """Under stage x tensor, XLA would hand the norm scales back sharded over `tensor`; the
    pinned step returns exactly the declared shardings, so any number of steps runs."""
    s = session("llama2-tiny-tp")
    if framework == "linen":
        step, _ = runs.linen_train_fns(s.cfg, s.mesh)
        declared = runs.linen_train_shardings(s.cfg, s.mesh)
    else:
        step, _ = runs.nnx_train_fns(s.cfg, s.mesh)
        declared = runs.nnx_train_shardings(s.cfg, s.mesh)
    params, opt_state, _, _ = s.train_start(framework)  # copies: the step donates them
    for i in range(3):
        params, opt_state, metrics = step(params, opt_state, synthetic_batch(s.cfg, s.mesh, i))
        for array, expected in zip(
            jax.tree.leaves((params, opt_state)), jax.tree.leaves(declared), strict=True
        ):
            assert array.sharding.is_equivalent_to(expected, array.ndim)
    assert float(metrics["grad_norm"]) > 0


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_train_step_donates_the_state_and_the_session_keeps_its_weights(framework):
    """Parameters and optimizer state go into the step and its outputs take their buffers
    (aliased as much as the state weighs); the session's own weights, which every other check
    reads, are never the ones donated."""
    s = session("llama2-tiny-tp")
    params, opt_state, step, _ = s.train_start(framework)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    per_device_state = sum(
        shard.data.nbytes
        for x in jax.tree.leaves((params, opt_state))
        for shard in x.addressable_shards
        if shard.device == jax.devices()[0]
    )
    assert step.memory_analysis().alias_size_in_bytes == per_device_state > 0
    new_params, new_opt_state, _ = step(params, opt_state, synthetic_batch(s.cfg, s.mesh))
    assert all(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    assert not any(x.is_deleted() for x in jax.tree.leaves((new_params, new_opt_state)))
    assert sum(x.nbytes for x in jax.tree.leaves((new_params, new_opt_state))) == state_bytes
    assert not any(x.is_deleted() for x in jax.tree.leaves(s.linen_variables))
    again, _, _, _ = s.train_start(framework)  # a fresh copy each time
    assert not any(x.is_deleted() for x in jax.tree.leaves(again))
