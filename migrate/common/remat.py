"""Remat policies by MaxText's names and meanings (both twins).

The layers tag their tensors with MaxText's checkpoint names (the constants below); a policy
names which tags the backward pass keeps on the device, which it offloads to pinned host
memory, and rematerialises the rest. As in MaxText 0.2.5 (`get_remat_policy`,
`get_pipeline_remat_policy`):

- a decoder layer outside the pipeline (the reference decoder, the layers after a pipelined
  subset) is always checkpointed with `layer_policy`; `full` and `none` both save nothing
  (MaxText passes `policy=None` to `jax.checkpoint`, which saves nothing);
- a pipeline iteration (with `set_remat_policy_on_pipeline_iterations`) is checkpointed with
  `iteration_policy`: the layer policy plus the iteration's and the layers' inputs
  (`iteration_input`, `decoder_layer_input`); `custom` is taken as it is, with no inputs
  added.

The twins' dot-product attention tags its output `attention_out` (what MaxText's dot-product
attention tags) and never `context` (MaxText's flash kernels' name): a policy `_with_context`
is its base policy here, as in MaxText with `attention: dot_product`. No tensor is quantized,
so `quantization` saves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from migrate.common import axes

QUERY_PROJ, KEY_PROJ, VALUE_PROJ = "query_proj", "key_proj", "value_proj"
ATTENTION_OUT, OUT_PROJ = "attention_out", "out_proj"
MLPWI_0, MLPWI_1, MLPWO = "mlpwi_0", "mlpwi_1", "mlpwo"
MOE_MLPWI_0, MOE_MLPWI_1, MOE_MLPWO = "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"

# `custom`'s per-tensor keys (MaxText's names and defaults) that the twins read: every tag the
# layers write, and MaxText's tags of other layer kinds (fused projections, flash attention's
# `context`), which name no tensor here.
CUSTOM_TENSORS: dict[str, str] = {
    axes.DECODER_LAYER_INPUT: "device",
    "context": "remat",
    "mlpwi": "remat",
    MLPWI_0: "remat",
    MLPWI_1: "remat",
    MLPWO: "remat",
    MOE_MLPWI_0: "remat",
    MOE_MLPWI_1: "remat",
    MOE_MLPWO: "remat",
    QUERY_PROJ: "remat",
    KEY_PROJ: "remat",
    VALUE_PROJ: "remat",
    "kv_proj": "remat",
    "qkv_proj": "remat",
    ATTENTION_OUT: "remat",
    OUT_PROJ: "remat",
}
PLACES = ("remat", "device", "offload")

_QKV = (QUERY_PROJ, VALUE_PROJ, KEY_PROJ, "kv_proj", "qkv_proj")
_MINIMAL = (*_QKV, OUT_PROJ, MLPWI_0, MLPWI_1, "mlpwi", MLPWO)
# Policy -> the names it keeps on the device (MaxText 0.2.5's lists).
_SAVED: dict[str, tuple[str, ...]] = {
    "full": (),
    "none": (),
    "minimal": _MINIMAL,
    "minimal_with_context": (*_MINIMAL, "context"),
    "minimal_flash": (*_MINIMAL, "context"),
    "minimal_with_quantization": (*_MINIMAL, "quantization"),
    "minimal_with_context_and_quantization": (*_MINIMAL, "context", "quantization"),
    "save_dot_with_context_except_mlp": (*_QKV, "context", OUT_PROJ),
    "save_dot_except_mlpwi": (*_QKV, OUT_PROJ, MLPWO),
    "save_dot_except_mlp": (*_QKV, OUT_PROJ),
    "save_qkv_proj": _QKV,
    "save_out_proj": (OUT_PROJ,),
}
# Policy -> the names it offloads to pinned host memory.
_OFFLOADED: dict[str, tuple[str, ...]] = {
    "qkv_proj_offloaded": (QUERY_PROJ, VALUE_PROJ, KEY_PROJ, "kv_proj"),
    "minimal_offloaded": _MINIMAL,
}
POLICIES: tuple[str, ...] = (*_SAVED, *_OFFLOADED, "custom")


def _placed(cfg: Any, place: str) -> tuple[str, ...]:
    return tuple(name for name in CUSTOM_TENSORS if getattr(cfg, name) == place)


def saved_and_offloaded(cfg: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names `cfg.remat_policy` keeps on the device and the names it offloads."""
    name = cfg.remat_policy
    if name == "custom":
        return _placed(cfg, "device"), _placed(cfg, "offload")
    if name in _OFFLOADED:
        return (), _OFFLOADED[name]
    return _SAVED[name], ()


def _policy(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> Callable:
    import jax  # here: the config's validation reads this module's names before JAX starts

    if offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(saved),
            names_which_can_be_offloaded=list(offloaded),
            offload_src="device",
            offload_dst="pinned_host",
        )
    if saved:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.nothing_saveable


def layer_policy(cfg: Any) -> Callable:
    """The `jax.checkpoint` policy of a decoder layer outside the pipeline."""
    return _policy(*saved_and_offloaded(cfg))


def iteration_policy(cfg: Any) -> Callable:
    """The `jax.checkpoint` policy of a pipeline iteration: the layer policy plus the
    iteration's and the layers' inputs (`custom`: its own names only)."""
    saved, offloaded = saved_and_offloaded(cfg)
    if cfg.remat_policy != "custom":
        saved = (*saved, axes.ITERATION_INPUT, axes.DECODER_LAYER_INPUT)
    return _policy(saved, offloaded)
