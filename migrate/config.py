"""A frozen, typed model config: `configs/base.yml` + a model YAML + `key=value` overrides.

Key names follow MaxText. Derived values (S, M, R, L, microbatch size, iteration count, bubble
fraction) are computed once, in `Config.__post_init__`, and every invalid combination is refused
with a `ConfigError` naming the keys, their values and the rule they break. Every size is held
to a sane bound (`migrate.bounds`) and every float must be finite *before* anything is derived
from them, so that no hostile value reaches JAX, a loop or an allocation. YAML is read through
`migrate.safe_load` (bounded: no alias bombs, no deep nesting).

Longer than 400 lines: the fields, their derived values and the cross-key rules that refuse an
invalid combination are one contract, read together; split, a rule would sit apart from the
fields and derivations it constrains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from migrate import bounds, safe_load
from migrate.errors import BadInput

# MaxText's order of the axes this decoder uses; `data` and `stage` span slices (DCN) too.
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "tensor", "expert")
DTYPES = ("float32", "bfloat16")
MATMUL_PRECISIONS = ("default", "high", "highest")
REMAT_POLICIES = ("save_iteration_and_layer_inputs", "full", "minimal", "none")
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

MAX_CONFIG_BYTES = 1 << 20


class ConfigError(BadInput, ValueError):
    """A config that cannot be built: unknown key, wrong type, or a broken rule."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Every knob of the model, its batch, its pipeline and its mesh."""

    model_name: str
    seed: int
    jax_default_prng_impl: str

    base_emb_dim: int
    base_num_query_heads: int
    base_num_kv_heads: int
    head_dim: int
    base_mlp_dim: int
    base_num_decoder_layers: int
    vocab_size: int
    max_target_length: int
    normalization_layer_epsilon: float
    rope_min_timescale: float
    rope_max_timescale: float
    logits_via_embedding: bool  # the token embedding is also the logits head (tied)
    # Mixture of experts (mixtral-style): 1 expert is the dense llama2 MLP.
    num_experts: int
    num_experts_per_tok: int
    load_balance_loss_weight: float

    per_device_batch_size: float
    learning_rate: float
    adam_b1: float
    adam_b2: float
    adam_eps: float
    adam_weight_decay: float
    gradient_clipping_threshold: float
    dtype: str
    weight_dtype: str
    matmul_precision: str

    dcn_data_parallelism: int
    dcn_pipeline_parallelism: int
    pipeline_parallel_layers: int  # -1: every decoder layer runs in the pipeline
    num_pipeline_microbatches: int
    num_layers_per_pipeline_stage: int
    num_pipeline_repeats: int
    pipeline_delay_activation_forwarding: bool
    pipeline_fsdp_ag_once: bool
    pipeline_fsdp_ag_per_repeat: bool
    scan_layers_per_stage: bool
    scan_pipeline_iterations: bool
    set_remat_policy_on_pipeline_iterations: bool
    remat_policy: str

    ici_data_parallelism: int
    ici_fsdp_parallelism: int
    ici_tensor_parallelism: int
    ici_pipeline_parallelism: int
    ici_expert_parallelism: int

    logical_axis_rules: Rules

    # Derived in __post_init__; not settable from YAML.
    num_stages: int = dataclasses.field(init=False)
    num_microbatches: int = dataclasses.field(init=False)
    num_repeats: int = dataclasses.field(init=False)
    layers_per_stage: int = dataclasses.field(init=False)
    forwarding_delay: int = dataclasses.field(init=False)
    num_pipelined_layers: int = dataclasses.field(init=False)
    num_layers_after_pipeline: int = dataclasses.field(init=False)
    num_devices: int = dataclasses.field(init=False)
    global_batch_size: int = dataclasses.field(init=False)
    microbatch_size: int = dataclasses.field(init=False)
    num_iterations: int = dataclasses.field(init=False)
    bubble_fraction: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        out_of_bounds = bounds.value_violations(self)
        if out_of_bounds:  # nothing is derived from a value out of bounds
            raise _invalid(self.model_name, out_of_bounds)
        derived = _derive(self)
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        problems = _violations(self)
        if problems:
            raise _invalid(self.model_name, problems)

    @property
    def using_pipeline(self) -> bool:
        """The decoder runs its layers through the pipeline (more than one stage)."""
        return self.num_stages > 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Mesh axis name -> size, in `MESH_AXES` order."""
        return {
            "data": self.ici_data_parallelism * self.dcn_data_parallelism,
            "stage": self.num_stages,
            "fsdp": self.ici_fsdp_parallelism,
            "tensor": self.ici_tensor_parallelism,
            "expert": self.ici_expert_parallelism,
        }

    @property
    def num_slices(self) -> int:
        """Slices the mesh spans (DCN): `dcn_data_parallelism x dcn_pipeline_parallelism`."""
        return self.dcn_data_parallelism * self.dcn_pipeline_parallelism

    @property
    def pipeline_flop_overhead(self) -> float:
        """Compiled stage visits over useful ones: `(M*R + d*(S-1)) / (M*R)`."""
        return self.num_iterations / (self.num_microbatches * self.num_repeats)

    def replace(self, **changes: Any) -> Config:
        """A new validated config with `changes` applied (same rules as overrides)."""
        return from_dict({**self.to_dict(), **changes}, source=f"{self.model_name} (replaced)")

    def to_dict(self) -> dict[str, Any]:
        """The settable keys and their values (derived values left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


_SETTABLE = {f.name: f for f in dataclasses.fields(Config) if f.init}
_short = bounds.short_repr


def _invalid(model_name: str, problems: Sequence[str]) -> ConfigError:
    """One problem on one line; several as a list."""
    head = f"config {_short(model_name)} is invalid:"
    if len(problems) == 1:
        return ConfigError(f"{head} {problems[0]}")
    return ConfigError(head + "".join(f"\n  - {p}" for p in problems))


def _derive(cfg: Config) -> dict[str, Any]:
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
        num_iterations=iterations,
        bubble_fraction=delay * (stages - 1) / iterations if iterations > 0 else 0.0,
    )


def _violations(cfg: Config) -> list[str]:
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
        ("remat_policy", REMAT_POLICIES),
        ("jax_default_prng_impl", PRNG_IMPLS),
    ):
        need(
            getattr(cfg, key) in allowed,
            f"{key}={getattr(cfg, key)!r}: must be one of {', '.join(allowed)}",
        )
    for key in ("learning_rate", "adam_eps"):
        need(getattr(cfg, key) > 0, f"{key}={getattr(cfg, key)}: must be > 0")
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
            "must be positive, or -1 for num_decoder_layers / (S*L)"
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


# ----------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return {int: "integer", float: "number", bool: "boolean (true/false)", str: "string"}.get(
        tp, str(tp)
    )


def _coerce(key: str, value: Any) -> Any:
    """`value` as the type that field `key` declares, or a ConfigError naming both."""
    field_type = typing.get_type_hints(Config)[key]
    if key == "logical_axis_rules":
        return _coerce_rules(value)
    if field_type is bool:
        if isinstance(value, bool):
            return value
    elif field_type is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif field_type is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and len(value) < 100:  # PyYAML reads `1e-5` as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is not None:
            try:
                number = float(number)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{key}={_short(value)}: must be a finite number")
            return number
    elif field_type is str and isinstance(value, str):
        return value
    raise ConfigError(
        f"{key}={_short(value)}: expected {_type_name(field_type)}, got {type(value).__name__}"
    )


def _coerce_rules(value: Any) -> Rules:
    message = (
        "logical_axis_rules: expected a list of [logical_name, mesh_axis | [mesh_axes] | "
        "null] pairs"
    )
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{message}, got {type(value).__name__}")
    rules = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ConfigError(f"{message}; entry {i} is {_short(pair)}")
        name, target = pair
        if isinstance(target, (list, tuple)):
            if not all(isinstance(a, str) for a in target):
                raise ConfigError(f"{message}; entry {i} is {_short(pair)}")
            target = tuple(target)
        elif target is not None and not isinstance(target, str):
            raise ConfigError(f"{message}; entry {i} is {_short(pair)}")
        rules.append((name, target))
    return tuple(rules)


def _check_known(keys: Iterable[str], source: str) -> None:
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {_short(key)} is not a string")
        if key not in _SETTABLE:
            close = difflib.get_close_matches(key, list(_SETTABLE), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown key {_short(key)}{hint}")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = safe_load.load_yaml(safe_load.read_text(path, MAX_CONFIG_BYTES, "config"), str(path))
    except safe_load.ParseError as e:
        raise ConfigError(str(e)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value, got {type(data).__name__}")
    _check_known(data, str(path))
    return data


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """MaxText-style `key=value` strings -> {key: value}, values parsed as YAML scalars/lists."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        _check_known([key], "override")
        try:
            parsed[key] = safe_load.load_yaml(raw, f"override {key}") if raw else ""
        except safe_load.ParseError as e:
            raise ConfigError(str(e)) from None
    return parsed


def from_dict(values: Mapping[str, Any], source: str = "config") -> Config:
    """A validated Config from a complete mapping of settable keys."""
    _check_known(values, source)
    missing = sorted(set(_SETTABLE) - set(values))
    if missing:
        raise ConfigError(f"{source}: missing keys: {', '.join(missing)}")
    return Config(**{k: _coerce(k, v) for k, v in values.items()})


# Schedule keys that weights do not depend on: reset when a layout change leaves them invalid.
SCHEDULE_DEFAULTS = {"num_pipeline_microbatches": -1, "pipeline_delay_activation_forwarding": False}


def with_changes(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """`cfg` with `changes`; schedule keys that no longer fit (M, delay) reset to defaults.

    Weights do not depend on the schedule, so a re-staged layout (S=2 where the config says
    S=4) need not also restate a microbatch count that fits it.
    """
    try:
        return cfg.replace(**changes)
    except ConfigError:
        return cfg.replace(**{**SCHEDULE_DEFAULTS, **changes})


def base_config_path(model_path: Path) -> Path:
    """`base.yml` beside the model YAML."""
    return model_path.parent / "base.yml"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # missing, unreadable or looping: read (and report) each on its own
        return False


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """base.yml, then the model YAML at `path`, then `key=value` overrides; validated."""
    model_path = Path(path)
    base_path = base_config_path(model_path)
    values = _read_yaml(base_path)
    if not _same_file(model_path, base_path):
        values.update(_read_yaml(model_path))
    values.update(parse_overrides(overrides))
    return from_dict(values, source=str(model_path))


__all__ = [
    "DTYPES",
    "MATMUL_PRECISIONS",
    "MESH_AXES",
    "PRNG_IMPLS",
    "REMAT_POLICIES",
    "SCHEDULE_DEFAULTS",
    "Config",
    "ConfigError",
    "from_dict",
    "load_config",
    "parse_overrides",
    "with_changes",
]
