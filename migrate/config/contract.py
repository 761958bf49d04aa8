"""A frozen, typed model config: every key, its type, its derived values, and the coercion of
raw values (YAML, `key=value`) to those types.

Key names follow MaxText. Derived values (S, M, R, L, microbatch size, iteration count, bubble
fraction) are computed once, in `Config.__post_init__` (`migrate.config.rules.derive`), and
every invalid combination is refused with a `ConfigError` naming the keys, their values and the
rule they break (`migrate.config.rules.violations`). Every size is held to a sane bound
(`migrate.config.bounds`) and every float must be finite *before* anything is derived from
them, so that no hostile value reaches JAX, a loop or an allocation. Reading files and
overrides: `migrate.config.loading`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from migrate.config import bounds, rules
from migrate.errors import BadInput

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


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
    # Dropout at MaxText's four sites (`migrate.common.dropout`): on in train steps when
    # `enable_dropout` and `dropout_rate > 0`; evaluation never drops.
    dropout_rate: float
    enable_dropout: bool

    per_device_batch_size: float
    # Packed sequences (MaxText's key): documents of random lengths share a row, each token
    # attending only to its own document (`migrate.common.packing`).
    packing: bool
    # Microbatches one optimizer step accumulates gradients over (MaxText's key): a step trains
    # on `gradient_accumulation_steps` batches of `global_batch_size` rows (`train_batch_size`).
    gradient_accumulation_steps: int
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
    remat_policy: str  # MaxText's names (`migrate.common.remat`)
    # `remat_policy: custom`'s place of each tagged tensor: remat, device or offload.
    decoder_layer_input: str
    context: str
    mlpwi: str
    mlpwi_0: str
    mlpwi_1: str
    mlpwo: str
    moe_mlpwi_0: str
    moe_mlpwi_1: str
    moe_mlpwo: str
    query_proj: str
    key_proj: str
    value_proj: str
    kv_proj: str
    qkv_proj: str
    attention_out: str
    out_proj: str

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
    train_batch_size: int = dataclasses.field(init=False)
    num_iterations: int = dataclasses.field(init=False)
    bubble_fraction: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        out_of_bounds = bounds.value_violations(self)
        if out_of_bounds:  # nothing is derived from a value out of bounds
            raise _invalid(self.model_name, out_of_bounds)
        derived = rules.derive(self)
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        problems = rules.violations(self)
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


def _type_name(tp: Any) -> str:
    return {int: "integer", float: "number", bool: "boolean (true/false)", str: "string"}.get(
        tp, str(tp)
    )


@functools.cache
def _field_types() -> dict[str, Any]:
    # Resolving the annotations takes ~1 ms; every Config made or replaced coerces every field.
    return typing.get_type_hints(Config)


def _coerce(key: str, value: Any) -> Any:
    """`value` as the type that field `key` declares, or a ConfigError naming both."""
    field_type = _field_types()[key]
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


def check_known(keys: Iterable[str], source: str) -> None:
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {_short(key)} is not a string")
        if key not in _SETTABLE:
            close = difflib.get_close_matches(key, list(_SETTABLE), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown key {_short(key)}{hint}")


def from_dict(values: Mapping[str, Any], source: str = "config") -> Config:
    """A validated Config from a complete mapping of settable keys."""
    check_known(values, source)
    missing = sorted(set(_SETTABLE) - set(values))
    if missing:
        raise ConfigError(f"{source}: missing keys: {', '.join(missing)}")
    return Config(**{k: _coerce(k, v) for k, v in values.items()})
