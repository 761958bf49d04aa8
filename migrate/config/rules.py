"""The cross-key rules of a config: the values each key allows, what is derived from the keys,
and every combination that is refused (each message names its keys, values and the rule).

Reads a `Config` only through its attributes, so that `migrate.config.contract` can call it
from `Config.__post_init__` without an import cycle.
"""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING, Any

from migrate.common import remat
from migrate.common.axes import LOGICAL_NAMES
from migrate.config import bounds

if TYPE_CHECKING:
    from migrate.config.contract import Config

# MaxText's order of the axes this decoder uses; `data` and `stage` span slices (DCN) too.
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "tensor", "expert")
DTYPES = ("float32", "bfloat16")
MATMUL_PRECISIONS = ("default", "high", "highest")
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")

_short = bounds.short_repr


def derive(cfg: Config) -> dict[str, Any]:
    """The derived values: S, M, R, L, d, the pipelined layers, devices, batch sizes,
    iterations and the bubble fraction."""
    stages = cfg.ici_pipeline_parallelism * cfg.dcn_pipeline_parallelism
    delay = 2 if cfg.pipeline_delay_activation_forwarding else 1
    microbatches = cfg.num_pipeline_microbatches
    if microbatches == -1:
        microbatches = stages * delay
    per_stage = cfg.num_layers_per_pipeline_stage
    n_layers = cfg.base_num_decoder_layers
    # The first P layers run in the pipeline, the other N - P after it (scanned, not pipelined).
    pipelined = n_layers
    if stages > 1 and cfg.pipeline_parallel_layers != -1:
        pipelined = cfg.pipeline_parallel_layers
    repeats = cfg.num_pipeline_repeats
    if repeats == -1:
        repeats = max(pipelined // max(stages * per_stage, 1), 1)
    devices = math.prod(
        (
            cfg.ici_data_parallelism * cfg.dcn_data_parallelism,
            stages,
            cfg.ici_fsdp_parallelism,
            cfg.ici_tensor_parallelism,
            cfg.ici_expert_parallelism,
        )
    )
    global_batch = cfg.per_device_batch_size * devices
    global_batch_int = round(global_batch) if float(global_batch).is_integer() else 0
    iterations = microbatches * repeats + delay * (stages - 1)
    return dict(
        num_stages=stages,
        num_microbatches=microbatches,
        num_repeats=repeats,
        layers_per_stage=per_stage,
        forwarding_delay=delay,
        num_pipelined_layers=pipelined,
        num_layers_after_pipeline=n_layers - pipelined,
        num_devices=devices,
        global_batch_size=global_batch_int,
        microbatch_size=global_batch_int // microbatches if microbatches > 0 else 0,
        train_batch_size=global_batch_int * cfg.gradient_accumulation_steps,
        num_iterations=iterations,
        bubble_fraction=delay * (stages - 1) / iterations if iterations > 0 else 0.0,
    )


def violations(cfg: Config) -> list[str]:
    """Every broken rule, each naming its keys, their values and the rule."""
    out: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    out.extend(bounds.derived_violations(cfg))
    for key, allowed in (
        ("dtype", DTYPES),
        ("weight_dtype", DTYPES),
        ("matmul_precision", MATMUL_PRECISIONS),
        ("remat_policy", remat.POLICIES),
        *((name, remat.PLACES) for name in remat.CUSTOM_TENSORS),
        ("jax_default_prng_impl", PRNG_IMPLS),
    ):
        need(
            getattr(cfg, key) in allowed,
            f"{key}={getattr(cfg, key)!r}: must be one of {', '.join(allowed)}",
        )
    need(
        not (cfg.packing and cfg.gradient_accumulation_steps > 1),
        f"packing=true, gradient_accumulation_steps={cfg.gradient_accumulation_steps}: "
        "accumulation averages the k batches' losses, which weighs packed batches with other "
        "token counts unequally; packing runs with gradient_accumulation_steps=1",
    )
    for key in ("learning_rate", "adam_eps"):
        need(getattr(cfg, key) > 0, f"{key}={getattr(cfg, key)}: must be > 0")
    need(
        0 <= cfg.dropout_rate < 1,
        f"dropout_rate={cfg.dropout_rate}: must be in [0, 1) (0 disables)",
    )
    for key in ("adam_b1", "adam_b2"):
        need(0 <= getattr(cfg, key) < 1, f"{key}={getattr(cfg, key)}: must be in [0, 1)")
    for key in ("adam_weight_decay", "gradient_clipping_threshold"):
        need(getattr(cfg, key) >= 0, f"{key}={getattr(cfg, key)}: must be >= 0 (0 disables)")
    need(
        cfg.normalization_layer_epsilon > 0,
        f"normalization_layer_epsilon={cfg.normalization_layer_epsilon}: must be > 0",
    )
    need(
        0 < cfg.rope_min_timescale <= cfg.rope_max_timescale,
        f"rope_min_timescale={cfg.rope_min_timescale}, rope_max_timescale="
        f"{cfg.rope_max_timescale}: need 0 < rope_min_timescale <= rope_max_timescale",
    )
    need(
        cfg.head_dim % 2 == 0,
        f"head_dim={cfg.head_dim}: rotary embedding rotates halves, so head_dim must be even",
    )
    need(
        cfg.base_num_query_heads % cfg.base_num_kv_heads == 0,
        f"base_num_query_heads={cfg.base_num_query_heads}, base_num_kv_heads="
        f"{cfg.base_num_kv_heads}: query heads must be a multiple of kv heads (grouped query)",
    )
    tensor = cfg.ici_tensor_parallelism
    for key in ("base_num_query_heads", "base_num_kv_heads", "base_mlp_dim"):
        need(
            getattr(cfg, key) % tensor == 0,
            f"{key}={getattr(cfg, key)}, ici_tensor_parallelism={tensor}: "
            f"{key} must be divisible by the tensor axis",
        )
    vocab_axes = _rule_axes(cfg, "vocab")
    vocab_shards = math.prod(cfg.mesh_shape.get(a, 1) for a in vocab_axes)
    need(
        cfg.vocab_size % vocab_shards == 0,
        f"vocab_size={cfg.vocab_size}, "
        + ", ".join(f"{a}={cfg.mesh_shape.get(a, 1)}" for a in vocab_axes)
        + ": the embedding and logits tables shard vocab over "
        + " x ".join(vocab_axes)
        + " (logical_axis_rules), so vocab_size must be divisible by that (or map vocab to "
        + "fewer axes in logical_axis_rules)",
    )
    need(
        cfg.base_emb_dim % cfg.ici_fsdp_parallelism == 0,
        f"base_emb_dim={cfg.base_emb_dim}, ici_fsdp_parallelism={cfg.ici_fsdp_parallelism}: "
        "the embed dimension must be divisible by the fsdp axis",
    )

    need(
        cfg.per_device_batch_size > 0 and cfg.global_batch_size > 0,
        f"per_device_batch_size={cfg.per_device_batch_size} x {cfg.num_devices} devices: "
        "the global batch must be a positive integer",
    )
    batch_shards, batch_keys, batch_axes = _batch_split(cfg)
    if cfg.global_batch_size > 0:
        need(
            cfg.global_batch_size % batch_shards == 0,
            f"global batch {cfg.global_batch_size} (per_device_batch_size="
            f"{cfg.per_device_batch_size} x {cfg.num_devices} devices), {batch_keys}: "
            f"the batch must be divisible by {batch_axes}",
        )
    need(
        cfg.num_experts_per_tok <= cfg.num_experts,
        f"num_experts_per_tok={cfg.num_experts_per_tok}, num_experts={cfg.num_experts}: "
        "a token cannot be routed to more experts than there are",
    )
    need(
        cfg.num_experts % cfg.ici_expert_parallelism == 0,
        f"num_experts={cfg.num_experts}, ici_expert_parallelism={cfg.ici_expert_parallelism}: "
        "the experts must split evenly over the expert axis",
    )
    need(
        cfg.load_balance_loss_weight >= 0,
        f"load_balance_loss_weight={cfg.load_balance_loss_weight}: must be >= 0 (0 disables)",
    )
    need(
        not (cfg.pipeline_fsdp_ag_once and cfg.pipeline_fsdp_ag_per_repeat),
        "pipeline_fsdp_ag_once=true, pipeline_fsdp_ag_per_repeat=true: pick one all-gather "
        "mode of the stage weights (once per run, or once per circular repeat)",
    )
    need(
        not cfg.pipeline_fsdp_ag_per_repeat or cfg.num_repeats > 1,
        f"pipeline_fsdp_ag_per_repeat=true, num_pipeline_repeats={cfg.num_pipeline_repeats} "
        f"(R={cfg.num_repeats}): all-gathering per circular repeat needs R >= 2 "
        "(with one repeat use pipeline_fsdp_ag_once)",
    )

    for rule_name, target in cfg.logical_axis_rules[: bounds.MAX_RULES]:
        axes = target if isinstance(target, tuple) else (target,)
        for axis in axes:
            need(
                axis is None or axis in MESH_AXES,
                f"logical_axis_rules: {_short(rule_name)} -> {_short(axis)}: unknown mesh axis "
                f"(mesh axes: {', '.join(MESH_AXES)})",
            )
        if rule_name not in LOGICAL_NAMES:  # the did-you-mean search only for a real miss
            out.append(_unknown_name(rule_name))
        twice = sorted({a for a in axes if a is not None and axes.count(a) > 1})
        need(
            not twice,
            f"logical_axis_rules: {_short(rule_name)} -> {_short(list(axes))}: shards one "
            f"tensor dimension over mesh axis {', '.join(map(repr, twice))} twice (a mesh axis "
            "can shard a tensor once)",
        )

    if cfg.using_pipeline:
        out.extend(_pipeline_violations(cfg))
    return out


def _unknown_name(rule_name: str) -> str:
    close = difflib.get_close_matches(str(rule_name), sorted(LOGICAL_NAMES), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return (
        f"logical_axis_rules: {_short(rule_name)} names no logical axis of this decoder, so the "
        f"rule would shard nothing{hint} (its names: migrate/common/axes.py)"
    )


def _data_txt(cfg: Config) -> str:
    """The data axis and what it is made of (ICI within a slice, DCN across slices)."""
    if cfg.dcn_data_parallelism == 1:
        return f"ici_data_parallelism={cfg.ici_data_parallelism}"
    return (
        f"data={cfg.mesh_shape['data']} (ici_data_parallelism={cfg.ici_data_parallelism} x "
        f"dcn_data_parallelism={cfg.dcn_data_parallelism})"
    )


def _batch_split(cfg: Config) -> tuple[int, str, str]:
    """(shards, the keys that size them, the axes) of the token batch: data x fsdp, times the
    expert axis where `activation_batch` folds it in (MaxText's layout) and it is > 1."""
    axes = ["data", "fsdp"]
    keys = [_data_txt(cfg), f"ici_fsdp_parallelism={cfg.ici_fsdp_parallelism}"]
    if "expert" in _rule_axes(cfg, "activation_batch") and cfg.ici_expert_parallelism > 1:
        axes.append("expert")
        keys.append(f"ici_expert_parallelism={cfg.ici_expert_parallelism}")
    shards = math.prod(cfg.mesh_shape[a] for a in axes)
    return shards, ", ".join(keys), " x ".join(axes)


def _rule_axes(cfg: Config, logical_name: str) -> tuple[str, ...]:
    """The mesh axes of the first rule for `logical_name` (what Linen's resolver picks when no
    other name of the tensor holds them), or () when no rule names it."""
    for rule_name, target in cfg.logical_axis_rules[: bounds.MAX_RULES]:
        if rule_name == logical_name:
            found = target if isinstance(target, tuple) else (target,)
            return tuple(a for a in found if a is not None)
    return ()


def _pipeline_violations(cfg: Config) -> list[str]:
    out: list[str] = []
    s, m, r, n_layers = cfg.num_stages, cfg.num_microbatches, cfg.num_repeats, cfg.layers_per_stage
    d = cfg.forwarding_delay
    stages_txt = (
        f"S={s} (ici_pipeline_parallelism={cfg.ici_pipeline_parallelism} x "
        f"dcn_pipeline_parallelism={cfg.dcn_pipeline_parallelism})"
    )
    out.extend(bounds.work_violations(cfg, stages_txt))
    if cfg.num_pipeline_microbatches != -1 and cfg.num_pipeline_microbatches <= 0:
        out.append(
            f"num_pipeline_microbatches={cfg.num_pipeline_microbatches}: "
            "must be positive, or -1 for S (2S with delay)"
        )
        return out
    if cfg.num_pipeline_repeats != -1 and cfg.num_pipeline_repeats <= 0:
        out.append(
            f"num_pipeline_repeats={cfg.num_pipeline_repeats}: "
            "must be positive, or -1 for the pipelined layers / (S*L)"
        )
        return out
    p, n = cfg.pipeline_parallel_layers, cfg.base_num_decoder_layers
    if p != -1 and not 0 < p <= n:
        out.append(
            f"pipeline_parallel_layers={p}, base_num_decoder_layers={n}: the pipelined layers "
            "must be -1 (all) or 1..base_num_decoder_layers"
        )
        return out
    if s * n_layers * r != cfg.num_pipelined_layers:
        pipelined_key = "base_num_decoder_layers" if p == -1 else "pipeline_parallel_layers"
        out.append(
            f"{stages_txt}, num_layers_per_pipeline_stage={n_layers}, "
            f"num_pipeline_repeats={cfg.num_pipeline_repeats} (R={r}), "
            f"base_num_decoder_layers={n}"
            + ("" if p == -1 else f", pipeline_parallel_layers={p}")
            + f": need S*L*R == {pipelined_key}"
        )
    if m % s != 0:
        out.append(
            f"num_pipeline_microbatches={m}, {stages_txt}: "
            "the microbatch count must be a multiple of S"
        )
    if d == 2 and m < 2 * s:
        out.append(
            f"pipeline_delay_activation_forwarding=true, num_pipeline_microbatches={m}, "
            f"{stages_txt}: forwarding delay needs M >= 2S"
        )
    if cfg.global_batch_size > 0 and cfg.global_batch_size % m != 0:
        out.append(
            f"global batch {cfg.global_batch_size} (per_device_batch_size="
            f"{cfg.per_device_batch_size} x {cfg.num_devices} devices), "
            f"num_pipeline_microbatches={m}: the batch must be divisible by M"
        )
    elif cfg.microbatch_size > 0:
        shards, batch_keys, batch_axes = _batch_split(cfg)
        if cfg.microbatch_size % shards != 0:
            out.append(
                f"microbatch size {cfg.microbatch_size} (global batch "
                f"{cfg.global_batch_size} / M={m}), {batch_keys}: each microbatch must split "
                f"over {batch_axes}"
            )
    return out
