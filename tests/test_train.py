"""The twins' train steps: shardings declared by the logical names and pinned, in and out."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import tiny

from migrate.common import optim, sharding
from migrate.linen import train as linen_train
from migrate.nnx import train as nnx_train
from parity.decoder import twins
from parity.decoder.data import synthetic_batch
from parity.decoder.session import DecoderPair
from parity.engine.pair import Pair
from parity.engine.side import Side, Trainer

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


@functools.cache
def session(name: str) -> DecoderPair:
    return DecoderPair(tiny(name))


def _specs(shardings) -> list[str]:
    return [str(s.spec) for s in jax.tree.leaves(shardings)]


def test_declared_shardings_follow_the_names_and_moments_follow_their_parameters():
    cfg = tiny("llama2-tiny-tp")
    mesh = sharding.abstract_mesh(cfg)
    tx = optim.make_optimizer(cfg)
    linen_abstract = twins.linen_abstract_variables(cfg, mesh)["params"]
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

    _, nnx_abstract = twins.nnx_abstract(cfg, mesh)
    nnx_params, nnx_opt_state = nnx_train.train_state_shardings(nnx_abstract, mesh, cfg, tx)
    assert _specs(nnx_params) == _specs(params)
    assert _specs(nnx_opt_state) == _specs(opt_state)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_pinned_train_step_keeps_the_declared_shardings_step_after_step(framework):
    """Under stage x tensor, XLA would hand the norm scales back sharded over `tensor`; the
    pinned step returns exactly the declared shardings, so any number of steps runs."""
    s = session("llama2-tiny-tp")
    if framework == "linen":
        step, _ = twins.linen_train_fns(s.cfg, s.mesh)
        declared = twins.linen_train_shardings(s.cfg, s.mesh)
    else:
        step, _ = twins.nnx_train_fns(s.cfg, s.mesh)
        declared = twins.nnx_train_shardings(s.cfg, s.mesh)
    trainer = s.side(framework).trainer(s.weights(framework, "linen"))
    params, opt_state = trainer.params, trainer.opt_state  # copies: the step donates them
    for i in range(3):
        params, opt_state, metrics = step(params, opt_state, synthetic_batch(s.cfg, s.mesh, i))
        for array, expected in zip(
            jax.tree.leaves((params, opt_state)), jax.tree.leaves(declared), strict=True
        ):
            assert array.sharding.is_equivalent_to(expected, array.ndim)
    assert float(metrics["grad_norm"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_train_step_donates_the_state_and_the_session_keeps_its_weights(framework):
    """Parameters and optimizer state go into the step and its outputs take their buffers
    (aliased as much as the state weighs); the pair's own weights, which every other check
    reads, are never the ones donated."""
    s = session("llama2-tiny-tp")
    trainer = s.side(framework).trainer(s.weights(framework, "linen"))
    params, opt_state, step = trainer.params, trainer.opt_state, trainer.step
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
    for weights in (s.linen_variables, s.weights(framework, "linen")):
        assert not any(x.is_deleted() for x in jax.tree.leaves(weights))
    again = s.side(framework).trainer(s.weights(framework, "linen"))  # a fresh copy each time
    assert not any(x.is_deleted() for x in jax.tree.leaves((again.params, again.opt_state)))


@pytest.mark.slow
def test_an_evaluation_that_consumes_the_weights_fails_train_there_not_the_run(monkeypatch):
    """The train check reads the weights back after evaluating them: an evaluation that
    consumed (donated) them fails `train` there, naming them, and nothing is stepped; the run
    does not crash on the deleted arrays."""
    from parity.decoder import sides
    from parity.engine import numeric

    own_trainer = sides.NNXDecoderSide.trainer

    def consuming_trainer(self, weights):
        trainer = own_trainer(self, weights)  # a copy of the pair's weights: those stay

        def evaluate(params, batch):
            loss = jax.block_until_ready(trainer.evaluate(params, batch))
            for array in jax.tree.leaves(params):
                array.delete()
            return loss

        return dataclasses.replace(trainer, evaluate=evaluate)

    monkeypatch.setattr(sides.NNXDecoderSide, "trainer", consuming_trainer)
    result = numeric.train(session("llama2-tiny-tp"), steps=2)
    assert not result.passed and result.where.startswith("eval-before/nnx-params/")
    consumed = [r for r in result.details if not r["passed"]]
    assert len(consumed) == len(jax.tree.leaves(session("llama2-tiny-tp").nnx_params))
    assert all(r["tensor"].startswith("eval-before/nnx-params/") for r in consumed)
    assert all("consumed" in r["note"] for r in consumed)
    assert not result.steps  # nothing left to step
    assert not any(r["tensor"].startswith("eval-after") for r in result.details)


@pytest.fixture
def traced_once(monkeypatch):
    """Both twins' train and eval steps built afresh under `chex.assert_max_traces(n=1)`: a
    second trace of either (a retrace across steps) raises. The twins' cached functions are
    forgotten before and after, so that no other test runs the guarded ones."""
    import chex

    def guarded(make):
        return lambda *args: chex.assert_max_traces(make(*args), n=1)

    for module in (linen_train, nnx_train):
        monkeypatch.setattr(module, "make_train_step", guarded(module.make_train_step))
        monkeypatch.setattr(module, "make_eval_step", guarded(module.make_eval_step))

    def forget():
        twins._linen_train_fns.cache_clear()
        twins.clear_nnx_caches()

    forget()
    try:
        yield
    finally:
        forget()
        chex.clear_trace_counter()


@pytest.mark.slow
def test_train_steps_trace_once_for_every_step_both_evaluations_and_the_compile_check(
    traced_once,
):
    """The train check's N steps and its evaluations before and after them, then the compile
    check's abstract lowering of the same step: one trace of each twin's train and eval step
    (the compile check lowers the step the train check ran, and compiles it once more only
    where that one was a persistent-cache read)."""
    from parity.decoder import checks as decoder_checks
    from parity.engine import numeric

    pair = DecoderPair(tiny("llama2-tiny"))
    trained = numeric.train(pair, steps=3)
    compiled = decoder_checks.compile_cost(pair)
    assert trained.passed and compiled.passed, (trained.where, compiled.where)
    assert len(trained.steps) == 3


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_the_init_key_made_inside_the_program_is_the_key_made_eagerly(impl):
    """Both twins make their PRNG key inside the init program from a uint32 seed (an eager key
    is a program of its own): the weights of every seed in the config's range (0..2^32-1) must
    stay those of `jax.random.key(seed)`, or checkpoints and seeds would change meaning."""
    traced = jax.jit(lambda seed: jax.random.key_data(jax.random.key(seed, impl=impl)))
    for seed in (0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1):
        eager = jax.random.key_data(jax.random.key(seed, impl=impl))
        assert np.array_equal(traced(np.uint32(seed)), eager), seed


class _Step:
    """A host train step that leaves `w` in `dtype` (its values exact in either dtype)."""

    returned_mismatches: tuple = ()  # no shardings on the host: nothing returned misplaced

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    def __call__(self, params, opt_state, batch):
        w = (np.asarray(params["w"], np.float32) - 0.5).astype(self.dtype)
        loss = np.float32(np.abs(w.astype(np.float32)).sum())
        count = opt_state["count"] + np.int32(1)
        return {"w": w}, {"count": count}, {"loss": loss, "grad_norm": np.float32(1.0)}


class _HostSide(Side):
    """Weights as host arrays, the common form itself; `step_dtype`: the dtype its step leaves
    the weight in."""

    def __init__(self, framework: str, step_dtype) -> None:
        self.framework, self.step_dtype = framework, step_dtype

    def own_weights(self):
        return {"params": {"w": np.array([2.0, 2.5, 3.0, 3.5], np.float32)}}

    def to_common(self, weights):
        return weights

    def from_common(self, variables):
        return variables

    def plain(self, tree):
        return tree

    def run(self, weights):
        raise NotImplementedError

    def lowered(self, weights):
        raise NotImplementedError

    def program_shardings(self, compiled):
        return {}

    def trainer(self, weights):
        evaluate = lambda params, batch: np.float32(np.asarray(params["w"], np.float32).sum())
        return Trainer(weights["params"], {"count": np.int32(0)}, _Step(self.step_dtype), evaluate)


class _HostPair(Pair):
    def batch(self, step: int = 0, split: str = "train"):
        return None


@pytest.mark.parametrize("nnx_dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_step_that_leaves_a_parameter_in_another_dtype_fails_train(nnx_dtype):
    """The NNX step leaves its weight in bfloat16 with the very values Linen's float32 holds:
    `train` compares dtypes, as `forward` does (the next step computes in that dtype), and
    names the parameter and both dtypes; the same step in float32 passes."""
    from parity.analysis import compare
    from parity.engine import numeric

    pair = _HostPair(_HostSide("linen", np.float32), _HostSide("nnx", nnx_dtype), compare.EXACT)
    result = numeric.train(pair, steps=2)
    if nnx_dtype is np.float32:
        assert result.passed, result.message
        return
    assert not result.passed and result.where == "step 0/params/w", result.where
    failed = [r for r in result.details if not r["passed"]]
    assert failed[0]["note"] == "dtype: Linen float32 vs NNX bfloat16"
    assert [s["passed"] for s in result.steps] == [False, False]
