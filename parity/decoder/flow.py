"""Where a tensor sits in the decoder's data flow: the order the drill-down's stages run in and
the order a failing check names its first divergence by."""

from __future__ import annotations

# Execution order inside a decoder layer: the first divergence is the first in this order.
LAYER_ORDER = (
    "pre_self_attention_layer_norm",
    "self_attention/query",
    "self_attention/key",
    "self_attention/value",
    "self_attention/rotary/0",
    "self_attention/rotary/1",
    "self_attention/out",
    "self_attention",
    "post_self_attention_layer_norm",
    "mlp/gate",
    "mlp/wi_0",
    "mlp/wi_1",
    "mlp/wo",
    "mlp",
    "mlp/aux_loss",
    "output",
    "output/aux_loss",
)


# The decoder's parameters and outputs in data-flow order (layers by their submodule order).
_FLOW = (
    "token_embedder",
    "embedding",
    "pipeline",
    "layers",
    "layers_after_pipeline",
    "decoder_norm",
    "logits_dense",
)


def data_flow_rank(tensor: str) -> tuple[int, int]:
    """Where a record's tensor (`linen-init/grads/params/pipeline/.../mlp/wo/kernel`, `logits`,
    `loss`) sits in the decoder's data flow: earlier parts rank lower."""
    parts = tensor.split("/")
    if parts[-1] in ("logits", "loss") or tensor.endswith(("/logits", "/loss")):
        return (len(_FLOW) + (parts[-1] == "loss"), 0)
    first = next((i for i, name in enumerate(_FLOW) if name in parts), len(_FLOW))
    padded = f"/{tensor}/"
    matches = [name for name in LAYER_ORDER if f"/{name}/" in padded]
    inner = LAYER_ORDER.index(max(matches, key=len)) if matches else len(LAYER_ORDER)
    return (first, inner)
