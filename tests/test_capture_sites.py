"""Submodule outputs captured on one side only (`layers`, `random`): a stack written with Linen
`nn.scan` and NNX `nnx.scan` (NNX captures inside its scan, Linen's `capture_intermediates`
records nothing there) passes, the one-sided sites noted on the side that captured them; a real
difference still fails: a bug inside the stack, a module one side calls more often, a dropped
parameter-free submodule."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from parity.engine.randomness import one_sided
from parity.pairs import Call, Randomness, compare_modules, format_report

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

L, D = 3, 4
X = jax.random.normal(jax.random.key(1), (8, D))
NOT_COMPARED = "captured on the NNX side only: not compared"


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.tanh(nn.Dense(D, name="dense")(x)), None


class LinenStack(nn.Module):
    """`L` scanned layers, then a dropout when `rate` is given."""

    rate: float | None = None

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
        )
        x = scan(name="layers")(x, None)[0]
        drop = nn.Dropout(self.rate or 0.0, deterministic=False, name="drop")
        return x if self.rate is None else drop(x)


class NNXLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, act=jnp.tanh):
        self.dense, self.act = nnx.Linear(D, D, rngs=rngs), act

    def __call__(self, x):
        return x + self.act(self.dense(x))


class NNXStack(nnx.Module):
    """The port; `act` is each layer's activation (`jnp.sin`: a seeded bug)."""

    def __init__(self, rngs: nnx.Rngs, rate: float | None = None, act=jnp.tanh):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXLayer(rngs, act)

        self.layers = make(rngs)
        self.drop = None if rate is None else nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        scan = nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        x = scan(x, self.layers)
        return x if self.drop is None else self.drop(x)


def notes(result) -> dict[str, str]:
    return {r["tensor"]: r["note"] for r in result.details if "note" in r}


def test_the_scanned_stack_passes_layers_with_the_nnx_sites_noted():
    results = compare_modules(LinenStack(), NNXStack(nnx.Rngs(0)), (X,), checks=["layers"])
    assert results[0].passed, format_report(results)
    assert notes(results[0]) == {"layers/dense": NOT_COMPARED, "layers": NOT_COMPARED}
    assert results[0].where == "output"  # a site not compared is never the one named


def test_the_scanned_stack_then_dropout_passes_random_and_names_the_side():
    call = Call((X,), randomness=Randomness(draws=64), name="train")
    results = compare_modules(
        LinenStack(rate=0.5), NNXStack(nnx.Rngs(0), rate=0.5), [call], checks=["random"]
    )
    assert results[0].passed, format_report(results)
    record = next(r for r in results[0].details if r["tensor"] == "train/layers/dense")
    assert (record["linen"], record["nnx"], record["note"]) == ("missing", "captured", NOT_COMPARED)
    assert "(2 captured on one side only, not compared)" in results[0].message


def test_a_bug_inside_the_scanned_stack_still_fails():
    port = NNXStack(nnx.Rngs(0), act=jnp.sin)
    results = compare_modules(LinenStack(), port, (X,), checks=["forward", "layers"])
    assert {r.name: r.where for r in results if not r.passed} == {
        "forward": "linen-init/outputs",
        "layers": "output",
    }, format_report(results)


@pytest.mark.parametrize(
    "site,linen,nnx,expected",
    [
        ("a/b", {"a/b"}, {"a"}, (False, "captured on the Linen side only: not compared")),
        ("a/b", {"a"}, {"a/b"}, (False, NOT_COMPARED)),
        ("up/1", {"up"}, {"up", "up/1"}, (True, "captured on the NNX side only (the other ")),
        ("up", {"up/1"}, {"up"}, (True, "captured on the NNX side only (the other ")),
    ],
)
def test_one_sided_names_the_side_and_keeps_another_call_a_difference(site, linen, nnx, expected):
    differs, note = one_sided(site, linen, nnx)
    assert (differs, note[: len(expected[1])]) == expected


class LinenTwice(nn.Module):
    """Calls `dense` a second time on the same input (the port calls it once)."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(D, name="dense")
        dense(x)
        return dense(x)


class NNXOnce(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def test_a_module_called_more_often_on_one_side_fails_layers():
    """The same outputs; the site of the second call is Linen's alone, but NNX captured
    another call of that very module: a difference."""
    results = compare_modules(
        LinenTwice(), NNXOnce(nnx.Rngs(0)), (X,), checks=["forward", "layers"]
    )
    assert [r.passed for r in results] == [True, False], format_report(results)
    assert results[1].where == "dense/1"
    assert notes(results[1])["dense/1"].startswith("captured on the Linen side only (the other")


class LinenTwoDropouts(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.5, deterministic=False, name="drop_in")(x)
        h = nn.Dense(D, name="dense")(h)
        return nn.Dropout(0.5, deterministic=False, name="drop_out")(h)


class NNXOneDropout(nnx.Module):
    """Drops `drop_in`, a parameter-free submodule: its site is Linen's alone."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(D, D, rngs=rngs)
        self.drop_out = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop_out(self.dense(x))


def test_a_dropped_parameter_free_submodule_fails_random_downstream():
    call = Call((X,), randomness=Randomness(draws=64), name="train")
    results = compare_modules(
        LinenTwoDropouts(), NNXOneDropout(nnx.Rngs(0)), [call], checks=["random"]
    )
    assert not results[0].passed, format_report(results)
    assert results[0].where.startswith("train/dense: "), results[0].where
