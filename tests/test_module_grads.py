"""A module pair's gradients with respect to its inputs, and what a check says it left out.

A port can agree on every output and every parameter gradient and still differ in the backward
pass: a residual detached from the graph (earlier layers get no gradient through it), a
parameter-free module with a wrong custom backward. `grads` compares the gradient of every
floating-point input both sides get."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from parity.pairs import Call, Randomness, compare_modules, exit_status

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

X = jax.random.normal(jax.random.key(1), (2, 4))


def failing(results) -> dict[str, str]:
    return {r.name: r.where for r in results if not r.passed}


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(4, name="d")(nn.LayerNorm(name="ln")(x))


class NNXBlock(nnx.Module):
    def __init__(self, detach: bool = False, *, rngs: nnx.Rngs):
        self.ln, self.d, self.detach = (
            nnx.LayerNorm(4, rngs=rngs),
            nnx.Linear(4, 4, rngs=rngs),
            detach,
        )

    def __call__(self, x):
        residual = jax.lax.stop_gradient(x) if self.detach else x
        return residual + self.d(self.ln(x))


def test_a_detached_residual_fails_grads_at_the_input():
    assert exit_status(compare_modules(LinenBlock(), NNXBlock(rngs=nnx.Rngs(0)), (X,))) == 0
    results = compare_modules(LinenBlock(), NNXBlock(True, rngs=nnx.Rngs(0)), (X,))
    # Outputs and every parameter gradient agree: only the input's gradient shows it.
    assert failing(results) == {"grads": "linen-init/input_grads/0"}


@jax.custom_vjp
def straight_through(x):
    return jnp.round(x)


straight_through.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


@jax.custom_vjp
def blocked(x):
    return jnp.round(x)


blocked.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (jnp.zeros_like(g),))


class LinenRound(nn.Module):
    @nn.compact
    def __call__(self, x):
        return straight_through(x)


class NNXRound(nnx.Module):
    def __init__(self, backward=straight_through):
        self.backward = backward

    def __call__(self, x):
        return self.backward(x)


def test_a_parameter_free_module_is_compared_on_its_backward_pass():
    results = compare_modules(LinenRound(), NNXRound(), (3 * X,))
    grads = next(r for r in results if r.name == "grads")
    assert grads.status == "passed" and grads.where.endswith("input_grads/0")
    assert failing(compare_modules(LinenRound(), NNXRound(blocked), (3 * X,))) == {
        "grads": "linen-init/input_grads/0"
    }


def test_integer_inputs_have_no_gradient_and_are_skipped():
    tokens = jnp.arange(6).reshape(2, 3) % 5
    linen, port = nn.Embed(5, 4), nnx.Embed(5, 4, rngs=nnx.Rngs(0))
    grads = next(r for r in compare_modules(linen, port, (tokens,)) if r.name == "grads")
    assert grads.passed
    assert not any("input_grads" in d["tensor"] for d in grads.details)


class LinenDrop(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x)
        return nn.Dropout(0.5, deterministic=not train, name="drop")(h)


class NNXDrop(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.bn, self.drop = nnx.BatchNorm(4, momentum=0.9, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(x))


def test_a_call_compared_in_distribution_only_is_named_in_the_notes():
    """Each side's own keys: the train call's statistics are not compared, and the report says
    so in every check that ran the calls."""
    train = Call(
        (X,),
        linen={"train": True},
        nnx_attributes={"deterministic": False, "use_running_average": False},
        randomness=Randomness(draws=16),
        name="train",
    )
    evaluate = Call(
        (X,),
        linen={"train": False},
        nnx_attributes={"deterministic": True, "use_running_average": True},
        name="eval",
    )
    results = compare_modules(LinenDrop(), NNXDrop(rngs=nnx.Rngs(0)), [train, evaluate])
    assert exit_status(results) == 0
    for result in results:
        if result.name in ("forward", "grads", "sharding"):
            assert "not run: train (own keys, see `random`" in result.message, result.message


class LinenSign(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(4, name="d")(x)
        return y, jnp.sign(y)


class NNXSign(nnx.Module):
    def __init__(self, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.d, self.dtype = nnx.Linear(4, 4, rngs=rngs), dtype

    def __call__(self, x):
        y = self.d(x)
        return y, jnp.sign(y).astype(self.dtype)


def test_an_output_in_another_dtype_fails_forward_though_its_values_agree():
    assert exit_status(compare_modules(LinenSign(), NNXSign(rngs=nnx.Rngs(0)), (X,))) == 0
    port = NNXSign(jnp.bfloat16, rngs=nnx.Rngs(0))  # -1, 0, 1: exact in bfloat16
    (forward,) = compare_modules(LinenSign(), port, (X,), checks=["forward"], drill_down=False)
    assert (forward.passed, forward.where) == (False, "linen-init/outputs/1")
    record = next(d for d in forward.details if not d["passed"])
    assert record["note"] == "dtype: Linen float32 vs NNX bfloat16"


class LinenLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        # A trip count read from the input: no reverse mode through it, for the input.
        y = jax.lax.while_loop(
            lambda c: c[1] < x[0, 0] + 2, lambda c: (c[0] * 0.5, c[1] + 1), (x, 0.0)
        )
        return nn.Dense(4, name="d")(y[0] + 1.0)


class NNXLoop(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.d = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        y = jax.lax.while_loop(
            lambda c: c[1] < x[0, 0] + 2, lambda c: (c[0] * 0.5, c[1] + 1), (x, 0.0)
        )
        return self.d(y[0] + 1.0)


def test_inputs_without_a_gradient_leave_the_parameters_compared_and_say_why():
    results = compare_modules(LinenLoop(), NNXLoop(rngs=nnx.Rngs(0)), (X,))
    assert exit_status(results) == 0, [(r.name, r.message) for r in results]
    grads = next(r for r in results if r.name == "grads")
    assert [d["tensor"] for d in grads.details][:2] == [
        "linen-init/grads/d/bias",
        "linen-init/grads/d/kernel",
    ]
    assert "the inputs' gradients not compared (" in grads.message
