"""Fields for ports of modules built on objects no command line can spell (`--fields_from`):
the twins' Linen layers on a shipped config and its mesh, as `docs/port.md` ports them.

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
