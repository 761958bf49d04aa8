"""Mesh construction, the one resolver, and the logical names of every parameter."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import TINY_CONFIGS, tiny
from jax.sharding import PartitionSpec as P

from migrate import sharding
from migrate.linen.decoder import Decoder


def test_mesh_has_the_config_axes():
    cfg = tiny("llama2-tiny")
    mesh = sharding.make_mesh(cfg)
    assert dict(mesh.shape) == {"data": 1, "stage": 4, "fsdp": 2, "tensor": 1}


def test_too_few_devices_says_how_many_and_how_to_simulate():
    cfg = tiny("llama2-tiny", "ici_data_parallelism=2")
    with pytest.raises(sharding.MeshError) as raised:
        sharding.make_mesh(cfg)
    message = str(raised.value)
    assert "needs 16 devices" in message and "8 are present" in message
    assert "--xla_force_host_platform_device_count=16" in message


def test_linen_resolver_priority_and_no_reuse():
    rules = (("activation_batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"))
    assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    # fsdp is already taken by the batch: embed is left unsharded, not sharded twice.
    assert sharding.logical_to_spec(("activation_batch", "embed"), rules) == P(
        ("data", "fsdp"), None
    )
    # Unknown names are replicated (NNX's resolver would pass them through as mesh axes).
    assert sharding.logical_to_spec(("unknown",), rules) == P(None)


def test_without_mesh_axis():
    spec = P(None, "stage", ("data", "fsdp"), "fsdp", "tensor")
    assert sharding.without_mesh_axis(spec, "fsdp") == P(None, "stage", "data", None, "tensor")


def _abstract_params(cfg, use_pipeline=None):
    model = Decoder(cfg, sharding.abstract_mesh(cfg), use_pipeline=use_pipeline)
    tokens = jax.ShapeDtypeStruct((cfg.global_batch_size, cfg.max_target_length), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


@pytest.mark.parametrize("name", [*TINY_CONFIGS, "llama2-7b"])
@pytest.mark.parametrize("use_pipeline", [None, False], ids=["pipeline", "reference"])
def test_every_parameter_has_one_logical_name_per_dimension(name, use_pipeline):
    cfg = tiny(name)
    params = _abstract_params(cfg, use_pipeline)
    boxes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert len(boxes) == 12  # 9 per layer + embedding, final norm, logits
    for box in boxes:
        assert isinstance(box, nn.LogicallyPartitioned)
        assert len(box.names) == box.value.ndim, (box.names, box.value.shape)
        assert sharding.logical_to_spec(box.names, cfg.logical_axis_rules) is not None


def test_pipeline_weights_carry_stacked_axis_names():
    cfg = tiny("llama2-tiny-scan")
    params = _abstract_params(cfg)
    query = params["pipeline"]["layers"]["layers"]["self_attention"]["query"]["kernel"]
    assert query.names == (
        "circular_repeats",
        "layers",
        "layers_per_stage",
        "embed",
        "q_heads",
        "kv",
    )
    assert query.value.shape == (2, 4, 2, 64, 4, 16)
    assert sharding.logical_to_spec(query.names, cfg.logical_axis_rules) == P(
        None, "stage", None, "fsdp", "tensor", None
    )
