"""Sane bounds of a config's values, and of the work they imply: checked before anything is
derived from them, so that no hostile value reaches an allocation, a loop or JAX. No JAX.

`value_violations` holds the settable values to their bounds (run first: nothing is derived
from a value out of bounds); `derived_violations` and `work_violations` the mesh, the model
name, and the pipeline's iterations and unrolled layers. `short_repr` keeps a hostile value
from flooding a message.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any

# Inclusive bounds of every integer key: far above real llama-style models (7B: E=4096,
# F=11008, N=32, V=32000; the largest MaxText meshes), far below sizes whose arithmetic alone
# would overflow, hang or allocate without end. Checked before anything is derived.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "seed": (0, 2**32 - 1),
    "base_emb_dim": (1, 2**16),
    "base_num_query_heads": (1, 2**10),
    "base_num_kv_heads": (1, 2**10),
    "head_dim": (1, 2**12),
    "base_mlp_dim": (1, 2**18),
    "base_num_decoder_layers": (1, 2**10),
    "vocab_size": (1, 2**21),
    "max_target_length": (1, 2**20),
    "num_experts": (1, 2**10),
    "num_experts_per_tok": (1, 2**10),
    "gradient_accumulation_steps": (1, 2**10),
    "dcn_data_parallelism": (1, 2**10),
    "dcn_pipeline_parallelism": (1, 2**10),
    "pipeline_parallel_layers": (-1, 2**10),  # -1: all N layers; 0: see the pipeline rules
    "num_pipeline_microbatches": (
        -1,
        2**12,
    ),  # -1: S (2S with delay); 0: see the pipeline rules
    "num_layers_per_pipeline_stage": (1, 2**10),
    "num_pipeline_repeats": (-1, 2**10),  # -1: N / (S*L); 0: see the pipeline rules
    "ici_data_parallelism": (1, 2**12),
    "ici_fsdp_parallelism": (1, 2**12),
    "ici_tensor_parallelism": (1, 2**12),
    "ici_pipeline_parallelism": (1, 2**12),
    "ici_expert_parallelism": (1, 2**12),
}
MAX_PER_DEVICE_BATCH = 2**16
MAX_DEVICES = 2**16  # the whole mesh
MAX_ITERATIONS = 2**12  # pipeline iterations M*R + d*(S-1) of one step
# Layer applications traced as Python code (not a scan) in one program: with
# scan_pipeline_iterations=false every iteration is traced, with scan_layers_per_stage=false
# every layer of a stage. The program (and its compile time) grows with this count.
MAX_UNROLLED_LAYERS = 512
MAX_MODEL_NAME = 128
MAX_RULES = 256


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 6
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to about `limit` characters without building the whole of it first
    (a hostile value, such as an alias-expanded list, must not flood the message or hang)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text) - limit} more)"


def value_violations(cfg: Any) -> list[str]:
    """Integers outside `INT_BOUNDS`, floats that are not finite or too large."""
    out = []
    for key, (low, high) in INT_BOUNDS.items():
        value = getattr(cfg, key)
        if low <= value <= high:
            continue
        if low == 1 and value < 1:
            out.append(f"{key}={value}: must be a positive integer")
        elif low == -1:
            out.append(f"{key}={short_repr(value)}: must be -1 or an integer in 1..{high}")
        else:
            out.append(f"{key}={short_repr(value)}: must be an integer in {low}..{high}")
    for field in dataclasses.fields(cfg):
        if field.init and field.type in (float, "float"):
            value = getattr(cfg, field.name)
            if not math.isfinite(value):
                out.append(f"{field.name}={value}: must be a finite number")
    if math.isfinite(cfg.per_device_batch_size) and cfg.per_device_batch_size > (
        MAX_PER_DEVICE_BATCH
    ):
        out.append(
            f"per_device_batch_size={cfg.per_device_batch_size}: must be at most "
            f"{MAX_PER_DEVICE_BATCH}"
        )
    return out


def derived_violations(cfg: Any) -> list[str]:
    """The model name (printable, not too long), the mesh's size, the number of rules."""
    out = []
    if not (0 < len(cfg.model_name) <= MAX_MODEL_NAME and cfg.model_name.isprintable()):
        out.append(
            f"model_name={short_repr(cfg.model_name)}: must be 1 to {MAX_MODEL_NAME} printable "
            "characters"
        )
    if cfg.num_devices > MAX_DEVICES:
        out.append(
            f"the mesh (data x stage x fsdp x tensor x expert = {cfg.num_devices} devices): "
            f"at most {MAX_DEVICES} devices"
        )
    if len(cfg.logical_axis_rules) > MAX_RULES:
        out.append(f"logical_axis_rules: {len(cfg.logical_axis_rules)} rules; at most {MAX_RULES}")
    return out


def unrolled_layers(cfg: Any) -> int:
    """Layer applications traced as Python code in one pipelined program (1 when scanned)."""
    iterations = 1 if cfg.scan_pipeline_iterations else cfg.num_iterations
    return iterations * (1 if cfg.scan_layers_per_stage else cfg.layers_per_stage)


def work_violations(cfg: Any, stages_txt: str) -> list[str]:
    """A pipelined config's iterations per step, and the layers it traces unrolled."""
    m, r = cfg.num_microbatches, cfg.num_repeats
    if cfg.num_iterations > MAX_ITERATIONS:
        return [
            f"num_pipeline_microbatches={cfg.num_pipeline_microbatches} (M={m}), "
            f"num_pipeline_repeats={cfg.num_pipeline_repeats} (R={r}), {stages_txt}: "
            f"{cfg.num_iterations} pipeline iterations per step (M*R + d*(S-1)); at most "
            f"{MAX_ITERATIONS}"
        ]
    if unrolled_layers(cfg) > MAX_UNROLLED_LAYERS:
        return [
            f"scan_pipeline_iterations={str(cfg.scan_pipeline_iterations).lower()}, "
            f"scan_layers_per_stage={str(cfg.scan_layers_per_stage).lower()}: "
            f"{unrolled_layers(cfg)} layer applications traced unrolled (iterations "
            f"{cfg.num_iterations} x L={cfg.layers_per_stage} where not scanned); at most "
            f"{MAX_UNROLLED_LAYERS}: scan them"
        ]
    return []
