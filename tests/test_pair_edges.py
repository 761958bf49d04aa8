"""Edges of `compare_modules`' `renames` and `collections`: nested renames resolved by the
longest prefix in either dict order, the suggested renames computed from the modules' own
paths, and two collections refused for one NNX Variable type."""

from __future__ import annotations

import ast

import flax.linen as nn
import jax.numpy as jnp
import pytest
from flax import nnx

from parity.module_pair import renames as renames_lib
from parity.pairs import PairArgumentError, compare_modules, format_report

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

X = jnp.ones((4, 3))
FAST = ["roundtrip", "forward"]
NESTED = {("block",): ("layers",), ("block", "attn"): ("layers", "attention")}


class LinenInner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="attn")(nn.Dense(4, name="mlp")(x))


class LinenOuter(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LinenInner(name="block")(nn.Dense(4, name="a")(x))


class NNXInner(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mlp = nnx.Linear(4, 4, rngs=rngs)
        self.attention = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.attention(self.mlp(x))


class NNXOuter(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.layers = NNXInner(rngs)

    def __call__(self, x):
        return self.layers(self.a(x))


def compare(renames=None, checks=FAST, **kwargs):
    return compare_modules(
        LinenOuter(), NNXOuter(nnx.Rngs(0)), (X,), renames=renames, checks=checks, **kwargs
    )


def failing(results) -> set[str]:
    return {r.name for r in results if not r.passed}


@pytest.mark.parametrize("order", [1, -1], ids=["outer_first", "inner_first"])
def test_nested_renames_pass_in_either_dict_order(order):
    renames = dict(list(NESTED.items())[::order])
    results = compare(renames)
    assert not failing(results), format_report(results)


def test_the_longest_prefix_wins_both_ways():
    renames = dict(NESTED)
    assert renames_lib.to_nnx(("block", "attn", "kernel"), renames) == (
        "layers",
        "attention",
        "kernel",
    )
    assert renames_lib.to_nnx(("block", "mlp", "kernel"), renames) == ("layers", "mlp", "kernel")
    assert renames_lib.to_linen(("layers", "attention", "bias"), renames) == (
        "block",
        "attn",
        "bias",
    )
    assert renames_lib.to_linen(("layers", "mlp", "bias"), renames) == ("block", "mlp", "bias")


def test_a_wrong_nested_rename_fails_and_names_the_path():
    wrong = {("block",): ("layers",), ("block", "attn"): ("layers", "attn_x")}
    results = compare(wrong)
    assert failing(results) == {"roundtrip", "forward"}
    assert "layers/attn_x/kernel: missing on the NNX side" in results[0].message
    assert "layers/attention/kernel: missing on the Linen side" in results[0].message


def test_the_suggested_renames_applied_pass():
    partial = compare({("block",): ("layers",)}, checks=["roundtrip"])
    first = partial[0].message.splitlines()[0]
    assert not partial[0].passed and "try renames=" in first, first
    suggested = ast.literal_eval(first.split("try renames=", 1)[1])
    assert suggested == NESTED
    results = compare(suggested)
    assert not failing(results), format_report(results)


def test_two_linen_prefixes_to_one_nnx_prefix_are_refused():
    with pytest.raises(PairArgumentError, match=r"both \('a',\) and \('block',\)"):
        compare({("a",): ("layers",), ("block",): ("layers",)})


class LinenStats(nn.Module):
    @nn.compact
    def __call__(self, x):
        ema = self.variable("stats", "ema", jnp.zeros, (3,))
        ema.value = 0.9 * ema.value + 0.1 * x.mean(0)
        return nn.Dense(2, name="d")(x)


class EMA(nnx.BatchStat):
    pass


class NNXStats(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, stat: type = EMA):
        self.ema = stat(jnp.zeros((3,)))
        self.d = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        self.ema[...] = 0.9 * self.ema[...] + 0.1 * x.mean(0)
        return self.d(x)


def test_a_collection_sharing_a_default_type_is_refused():
    port = NNXStats(nnx.Rngs(0), stat=nnx.BatchStat)
    with pytest.raises(PairArgumentError) as raised:
        compare_modules(LinenStats(), port, (X,), collections={"stats": nnx.BatchStat})
    message = str(raised.value)
    assert "the default 'batch_stats' and 'stats' to nnx.BatchStat" in message
    assert "override the default instead" in message


def test_two_new_collections_sharing_a_type_are_refused():
    with pytest.raises(PairArgumentError, match="both 'stats' and 'more' to EMA"):
        compare_modules(
            LinenStats(), NNXStats(nnx.Rngs(0)), (X,), collections={"stats": EMA, "more": EMA}
        )


def test_a_collection_with_its_own_variable_subclass_is_compared():
    results = compare_modules(
        LinenStats(), NNXStats(nnx.Rngs(0)), (X,), collections={"stats": EMA}, checks=FAST
    )
    assert not failing(results), format_report(results)
    assert "linen-init/state/stats/ema" in {d["tensor"] for d in results[1].details}


class LinenBoxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        return x * self.param("scale", init, (3,))


class NNXBoxed(nnx.Module):
    """A port that kept the Linen box: its Param holds a `LogicallyPartitioned`, no array."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        self.scale = nnx.Param(init(rngs.params(), (3,)))

    def __call__(self, x):
        return x * self.scale[...]


def test_a_variable_holding_a_linen_box_is_refused_before_any_check():
    """A setup mistake (exit 2, what to write instead), not an error of the harness (exit 4)."""
    with pytest.raises(PairArgumentError, match="scale holds a Linen LogicallyPartitioned box"):
        compare_modules(LinenBoxed(), NNXBoxed(nnx.Rngs(0)), (X,))
