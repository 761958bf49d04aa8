"""What `compare_modules` says of a failed pair, tried as a user migrating their own model
would: the drill-down's first divergence on the verdicts, a layer left stochastic, sites one
side alone captured (and the renames that pair them), a layer the port never calls, inputs the
NNX module was not built for, a tolerance given as numbers, and a weight conversion of their
own, strictly checked."""

from __future__ import annotations

import ast
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from migrate.errors import BadInput
from parity.pairs import Conversion, PairArgumentError, compare_modules, exit_status

X = jax.random.normal(jax.random.key(1), (4, 8))


class LinenMLP(nn.Module):
    """Dense, LayerNorm, Dropout, Dense: the shapes of a first port."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8, name="fc1")(x)
        x = nn.relu(nn.LayerNorm(name="ln")(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4, name="fc2")(x)


class NNXMLP(nnx.Module):
    def __init__(self, width: int = 8, *, rngs: nnx.Rngs, deterministic: bool | None = True):
        self.fc1 = nnx.Linear(width, 8, rngs=rngs)
        self.ln = nnx.LayerNorm(8, rngs=rngs)
        # nnx.Dropout's own default is training mode: `None` leaves it there
        extra = {} if deterministic is None else {"deterministic": deterministic}
        self.drop = nnx.Dropout(0.5, rngs=rngs, **extra)
        self.fc2 = nnx.Linear(8, 4, rngs=rngs)

    def hidden(self, x):
        return self.fc1(x)

    def __call__(self, x):
        x = nnx.relu(self.ln(self.hidden(x)))
        return self.fc2(self.drop(x))


class TransposedKernel(NNXMLP):
    def hidden(self, x):
        return x @ self.fc1.kernel[...].T + self.fc1.bias[...]


class NeverCallsFc1(NNXMLP):
    def hidden(self, x):
        return x  # the port skips fc1 (its weights are there): the shapes still fit


RENAMED = {("Dropout_0",): ("drop",)}


def port(cls=NNXMLP, **kwargs) -> NNXMLP:
    return cls(rngs=nnx.Rngs(0), **kwargs)


def by_name(results):
    return {r.name: r for r in results}


def test_a_dropout_left_in_training_mode_is_named_with_its_fix():
    results = by_name(compare_modules(LinenMLP(), port(deterministic=None), (X,)))
    forward = results["forward"]
    assert not forward.passed and exit_status(list(results.values())) == 1
    assert forward.message.startswith(
        "hint: the NNX side drew random numbers (1 draw(s)) in a call Linen ran deterministically"
    )
    assert "Call(x, nnx_attributes={'deterministic': True})" in forward.message
    # Linen's Dropout_0 and the port's `drop` were not compared: the divergence may start there
    assert (
        f"or before it at Dropout_0 (NNX drop), captured under other names and not compared: "
        f"rerun with renames={RENAMED!r}" in forward.message
    )
    assert results["grads"].message.startswith("cause: see forward")
    assert results["layers"].message.startswith(
        "captured on one side only: Linen Dropout_0 (4, 8); NNX drop (4, 8); "
        f"try renames={RENAMED!r}"
    )


def test_the_renamed_deterministic_port_passes_with_nothing_one_sided():
    results = compare_modules(LinenMLP(), port(), (X,), renames=RENAMED)
    assert all(r.passed for r in results), [r.message for r in results]
    assert "layers" not in {r.name for r in results}  # drilled down only after a failure


def test_a_transposed_kernel_is_named_where_it_is_not_where_the_error_is_largest():
    results = by_name(compare_modules(LinenMLP(), port(TransposedKernel), (X,), renames=RENAMED))
    assert results["layers"].where == "fc1"
    assert results["forward"].message.startswith("first divergence (layers drill-down): fc1;")
    assert results["grads"].where != "linen-init/grads/fc1/kernel"  # the largest is downstream


def test_a_layer_the_port_holds_but_never_calls_is_blamed():
    results = by_name(
        compare_modules(LinenMLP(), port(NeverCallsFc1), (X,), checks=["forward"], renames=RENAMED)
    )
    layers = results["layers"]
    assert layers.where == "fc1"
    (record,) = [d for d in layers.details if d["tensor"] == "fc1"]
    assert record["note"] == "called by Linen only: the NNX port holds its weights, never calls it"
    assert "Linen fc1 (4, 8) (a difference: called by Linen only" in layers.message


def test_inputs_wider_than_the_nnx_module_was_built_for_are_bad_input():
    with pytest.raises(PairArgumentError) as raised:
        compare_modules(LinenMLP(), port(width=6), (X,), checks=["forward"])
    assert isinstance(raised.value, BadInput)
    assert str(raised.value) == (
        "the inputs do not fit the NNX module as built: Linen sized fc1/kernel (8, 8) from them "
        "(inputs (4, 8)), the NNX module holds (6, 8): build the NNX module for these inputs, "
        "or pass inputs of the sizes it was built for"
    )


class WideOutput(NNXMLP):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.fc2 = nnx.Linear(8, 8, rngs=rngs)  # the port's bug: Linen's fc2 has 4 features


def test_a_port_with_other_output_features_stays_a_parity_failure():
    results = compare_modules(LinenMLP(), port(WideOutput), (X,), checks=["roundtrip"])
    assert exit_status(results) == 1
    assert "fc2/kernel: shape differs: Linen (8, 4) vs NNX (8, 8)" in results[0].message


# ------------------------------------------------------------------ tolerances as numbers


class ExactGelu(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(8, name="fc")(x), approximate=False)


class TanhGelu(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.fc(x), approximate=True)


def test_a_tolerance_is_a_number_or_a_relative_and_absolute_pair():
    exact = compare_modules(ExactGelu(), port(TanhGelu), (X,), checks=["forward"], drill_down=False)
    error = max(exact[0].details, key=lambda d: d["max_rel"])
    assert not exact[0].passed and 0 < error["max_rel"] < 1e-2
    (loose,) = compare_modules(
        ExactGelu(), port(TanhGelu), (X,), checks=["forward"], tolerance=1e-2
    )
    assert loose.passed and loose.message == "given: max_rel 0.01"
    absolute = (error["max_rel"] / 2, error["max_abs"])  # within the absolute bound only
    (either,) = compare_modules(
        ExactGelu(), port(TanhGelu), (X,), checks=["forward"], tolerance=absolute
    )
    assert either.passed
    too_tight = (error["max_rel"] / 2, error["max_abs"] / 2)
    (neither,) = compare_modules(
        ExactGelu(), port(TanhGelu), (X,), checks=["forward"], tolerance=too_tight, drill_down=False
    )
    assert not neither.passed


# ------------------------------------------------------------------ a conversion of your own


class LinenQKV(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(8, name=n)(x) for n in ("query", "key", "value"))
        return jax.nn.softmax(q @ k.T / 4.0) @ v


class FusedQKV(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(8, 24, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        return jax.nn.softmax(q @ k.T / 4.0) @ v


NAMES = ("query", "key", "value")


def fuse(variables):
    params = variables["params"]
    return {
        "qkv": {
            leaf: jnp.concatenate([params[n][leaf] for n in NAMES], axis=-1)
            for leaf in ("kernel", "bias")
        }
    }


def split(state):
    kernels, biases = (jnp.split(state["qkv"][leaf], 3, axis=-1) for leaf in ("kernel", "bias"))
    return {
        "params": {
            n: {"kernel": k, "bias": b} for n, k, b in zip(NAMES, kernels, biases, strict=True)
        }
    }


FUSED = Conversion(to_nnx=fuse, to_linen=split)
# One [8, 24] dot against three [8, 8] dots: the same math, summed in another order.
FUSED_TOLERANCE = (1e-6, 1e-6)


@pytest.mark.compat  # the oldest stack's layer (README, Stacks): its NNX state as plain dicts
def test_a_fused_qkv_port_passes_through_the_conversion_both_ways():
    results = compare_modules(
        LinenQKV(), port(FusedQKV), (X,), conversion=FUSED, tolerance=FUSED_TOLERANCE
    )
    assert all(r.passed for r in results), [(r.name, r.message) for r in results]
    roundtrip = {d["tensor"] for d in results[0].details}
    assert "linen-init/linen->nnx->linen/query/kernel" in roundtrip
    grads = {d["tensor"] for d in results[2].details}
    assert {"linen-init/grads/key/kernel", "nnx-init/grads/value/bias"} <= grads


def test_rounding_alone_is_said_with_the_tolerance_it_needs():
    """The fused port is the same math summed in another order: a hint says so and gives the
    tolerance its measured errors need; passed back, the pair passes."""
    checks = ["forward", "grads"]
    exact = compare_modules(LinenQKV(), port(FusedQKV), (X,), conversion=FUSED, checks=checks)
    forward = exact[0]
    assert not forward.passed
    hint = re.search(
        r"hint: every difference is rounding .* pass tolerance=(\(.*?\));", forward.message
    )
    assert hint, forward.message
    suggested = ast.literal_eval(hint.group(1))
    assert 0 < suggested[0] <= 1e-6 and 0 < suggested[1] <= 1e-6
    results = compare_modules(
        LinenQKV(), port(FusedQKV), (X,), conversion=FUSED, checks=checks, tolerance=suggested
    )
    assert all(r.passed for r in results), [r.message for r in results]
    wrong = compare_modules(LinenMLP(), port(TransposedKernel), (X,), renames=RENAMED)
    assert "rounding" not in wrong[1].message  # a real bug gets no such hint


def test_a_conversion_is_checked_strictly_both_ways():
    dropped = Conversion(lambda v: {"qkv": {"kernel": fuse(v)["qkv"]["kernel"]}}, split)
    (roundtrip,) = compare_modules(
        LinenQKV(), port(FusedQKV), (X,), conversion=dropped, checks=["roundtrip"]
    )
    assert not roundtrip.passed
    assert "qkv/bias: missing (expected float32[24])" in roundtrip.message

    def half_precision(state):
        variables = split(state)
        query = variables["params"]["query"]
        query["kernel"] = query["kernel"].astype(jnp.bfloat16)
        return variables

    (roundtrip,) = compare_modules(
        LinenQKV(),
        port(FusedQKV),
        (X,),
        conversion=Conversion(fuse, half_precision),
        checks=["roundtrip"],
    )
    assert "NNX -> Linen (conversion hook): 1 problem(s)" in roundtrip.message
    assert "query/kernel: got bfloat16[8, 8], expected float32[8, 8]" in roundtrip.message
    transposed = Conversion(
        fuse, lambda s: split({"qkv": {**s["qkv"], "kernel": s["qkv"]["kernel"].T}})
    )
    (raised,) = compare_modules(
        LinenQKV(), port(FusedQKV), (X,), conversion=transposed, checks=["roundtrip"]
    )
    assert raised.status == "bad_input"  # the user's function raised: exit 2, not a port bug
    assert raised.message.startswith("conversion.to_linen raised ValueError: array split")
    with pytest.raises(
        PairArgumentError, match=r"conversion is .*expected parity\.pairs\.Conversion"
    ):
        compare_modules(LinenQKV(), port(FusedQKV), (X,), conversion=(fuse, split))
