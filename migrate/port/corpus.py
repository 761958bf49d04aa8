"""Fields for ports of modules built on objects no command line can spell (`--fields_from`):
the twins' Linen layers on a shipped config and its mesh, recurrentgemma's Griffin and
MaxText's Linen decoder layer at tiny sizes, as `docs/port.md` ports them
(`bench/port_corpus.py`). The corpus's own packages are imported only by their functions.

    migrate port migrate.linen.layers:DecoderLayer --inputs='float32[2,16,64];int32[2,16]' \\
        --fields_from=migrate.port.corpus:llama2_tiny
"""

from __future__ import annotations

from typing import Any

from migrate.config.loading import load_config, resolve


def twin_fields(config: str) -> dict[str, Any]:
    """`config` and `mesh`, the fields of the twins' layers, for the shipped config `config`."""
    from migrate.common import sharding

    cfg = load_config(resolve(config))
    return {"config": cfg, "mesh": sharding.make_mesh(cfg)}


def llama2_tiny() -> dict[str, Any]:
    return twin_fields("llama2-tiny")


def mixtral_tiny() -> dict[str, Any]:
    return twin_fields("mixtral-tiny")


def llama2_tiny_config() -> dict[str, Any]:
    """The config alone: the layers with no mesh (`RMSNorm`, `RotaryEmbedding`)."""
    return {"config": twin_fields("llama2-tiny")["config"]}


def griffin_tiny() -> dict[str, Any]:
    """recurrentgemma's Griffin (its Flax Linen model) at a tiny width: two recurrent blocks
    and one local-attention block (recurrentgemma installed beside the project)."""
    from recurrentgemma import common

    recurrent, attention = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION
    config = common.GriffinConfig(
        vocab_size=32,
        width=8,
        mlp_expanded_width=16,
        num_heads=2,
        block_types=(recurrent, recurrent, attention),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=4,
        logits_soft_cap=30.0,
    )
    return {"config": config}


def maxtext_decoder_layer() -> dict[str, Any]:
    """MaxText's Linen `decoders.DecoderLayer` (0.2.3) on a tiny llama2 shape and its mesh
    (MaxText importable: its release environment's packages on the path)."""
    import os

    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    import maxtext
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(
        [None, base],
        run_name="port",
        hardware="cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        jax_cache_dir="",
        dataset_type="synthetic",
        enable_dropout=False,
        dropout_rate=0.0,
        base_emb_dim=64,
        base_num_query_heads=4,
        base_num_kv_heads=2,
        head_dim=16,
        base_mlp_dim=128,
        base_num_decoder_layers=2,
        vocab_size=256,
        max_target_length=16,
        per_device_batch_size=1,
        attention="dot_product",
        scan_layers=False,
    )
    mesh = maxtext_utils.get_mesh_from_config(config)
    return {"config": config, "mesh": mesh, "model_mode": "train"}


def __getattr__(name: str) -> Any:
    """`twin_CONFIG` and `twin_CONFIG_reference` (CONFIG a shipped config's name, `_` for
    `-`: `twin_llama2_tiny_scan`): the fields of the twins' decoder on that config, pipelined
    or as the non-pipelined reference, for `--fields_from` (`bench/port_corpus.py --configs`)."""
    stem = name.removeprefix("twin_")
    if stem == name or stem.startswith("_"):
        raise AttributeError(name)
    reference = stem.endswith("_reference")
    config = stem.removesuffix("_reference").replace("_", "-")

    def fields() -> dict[str, Any]:
        return {**twin_fields(config), **({"use_pipeline": False} if reference else {})}

    fields.__name__ = name
    return fields


def llama2_tiny_reference() -> dict[str, Any]:
    """The twins' decoder as the non-pipelined reference (`use_pipeline=False`)."""
    return {**llama2_tiny(), "use_pipeline": False}


def maxtext_sequential_layers() -> dict[str, Any]:
    """MaxText's `decoders.SequentialBlockDecoderLayers` (0.2.3): two of its Linen decoder
    layers, the layer class held in a field."""
    from maxtext.layers import decoders

    fields = maxtext_decoder_layer()
    return {
        **fields,
        "decoder_layer": decoders.DecoderLayer,
        "num_decoder_layers": 2,
        "quant": None,
    }
