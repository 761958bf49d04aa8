"""`parity.analysis.hlo_diff`: programs diffed instruction by instruction, the difference named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from parity.analysis import compare, hlo_diff
from parity.decoder import drilldown
from parity.engine.result import verdict

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True)


def program(fn, *args) -> list[hlo_diff.Instruction]:
    return hlo_diff.parse(lowered_text(fn, *args))


X = jnp.ones((8, 16), jnp.float32)
W = jnp.ones((16, 4), jnp.float32)


def dense(x, w):
    return jnp.tanh(x @ w)


def dense_renamed(x, w):  # the same computation from differently named Python functions
    def inner(a, b):
        return jnp.dot(a, b)

    return jnp.tanh(jax.jit(inner)(x, w))


def test_the_same_computation_is_identical_whatever_the_names():
    found = hlo_diff.diff(program(dense, X, W), program(dense, X, W))
    assert found.identical and "identical" in found.summary("pre")


def test_a_precision_difference_is_named_with_its_source_line():
    highest = lambda x, w: jnp.tanh(jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    found = hlo_diff.diff(program(dense, X, W), program(highest, X, W))
    assert not found.identical and found.kind == "replaced"
    assert found.linen[0].op == "dot" and "operand_precision={highest" in found.nnx[0].canonical
    assert "test_hlo_diff.py:" in found.nnx[0].source


def test_a_dtype_difference_fails():
    in_bf16 = lambda x, w: jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(
        jnp.float32
    )
    found = hlo_diff.diff(program(dense, X, W), program(in_bf16, X, W))
    assert not found.identical
    assert any("bf16" in i.canonical for i in found.nnx)


def test_a_dropped_sharding_constraint_is_reported_as_missing_on_one_side():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = NamedSharding(mesh, PartitionSpec("x"))
    constrained = lambda x, w: jnp.tanh(jax.lax.with_sharding_constraint(x @ w, sharded))
    found = hlo_diff.diff(program(constrained, X, W), program(dense, X, W))
    assert found.kind == "only in Linen"
    assert 'custom_call_target="Sharding"' in found.linen[0].canonical
    assert "test_hlo_diff.py:" in found.linen[0].source


def test_a_changed_remat_policy_fails():
    def loss(policy):
        body = jax.checkpoint(lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2), policy=policy)
        return jax.grad(body, argnums=1)

    saved = program(loss(jax.checkpoint_policies.everything_saveable), X, W)
    nothing = program(loss(jax.checkpoint_policies.nothing_saveable), X, W)
    assert hlo_diff.diff(saved, saved).identical
    assert not hlo_diff.diff(saved, nothing).identical


def test_names_from_the_tracing_context_do_not_count():
    assert hlo_diff.diff(program(dense, X, W), program(dense_renamed, X, W)).kind != "wiring"


def test_grads_name_the_largest_relative_error_then_the_earliest_in_the_data_flow():
    def record(tensor, max_rel):
        return {"tensor": tensor, "max_rel": max_rel, "passed": max_rel == 0}

    records = [
        record("linen-init/grads/params/decoder_norm/scale", 1e-3),
        record("linen-init/grads/params/logits_dense/kernel", 2e-3),
        record("linen-init/grads/params/pipeline/layers/layers_0/mlp/wo/kernel", 2e-3),
        record("linen-init/grads/params/token_embedder/embedding", 0.0),
    ]
    result = verdict("grads", records, compare.EXACT, rank=drilldown.data_flow_rank)
    assert result.where.endswith("mlp/wo/kernel")  # largest; the MLP comes before the head
    assert drilldown.data_flow_rank("x/token_embedder/embedding") < drilldown.data_flow_rank(
        "x/pipeline/layers/layers_0/self_attention/query/kernel"
    )
    assert np.isclose(result.value, 2e-3)


def test_texts_equal_character_for_character_skip_the_parse_with_the_same_verdict():
    def alias(x, w):  # dense under another name: the module's and ops' names differ
        return jnp.tanh(x @ w)

    text, other = lowered_text(dense, X, W), lowered_text(alias, X, W)
    assert text == lowered_text(dense, X, W)
    parsed = hlo_diff.diff(hlo_diff.parse(text), hlo_diff.parse(text))
    assert hlo_diff.diff_texts(text, text) == parsed  # same count, without parsing
    assert parsed.instructions[0] == len(hlo_diff.parse(text)) > 0
    assert hlo_diff.diff_texts(text, other) == hlo_diff.diff(
        hlo_diff.parse(text), hlo_diff.parse(other)
    )
    assert text != other and hlo_diff.diff_texts(text, other).identical  # parsed: names differ
