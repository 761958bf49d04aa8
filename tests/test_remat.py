"""Remat policies by MaxText's names and meanings (`migrate.common.remat`, docs/pipeline.md
section 9): where each policy places every checkpoint name, against MaxText 0.2.5's own
policy functions, and the twins held to parity under the policies that compile to different
programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import run_cli, tiny
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from maxtext_remat_policies import placement

from migrate.common import axes, remat, sharding
from migrate.linen import layers as linen_layers
from migrate.nnx import layers as nnx_layers
from parity import cli
from parity.maxtext import gate_config

TESTS = Path(__file__).resolve().parent
NAMES = [*remat.CUSTOM_TENSORS, axes.ITERATION_INPUT]
# A `custom` policy with every place used (a tensor the twins never make included).
CUSTOM = {
    axes.DECODER_LAYER_INPUT: "device",
    remat.QUERY_PROJ: "device",
    remat.OUT_PROJ: "offload",
    remat.MLPWO: "offload",
    "qkv_proj": "device",
}


def custom_overrides(places: dict[str, str]) -> tuple[str, ...]:
    return ("remat_policy=custom", *(f"{name}={place}" for name, place in places.items()))


def places(policy_name: str) -> dict[str, dict[str, str]]:
    """The twins' placement of every name, in the layers and in a pipeline iteration."""
    overrides = custom_overrides(CUSTOM) if policy_name == "custom" else ()
    cfg = tiny("llama2-tiny", *overrides, f"remat_policy={policy_name}")
    return {
        "layer": {n: placement(remat.layer_policy(cfg), n) for n in NAMES},
        "iteration": {n: placement(remat.iteration_policy(cfg), n) for n in NAMES},
    }


def test_the_iterations_keep_their_inputs_on_top_of_every_named_policy():
    for policy_name in remat.POLICIES:
        layer, iteration = places(policy_name).values()
        if policy_name == "custom":
            assert iteration == layer
            continue
        added = {axes.ITERATION_INPUT: "device", axes.DECODER_LAYER_INPUT: "device"}
        assert iteration == {**layer, **added}, policy_name
        assert layer[axes.ITERATION_INPUT] == "remat"


def test_full_and_none_save_nothing_and_minimal_saves_only_projections():
    assert (
        set(places("full")["layer"].values()) == set(places("none")["layer"].values()) == {"remat"}
    )
    saved = {n for n, p in places("minimal")["layer"].items() if p == "device"}
    assert saved == {
        remat.QUERY_PROJ,
        remat.KEY_PROJ,
        remat.VALUE_PROJ,
        remat.OUT_PROJ,
        remat.MLPWI_0,
        remat.MLPWI_1,
        remat.MLPWO,
        "kv_proj",
        "qkv_proj",
        "mlpwi",
    }


QKV = {remat.QUERY_PROJ, remat.KEY_PROJ, remat.VALUE_PROJ}


def saved_names(framework: str, cfg) -> set[str]:
    """The checkpoint names of the residuals one decoder layer of `framework`'s twin keeps on
    the device for its backward pass, checkpointed with `cfg`'s layer policy."""
    mesh = sharding.make_mesh(cfg)
    x = jax.random.normal(jax.random.key(0), (2, 8, cfg.base_emb_dim))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    if framework == "linen":
        layer = linen_layers.DecoderLayer(cfg, mesh)
        params = jax.eval_shape(layer.init, jax.random.key(0), x, positions)
        apply = lambda p, x: layer.apply(p, x, positions)[0].sum()
    else:
        with nnx.use_eager_sharding(False):
            graphdef, params = nnx.split(nnx_layers.DecoderLayer(cfg, mesh, rngs=nnx.Rngs(0)))
        apply = lambda p, x: nnx.merge(graphdef, p)(x, positions)[0].sum()
    checkpointed = jax.checkpoint(apply, policy=remat.layer_policy(cfg))
    return {
        description.split("'")[1]
        for _, description in saved_residuals(checkpointed, params, x)
        if description.startswith("named")
    }


@pytest.mark.compat  # each stack's checkpoint policies and saved residuals
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize(
    "config, policy, expected",
    [
        ("llama2-tiny", "full", set()),
        ("llama2-tiny", "save_qkv_proj", QKV),
        ("llama2-tiny", "save_dot_except_mlp", {*QKV, remat.OUT_PROJ}),
        # the layer's last projection is never a residual (its output's gradient is the input's)
        ("llama2-tiny", "minimal", {*QKV, remat.OUT_PROJ, remat.MLPWI_0, remat.MLPWI_1}),
        ("llama2-tiny", "minimal_offloaded", set()),  # offloaded: no device residual
        ("mixtral-tiny", "minimal", {*QKV, remat.OUT_PROJ, remat.MLPWI_0, remat.MLPWI_1}),
    ],
)
def test_each_twin_tags_the_tensors_a_policy_names(framework, config, policy, expected):
    assert saved_names(framework, tiny(config, f"remat_policy={policy}")) == expected


def test_custom_keeps_what_its_keys_say_on_the_device():
    cfg = tiny("llama2-tiny", *custom_overrides(CUSTOM))
    expected = {axes.DECODER_LAYER_INPUT, remat.QUERY_PROJ}  # out_proj, mlpwo offloaded
    assert saved_names("linen", cfg) == saved_names("nnx", cfg) == expected


@pytest.mark.slow
@pytest.mark.skipif(
    sys.version_info < (3, 12) or gate_config.default_python("nnx") is None,
    reason="MaxText 0.2.5's environment (make maxtext-envs; Python 3.12)",
)
def test_every_policy_places_every_name_as_maxtext_does():
    """MaxText 0.2.5's `get_remat_policy` and `get_pipeline_remat_policy` asked the same
    questions: the same place for every name, every policy, in the layers and the iterations;
    where MaxText's iteration policy raises (an offloaded policy: `save_from_both_policies`
    takes boolean policies only), the twins keep the inputs and offload what the policy
    names."""
    cases = [[p, CUSTOM if p == "custom" else {}] for p in remat.POLICIES]
    env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [
            gate_config.default_python("nnx"),
            str(TESTS / "maxtext_remat_policies.py"),
            json.dumps(cases),
            json.dumps(NAMES),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    maxtexts = json.loads(done.stdout.strip().splitlines()[-1])
    raising = []
    for policy_name in remat.POLICIES:
        ours, theirs = places(policy_name), maxtexts[policy_name]
        assert ours["layer"] == theirs["layer"], policy_name
        if isinstance(theirs["iteration"], str):
            assert theirs["iteration"].startswith("ValueError"), theirs["iteration"]
            raising.append(policy_name)
        else:
            assert ours["iteration"] == theirs["iteration"], policy_name
    assert raising == ["qkv_proj_offloaded", "minimal_offloaded"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, overrides",
    [
        ("llama2-tiny", ("remat_policy=minimal",)),
        ("llama2-tiny", ("remat_policy=minimal_offloaded",)),
        ("llama2-tiny", custom_overrides(CUSTOM)),
        ("mixtral-tiny", ("remat_policy=save_dot_except_mlpwi",)),
    ],
    ids=["minimal", "minimal_offloaded", "custom", "mixtral-save_dot_except_mlpwi"],
)
def test_the_twins_hold_parity_under_a_policy(tmp_path, config, overrides):
    """Bit-exact twins (forward and every gradient) and the pipelined decoder against its
    reference, under a policy that saves (or offloads) other tensors than the default's."""
    status, report = run_cli(
        tmp_path,
        str(TESTS.parent / "configs" / f"{config}.yml"),
        *overrides,
        "--checks=forward,grads,pipeline",
    )
    failing = [c for c in report["checks"] if not c["passed"]]
    assert status == cli.EXIT_PASS, failing
