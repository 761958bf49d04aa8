"""Weight tying (`logits_via_embedding`): one table is both the token embedding and the logits
head, in both twins, pipelined and in the reference; its gradient sums the two uses."""

from __future__ import annotations

import functools

import flax.linen as nn
import numpy as np
import pytest
from conftest import tiny

from migrate.checkpoints import convert
from migrate.common import axes
from parity.analysis import compare
from parity.decoder import twins
from parity.decoder.session import DecoderPair

LAYOUTS = [(None, "pipeline"), (False, "reference")]


@functools.cache
def session() -> DecoderPair:
    return DecoderPair(tiny("llama2-tiny-tied"))


def tied_variables(use_pipeline: bool | None):
    s = session()
    variables = s.linen_variables
    return (
        variables if use_pipeline is None else convert.linen_pipeline_to_reference(variables, s.cfg)
    )


def untied_copy(variables):
    """The same weights for the untied model: the head gets its own copy of the table."""
    params = dict(variables["params"])
    table = params["token_embedder"]["embedding"].value
    params["logits_dense"] = {"kernel": nn.LogicallyPartitioned(table.T, axes.LOGITS_KERNEL)}
    return {**variables, "params": params}


def run(framework: str, cfg, variables, use_pipeline):
    s = session()
    variables = twins.place_linen(variables, cfg, s.mesh, use_pipeline)
    if framework == "linen":
        return twins.run_linen(cfg, s.mesh, variables, s.train_batch, use_pipeline)
    params = twins.linen_to_nnx_params(cfg, s.mesh, variables, use_pipeline)
    return twins.run_nnx(cfg, s.mesh, params, s.train_batch, use_pipeline)


@pytest.mark.slow
def test_a_tied_config_has_no_logits_head_leaf_on_either_side():
    s = session()
    linen = convert.flatten_dict(nn.meta.unbox(s.linen_variables["params"]))
    nnx_paths = set(convert.nnx_flat_params(twins.nnx_initial_state(s.cfg, s.mesh)))
    assert set(linen) == nnx_paths
    assert ("token_embedder", "embedding") in nnx_paths
    assert not any(p[0] == "logits_dense" for p in nnx_paths)
    untied = twins.linen_abstract_variables(s.cfg.replace(logits_via_embedding=False), s.mesh)
    assert len(convert.flatten_dict(untied["params"])) == len(linen) + 1


# The lookup reads the table gathered over fsdp (`Embed`): its gradient is summed per fsdp
# shard and reduce-scattered, and the tied program adds the head's share before that sum ends,
# where the test adds it after: the same addends in another order. Measured on both layouts:
# 0.38 ulp at scale (max_rel 4.54e-8); one float32 ulp is the bound.
SUM_ORDER = compare.Tolerance(float(np.finfo(np.float32).eps), "one rounding of the tied sum")


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("use_pipeline,layout", LAYOUTS, ids=[name for _, name in LAYOUTS])
def test_the_tied_gradient_is_the_sum_of_the_lookup_and_head_gradients(
    framework, use_pipeline, layout
):
    """The tied model against the untied one whose head holds a copy of the table: same loss
    and logits, bit for bit, and the table's gradient equals the lookup's plus the
    (transposed) head's within one rounding of that sum (SUM_ORDER)."""
    s = session()
    cfg = s.cfg
    variables = tied_variables(use_pipeline)
    tied = run(framework, cfg, variables, use_pipeline)
    untied = run(
        framework, cfg.replace(logits_via_embedding=False), untied_copy(variables), use_pipeline
    )
    # The same dots and the same sum in either program: bit-exact (measured), not a tier.
    tol = compare.EXACT
    for got, want in ((tied.outputs, untied.outputs), (tied.loss, untied.loss)):
        assert compare.leaf_diff("out", got, want).max_rel <= tol.max_rel
    lookup = untied.grads["params"]["token_embedder"]["embedding"]
    head = np.asarray(untied.grads["params"]["logits_dense"]["kernel"]).T
    total = tied.grads["params"]["token_embedder"]["embedding"]
    diff = compare.leaf_diff("embedding", total, np.asarray(lookup) + head)
    assert diff.max_rel <= SUM_ORDER.max_rel, (layout, diff)
    # Both uses contribute: neither alone is the tied gradient.
    for part in (lookup, head):
        assert compare.leaf_diff("part", total, part).max_rel > 1e-3
    rest = {k: v for k, v in untied.grads["params"].items() if k != "logits_dense"}
    for record in compare.compare_trees(
        {k: v for k, v in tied.grads["params"].items() if k != "token_embedder"},
        {k: v for k, v in rest.items() if k != "token_embedder"},
    ):
        assert record.max_rel <= tol.max_rel, record
