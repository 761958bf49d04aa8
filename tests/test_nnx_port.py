"""The NNX port equals the Linen original exactly, in every NNX mode, and shards the same."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import pytest
from conftest import SHIPPED_TINY_CONFIGS, tiny
from flax import nnx

from migrate.checkpoints import convert
from migrate.common import sharding
from migrate.nnx import decoder as nnx_decoder
from parity.analysis import compare
from parity.decoder import twins
from parity.decoder.session import DecoderPair
from parity.engine.numeric import run_records

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

MODES = [(True, True), (True, False), (False, True), (False, False)]


@functools.cache
def session(name: str) -> DecoderPair:
    return DecoderPair(tiny(name))


# forward, grads (bit-exact) and pipeline on every shipped config, and NaN bubbles reaching
# nothing in either twin, are the config matrix's (tests/test_cli.py, `--checks=all`).


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode,graph_updates", MODES)
def test_every_nnx_mode_builds_runs_and_matches_linen(graph_mode, graph_updates):
    s = session("llama2-tiny")
    expected = s.run("linen", "linen")
    with nnx.set_graph_mode(graph_mode), nnx.set_graph_updates(graph_updates):
        model = nnx_decoder.init_model(s.cfg, s.mesh)
        params = twins.linen_to_nnx_params(s.cfg, s.mesh, s.linen_variables)
        actual = twins.run_nnx(s.cfg, s.mesh, params, s.train_batch)
        flat = nnx.to_flat_state(nnx.state(model))
    records = run_records("", actual, expected, compare.EXACT)
    assert all(r["passed"] and r["mismatches"] == 0 for r in records)
    for path, variable in flat:
        names = convert.nnx_names(variable)
        assert names is not None and len(names) == variable.get_value().ndim, (path, names)


@pytest.mark.parametrize("name", [*SHIPPED_TINY_CONFIGS, "llama2-7b", "mixtral-8x7b"])
@pytest.mark.parametrize("use_pipeline", [None, False], ids=["pipeline", "reference"])
def test_nnx_logical_names_equal_the_linen_boxes(name, use_pipeline):
    cfg = tiny(name)
    mesh = sharding.abstract_mesh(cfg)
    _, abstract = twins.nnx_abstract(cfg, mesh, use_pipeline)
    linen = twins.linen_abstract_variables(cfg, mesh, use_pipeline)
    converted = convert.nnx_to_linen(abstract, target=linen)  # raises on any name mismatch
    assert jax.tree.structure(converted) == jax.tree.structure(linen)
    for variable in jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        assert len(convert.nnx_names(variable)) == variable.get_value().ndim


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-scan"])
def test_nnx_init_places_arrays_like_linen(name):
    """Guards the eager-sharding trap: per-layer sharding inside nnx.vmap leaves the stage
    axis replicated. init_model places every array by its full out_sharding."""
    s = session(name)
    linen_arrays = nn.meta.unbox(s.linen_variables)["params"]
    nnx_arrays = nnx.to_pure_dict(s.nnx_params)
    for linen_array, nnx_array in zip(
        jax.tree.leaves(linen_arrays), jax.tree.leaves(nnx_arrays), strict=True
    ):
        assert nnx_array.sharding.is_equivalent_to(linen_array.sharding, nnx_array.ndim)
    stage_weight = nnx_arrays["pipeline"]["layers"]
    first = jax.tree.leaves(stage_weight)[0]
    assert "stage" in first.sharding.spec
