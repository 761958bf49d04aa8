"""Converters: lossless both ways, no copies, strict about everything that does not fit."""

from __future__ import annotations

import copy
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, tiny
from flax import nnx

from migrate.checkpoints import convert
from parity.decoder import twins
from parity.decoder.session import DecoderPair
from parity.engine import numeric

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


@functools.cache
def session(name: str) -> DecoderPair:
    return DecoderPair(tiny(name))


def host_snapshot(tree):
    """A deep host copy (values, structure, box names) to compare against later."""
    return copy.deepcopy(jax.device_get(tree))


def assert_same_tree(a, b):
    a_leaves, a_def = jax.tree.flatten(a, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    b_leaves, b_def = jax.tree.flatten(b, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert a_def == b_def
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if isinstance(x, nn.LogicallyPartitioned):
            assert x.names == y.names
            x, y = x.value, y.value
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_roundtrip_check_is_bit_exact_for_every_config(name):
    result = numeric.roundtrip(session(name))
    assert result.passed, [r for r in result.details if not r["passed"]]
    assert result.value == 0.0
    assert all(r["mismatches"] == 0 for r in result.details)
    # Both directions, both weight sources, and the layout round trip.
    prefixes = {r["tensor"].split("/")[0] + "/" + r["tensor"].split("/")[1] for r in result.details}
    assert prefixes == {
        f"{s}-init/{d}"
        for s in ("linen", "nnx")
        for d in ("linen->nnx->linen", "nnx->linen->nnx", "pipeline->reference->pipeline")
    }


@pytest.mark.slow
def test_framework_conversion_moves_arrays_without_copies():
    s = session("llama2-tiny")
    linen_vars = s.weights("linen", "linen")
    state = twins.linen_to_nnx_params(s.cfg, s.mesh, linen_vars)
    back = convert.nnx_to_linen(state)
    same = jax.tree.map(lambda a, b: a is b, nn.meta.unbox(back), nn.meta.unbox(linen_vars))
    assert all(jax.tree.leaves(same))
    # And the NNX side holds the very arrays of the Linen boxes.
    linen_arrays = {id(x) for x in jax.tree.leaves(nn.meta.unbox(linen_vars))}
    assert {id(x) for x in jax.tree.leaves(nnx.to_pure_dict(state))} == linen_arrays


@pytest.mark.slow
def test_nnx_to_linen_restores_boxes_with_out_sharding_names():
    s = session("llama2-tiny-scan")
    back = convert.nnx_to_linen(s.nnx_params)
    query = back["params"]["pipeline"]["layers"]["layers"]["self_attention"]["query"]["kernel"]
    assert isinstance(query, nn.LogicallyPartitioned)
    assert query.names == (
        "circular_repeats",
        "layers",
        "layers_per_stage",
        "embed",
        "q_heads",
        "kv",
    )


@pytest.mark.slow
def test_inputs_are_unchanged_by_every_conversion():
    s = session("llama2-tiny")
    linen_vars = s.linen_variables
    nnx_params = s.nnx_params
    _, abstract = twins.nnx_abstract(s.cfg, s.mesh)
    before_linen = host_snapshot(linen_vars)
    before_nnx = host_snapshot(nnx.to_pure_dict(nnx_params))
    before_names = jax.tree.map(
        lambda v: convert.nnx_names(v), nnx_params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    before_abstract = jax.tree.map(
        lambda v: (v.get_value(), convert.nnx_names(v)),
        abstract,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )

    state = convert.linen_to_nnx(linen_vars, abstract)
    convert.nnx_to_linen(nnx_params, target=linen_vars)
    host = jax.device_get(linen_vars)
    convert.linen_reference_to_pipeline(convert.linen_pipeline_to_reference(host, s.cfg), s.cfg)
    convert.nnx_reference_to_pipeline(convert.nnx_pipeline_to_reference(state, s.cfg), s.cfg)
    convert.restore_boxes(*convert.strip_boxes(linen_vars))

    assert_same_tree(linen_vars, before_linen)
    assert_same_tree(nnx.to_pure_dict(nnx_params), before_nnx)
    assert (
        jax.tree.map(
            lambda v: convert.nnx_names(v),
            nnx_params,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        == before_names
    )
    assert (
        jax.tree.map(
            lambda v: (v.get_value(), convert.nnx_names(v)),
            abstract,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        == before_abstract
    )


@pytest.mark.slow
def test_nnx_layout_round_trip_is_bit_exact():
    s = session("llama2-tiny-scan")
    reference = convert.nnx_pipeline_to_reference(s.nnx_params, s.cfg)
    query = reference["layers"]["self_attention"]["query"]["kernel"]
    assert query.get_value().shape == (16, 64, 4, 16)
    assert convert.nnx_names(query) == ("layers", "embed", "q_heads", "kv")
    back = convert.nnx_reference_to_pipeline(reference, s.cfg)
    assert_same_tree(nnx.to_pure_dict(back), jax.device_get(nnx.to_pure_dict(s.nnx_params)))


@pytest.mark.slow
def test_subset_layout_round_trip_puts_the_remainder_after_the_pipelined_rows():
    """llama2-tiny-subset: reference rows 0..7 are the pipeline's stages (placement formula),
    rows 8..9 the `layers_after_pipeline` stack, in order; and back, bit-exact."""
    s = session("llama2-tiny-subset")
    reference = convert.nnx_pipeline_to_reference(s.nnx_params, s.cfg)
    wo = reference["layers"]["mlp"]["wo"]["kernel"]
    assert wo.get_value().shape == (10, 128, 64)
    assert convert.nnx_names(wo) == ("layers", "mlp", "embed")
    after = s.nnx_params["layers_after_pipeline"]["layers"]["mlp"]["wo"]["kernel"]
    assert convert.nnx_names(after) == ("layers_after_pipeline", "mlp", "embed")
    np.testing.assert_array_equal(np.asarray(wo.get_value()[8:]), np.asarray(after.get_value()))
    stages = s.nnx_params["pipeline"]["layers"]["layers_0"]["mlp"]["wo"]["kernel"].get_value()
    np.testing.assert_array_equal(np.asarray(wo.get_value()[5]), np.asarray(stages[1, 1]))
    back = convert.nnx_reference_to_pipeline(reference, s.cfg)
    assert_same_tree(nnx.to_pure_dict(back), jax.device_get(nnx.to_pure_dict(s.nnx_params)))


# ------------------------------------------------------------------ strictness


def _params(linen_vars):
    """A mutable deep copy of the params dict structure (leaves shared, not copied)."""
    return jax.tree.map(
        lambda x: x,
        dict(linen_vars["params"]),
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


def _abstract():
    s = session("llama2-tiny")
    return s, twins.nnx_abstract(s.cfg, s.mesh)[1]


def _problems(variables, abstract) -> list[str]:
    with pytest.raises(convert.ConversionError) as raised:
        convert.linen_to_nnx(variables, abstract)
    assert f"{len(raised.value.problems)} problem(s)" in str(raised.value)
    for problem in raised.value.problems:
        assert problem in str(raised.value)
    return raised.value.problems


@pytest.mark.slow
def test_missing_leaves_are_all_listed():
    s, abstract = _abstract()
    params = _params(s.linen_variables)
    del params["decoder_norm"]
    del params["logits_dense"]
    problems = _problems({"params": params}, abstract)
    assert problems == [
        "decoder_norm/scale: missing on the Linen side (NNX: shape (64,) float32 names ('norm',))",
        "logits_dense/kernel: missing on the Linen side (NNX: shape (64, 256) float32 names "
        "('embed', 'vocab'))",
    ]


@pytest.mark.slow
def test_extra_leaves_are_all_listed():
    s, abstract = _abstract()
    params = _params(s.linen_variables)
    params["extra_a"] = nn.LogicallyPartitioned(jnp.zeros((3,)), ("norm",))
    params["extra_b"] = {"w": jnp.zeros((2, 2), jnp.int32)}
    problems = _problems({"params": params}, abstract)
    assert problems == [
        "extra_a: missing on the NNX side (Linen: shape (3,) float32 names ('norm',))",
        "extra_b/w: missing on the NNX side (Linen: shape (2, 2) int32 names None)",
    ]


@pytest.mark.slow
def test_shape_dtype_and_name_mismatches_are_all_listed_with_both_sides():
    s, abstract = _abstract()
    params = _params(s.linen_variables)
    norm = params["decoder_norm"]["scale"]
    params["decoder_norm"]["scale"] = norm.replace_boxed(jnp.zeros((65,)))
    logits = params["logits_dense"]["kernel"]
    params["logits_dense"]["kernel"] = logits.replace_boxed(logits.value.astype(jnp.bfloat16))
    embed = params["token_embedder"]["embedding"]
    params["token_embedder"]["embedding"] = nn.LogicallyPartitioned(embed.value, ("embed", "vocab"))
    problems = _problems({"params": params}, abstract)
    assert problems == [
        "decoder_norm/scale: shape differs: Linen (65,) vs NNX (64,)",
        "logits_dense/kernel: dtype differs: Linen bfloat16 vs NNX float32",
        "token_embedder/embedding: logical names differ: Linen ('embed', 'vocab') vs NNX "
        "('vocab', 'embed')",
    ]


@pytest.mark.slow
def test_every_kind_of_mismatch_in_one_error():
    s, abstract = _abstract()
    params = _params(s.linen_variables)
    del params["decoder_norm"]
    params["extra"] = jnp.zeros(2)
    logits = params["logits_dense"]["kernel"]
    params["logits_dense"]["kernel"] = logits.replace_boxed(jnp.zeros((64, 255)))
    problems = _problems({"params": params}, abstract)
    assert len(problems) == 3
    assert [p.split(":")[0] for p in problems] == [
        "decoder_norm/scale",
        "extra",
        "logits_dense/kernel",
    ]


@pytest.mark.slow
def test_nnx_to_linen_checks_against_a_target():
    s = session("llama2-tiny")
    target = jax.eval_shape(lambda: s.linen_variables)
    params = _params(target)
    params["decoder_norm"]["scale"] = params["decoder_norm"]["scale"].replace_boxed(
        jax.ShapeDtypeStruct((64,), jnp.bfloat16)
    )
    with pytest.raises(
        convert.ConversionError,
        match=r"NNX -> Linen: 1 problem\(s\):\n  - "
        r"decoder_norm/scale: dtype differs",
    ):
        convert.nnx_to_linen(s.nnx_params, target={"params": params})


@pytest.mark.slow
def test_unknown_collections_and_nnx_only_state():
    s, abstract = _abstract()
    with pytest.raises(convert.ConversionError, match="no 'params' collection"):
        convert.linen_to_nnx({"batch_stats": {}}, abstract)
    with pytest.raises(convert.ConversionError, match="collection 'cache' has no NNX"):
        convert.linen_to_nnx({"params": s.linen_variables["params"], "cache": {}}, abstract)

    class WithRngsAndStats(nnx.Module):
        def __init__(self):
            self.rngs = nnx.Rngs(0)
            self.w = nnx.Param(jnp.ones(2))
            self.stat = nnx.BatchStat(jnp.zeros(2))

    state = nnx.state(WithRngsAndStats())
    with pytest.raises(convert.ConversionError, match="stat: BatchStat has no Linen"):
        convert.nnx_to_linen(state)
    # RNG state is filtered by type, explicitly; the Param comes through.
    rng_only = nnx.state(WithRngsAndStats(), nnx.Not(nnx.BatchStat))
    assert convert.nnx_to_linen(rng_only) == {"params": {"w": rng_only["w"].get_value()}}


def test_rename_map_serves_both_directions():
    class Pair(nnx.Module):
        def __init__(self):
            with nnx.use_eager_sharding(False):
                self.attn = nnx.Param(jnp.arange(4.0), out_sharding=("norm",))

    renames = {("self_attention",): ("attn",)}
    linen_vars = {"params": {"self_attention": nn.LogicallyPartitioned(jnp.arange(4.0), ("norm",))}}
    state = convert.linen_to_nnx(linen_vars, Pair(), renames=renames)
    assert list(state.keys()) == ["attn"]
    back = convert.nnx_to_linen(state, target=linen_vars, renames=renames)
    assert_same_tree(back, linen_vars)
    with pytest.raises(convert.ConversionError, match="self_attention: missing on the NNX"):
        convert.linen_to_nnx(linen_vars, Pair())


def test_strip_and_restore_boxes_are_inverse():
    tree = {"a": nn.LogicallyPartitioned(np.ones(2), ("embed",)), "b": np.zeros(3)}
    arrays, names = convert.strip_boxes(tree)
    assert names == {"a": ("embed",), "b": None}
    assert_same_tree(convert.restore_boxes(arrays, names), tree)
