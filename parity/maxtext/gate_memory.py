"""A lower bound of the memory a MaxText gate run needs (`parity --maxtext`), from the config's
MaxText keys alone (no JAX, no MaxText), checked before either release's worker starts: a
config too large for the machine would otherwise start both workers and wait, silent, until
`--worker_timeout_s`. The bound is `migrate.runtime.memory`'s, for MaxText's decoder:

- `parameters`: a llama2-style decoder's weights in `weight_dtype`: the token embedding, the
  logits kernel unless `logits_via_embedding`, the final norm, and per layer the attention's
  query/key/value/out kernels, the MLP's wi_0/wi_1/wo (with `num_experts` > 1 the smaller of
  the dense MLP and every expert's plus the router: layers may mix the two), two norms;
  `global_parameter_scale` scales the sizes as MaxText scales them;
- `optimizer`: AdamW's moments (`mu` in `mu_dtype`, `nu` in the weights' dtype; none for an
  `opt_type` without moments);
- `gradients`: one per parameter;
- `activations`: the float32 logits of one batch and its embedded tokens, in each worker.

Each release's worker holds its own model, optimizer state and gradients at once (`copies=2`).
A key the config does not set takes MaxText's default (its packaged base.yml, the same in 0.2.3
and 0.2.5). A `model_name` other than `default` takes its sizes from a model file of MaxText's,
which this does not read: no estimate then.
"""

from __future__ import annotations

import math
from typing import Any

from migrate.runtime import memory
from parity.maxtext.gate_config import DTYPE_BYTES, MaxTextConfig

# MaxText's packaged base.yml values of the keys the bound reads (0.2.3 and 0.2.5 alike).
MAXTEXT_DEFAULTS: dict[str, Any] = {
    "model_name": "default",
    "global_parameter_scale": 1,
    "base_emb_dim": 2048,
    "base_num_query_heads": 16,
    "base_num_kv_heads": 16,
    "head_dim": 128,
    "base_mlp_dim": 7168,
    "base_moe_mlp_dim": -1,
    "base_num_decoder_layers": 16,
    "num_experts": 1,
    "logits_via_embedding": False,
    "dtype": "bfloat16",
    "weight_dtype": "float32",
    "mu_dtype": "",
    "opt_type": "adamw",
}
WITH_MOMENTS = ("adamw", "adam_pax")  # MaxText's optimizers that keep Adam's two moments
# Parameter bytes per release from which a worker's model counts as large: building it takes
# minutes, and the run says so before the workers start.
LARGE_BYTES = 1 << 30


def _scales(scale: int) -> tuple[int, int, int, int]:
    """MaxText's powers of two for (embed, heads, mlp, layers) from `global_parameter_scale`:
    one doubling of each in turn (heads and mlp, then embed, then layers)."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def parameter_count(keys: dict[str, Any]) -> int:
    """Weights of a llama2-style decoder with these MaxText keys (MaxText's defaults for the
    others); with experts, each layer's MLP counts as the smaller of dense and experts."""
    k = {**MAXTEXT_DEFAULTS, **keys}
    emb_s, heads_s, mlp_s, layers_s = _scales(int(k["global_parameter_scale"]))
    e = k["base_emb_dim"] << emb_s
    query, kv = k["base_num_query_heads"] << heads_s, k["base_num_kv_heads"] << heads_s
    f, n = k["base_mlp_dim"] << mlp_s, k["base_num_decoder_layers"] << layers_s
    attention = e * k["head_dim"] * (2 * query + 2 * kv)
    mlp = 3 * e * f
    experts = k["num_experts"]
    if experts > 1:
        moe_f = k["base_moe_mlp_dim"] << mlp_s if k["base_moe_mlp_dim"] > 0 else f
        mlp = min(mlp, experts * 3 * e * moe_f + e * experts)
    tables = 1 if k["logits_via_embedding"] else 2
    return tables * k["vocab_size"] * e + e + n * (attention + mlp + 2 * e)


def estimate(config: MaxTextConfig) -> memory.MemoryEstimate | None:
    """The lower bound of both releases' workers on `config`; None where a MaxText model file
    sets the sizes (`model_name` not `default`)."""
    k = {**MAXTEXT_DEFAULTS, **config.keys}
    if k["model_name"] != "default":
        return None
    weight = DTYPE_BYTES[k["weight_dtype"]]
    parameters = parameter_count(config.keys)
    moments = weight + DTYPE_BYTES[k["mu_dtype"] or k["weight_dtype"]]
    optimizer = parameters * moments if k["opt_type"] in WITH_MOMENTS else 0
    tokens = int(k["per_device_batch_size"] * config.num_devices) * k["max_target_length"]
    emb = k["base_emb_dim"] << _scales(int(k["global_parameter_scale"]))[0]
    activations = tokens * (4 * k["vocab_size"] + DTYPE_BYTES[k["dtype"]] * emb)
    return memory.MemoryEstimate(
        parameters=parameters * weight,
        optimizer=optimizer,
        gradients=parameters * weight,
        activations=2 * activations,
        copies=2,
    )


def describe(config: MaxTextConfig, found: memory.MemoryEstimate | None) -> str:
    """`estimate(config)` as the plan line says it."""
    if found is None:
        name = config.keys["model_name"]
        return f"memory not estimated (model_name={name}: its sizes are in MaxText's model file)"
    return f"memory {found.describe()}"


def large(found: memory.MemoryEstimate | None) -> bool:
    """Whether each worker builds a model large enough to take minutes (`LARGE_BYTES`)."""
    return found is not None and found.parameters >= LARGE_BYTES
