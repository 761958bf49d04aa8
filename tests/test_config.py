"""Config loading, overrides, derived values, and every validation rule's message."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import CONFIG_DIR, SHIPPED_TINY_CONFIGS, tiny

from migrate.config.contract import ConfigError
from migrate.config.loading import load_config, parse_overrides

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


@pytest.mark.parametrize("name", [*SHIPPED_TINY_CONFIGS, "llama2-7b", "mixtral-8x7b", "base"])
def test_every_shipped_config_loads(name):
    cfg = load_config(CONFIG_DIR / f"{name}.yml")
    assert cfg.model_name == name if name != "base" else cfg.model_name == "base"


def test_derived_values_of_the_default_config():
    cfg = tiny("llama2-tiny")
    assert (cfg.num_stages, cfg.num_microbatches, cfg.num_repeats, cfg.layers_per_stage) == (
        4,
        8,
        2,
        1,
    )
    assert cfg.num_devices == 8 and cfg.global_batch_size == 16 and cfg.microbatch_size == 2
    assert cfg.gradient_accumulation_steps == 1 and cfg.train_batch_size == 16
    accumulating = tiny("llama2-tiny", "gradient_accumulation_steps=3")
    assert (accumulating.global_batch_size, accumulating.train_batch_size) == (16, 48)
    assert accumulating.microbatch_size == 2  # the pipeline splits each accumulated batch
    assert cfg.num_iterations == 8 * 2 + 3
    assert math.isclose(cfg.bubble_fraction, 3 / 19)
    assert math.isclose(cfg.pipeline_flop_overhead, 19 / 16)


def test_minus_one_defaults_resolve():
    cfg = tiny("llama2-tiny", "num_pipeline_microbatches=-1", "num_pipeline_repeats=-1")
    assert cfg.num_microbatches == 4 and cfg.num_repeats == 2
    delayed = tiny("llama2-tiny-delay", "num_pipeline_microbatches=-1")
    assert delayed.num_microbatches == 8 and delayed.forwarding_delay == 2
    assert delayed.num_iterations == 8 * 2 + 2 * 3


def test_overrides_are_typed_and_applied_last():
    cfg = tiny(
        "llama2-tiny", "seed=7", "normalization_layer_epsilon=1e-6", "pipeline_fsdp_ag_once=true"
    )
    assert cfg.seed == 7 and cfg.normalization_layer_epsilon == 1e-6
    assert cfg.pipeline_fsdp_ag_once is True


def test_config_is_frozen_and_replace_revalidates():
    cfg = tiny("llama2-tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    assert cfg.replace(seed=3).seed == 3
    with pytest.raises(ConfigError, match="multiple of S"):
        cfg.replace(num_pipeline_microbatches=6)


def test_unknown_key_in_override_suggests_the_closest():
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'num_pipeline_microbatchs'; did you mean "
        r"'num_pipeline_microbatches'\?",
    ):
        tiny("llama2-tiny", "num_pipeline_microbatchs=4")


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    (tmp_path / "base.yml").write_text((CONFIG_DIR / "base.yml").read_text())
    model = tmp_path / "m.yml"
    model.write_text("base_emb_dimm: 32\n")
    with pytest.raises(
        ConfigError,
        match=r"m\.yml: unknown key 'base_emb_dimm'; did you mean "
        r"'base_emb_dim'",
    ):
        load_config(model)


def test_yaml_is_parsed_safely(tmp_path):
    (tmp_path / "base.yml").write_text((CONFIG_DIR / "base.yml").read_text())
    model = tmp_path / "evil.yml"
    model.write_text("seed: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(model)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yml")
    (tmp_path / "base.yml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "base.yml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("base_emb_dim=abc", "base_emb_dim='abc': expected integer, got str"),
        ("scan_layers_per_stage=1", "scan_layers_per_stage=1: expected boolean"),
        ("normalization_layer_epsilon=yes", "normalization_layer_epsilon=True: expected number"),
        ("dtype=3", "dtype=3: expected string, got int"),
        ("logical_axis_rules=[[embed]]", "logical_axis_rules: expected a list of"),
    ],
)
def test_wrong_type_names_the_key_and_the_expected_type(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        tiny("llama2-tiny", override)


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["seed"])


# Each rule: overrides that break only it, and the words its message must contain.
RULES = [
    (("base_emb_dim=0",), ["base_emb_dim=0", "positive integer"]),
    (("dtype=float16",), ["dtype='float16'", "float32, bfloat16"]),
    (("jax_default_prng_impl=philox",), ["jax_default_prng_impl='philox'", "threefry2x32"]),
    (("matmul_precision=fast",), ["matmul_precision='fast'", "default, high, highest"]),
    (("remat_policy=some",), ["remat_policy='some'", "save_dot_except_mlp"]),
    (("remat_policy=custom", "out_proj=host"), ["out_proj='host'", "remat, device, offload"]),
    (
        ("packing=true", "gradient_accumulation_steps=2"),
        ["packing=true", "gradient_accumulation_steps=2", "unequally"],
    ),
    (("normalization_layer_epsilon=0",), ["normalization_layer_epsilon=0.0", "> 0"]),
    (("rope_min_timescale=20000",), ["rope_min_timescale=20000.0", "rope_max_timescale=10000.0"]),
    (("head_dim=15",), ["head_dim=15", "must be even"]),
    (("base_num_kv_heads=3",), ["base_num_query_heads=4", "base_num_kv_heads=3", "multiple of"]),
    (
        ("ici_tensor_parallelism=8", "ici_pipeline_parallelism=1", "ici_fsdp_parallelism=1"),
        ["base_num_query_heads=4", "ici_tensor_parallelism=8", "divisible by the tensor axis"],
    ),
    (("base_emb_dim=63",), ["base_emb_dim=63", "ici_fsdp_parallelism=2", "fsdp axis"]),
    (("vocab_size=254",), ["vocab_size=254", "tensor=1, stage=4", "tensor x stage"]),
    (("per_device_batch_size=0.1",), ["per_device_batch_size=0.1", "positive integer"]),
    (("gradient_accumulation_steps=0",), ["gradient_accumulation_steps=0", "positive integer"]),
    (("gradient_accumulation_steps=2000",), ["gradient_accumulation_steps=2000", "1..1024"]),
    (
        ("ici_pipeline_parallelism=1", "ici_data_parallelism=3", "per_device_batch_size=0.5"),
        [
            "global batch 3",
            "ici_data_parallelism=3",
            "ici_fsdp_parallelism=2",
            "divisible by data x fsdp",
        ],
    ),
    (("logical_axis_rules=[[embed, model]]",), ["'embed' -> 'model'", "unknown mesh axis"]),
    (
        ("num_pipeline_repeats=3",),
        [
            "S=4",
            "num_layers_per_pipeline_stage=1",
            "num_pipeline_repeats=3 (R=3)",
            "base_num_decoder_layers=8",
            "S*L*R == base_num_decoder_layers",
        ],
    ),
    (("num_pipeline_microbatches=6",), ["num_pipeline_microbatches=6", "S=4", "multiple of S"]),
    (("num_pipeline_microbatches=0",), ["num_pipeline_microbatches=0", "or -1"]),
    (("num_pipeline_repeats=0",), ["num_pipeline_repeats=0", "or -1"]),
    (
        ("pipeline_delay_activation_forwarding=true", "num_pipeline_microbatches=4"),
        ["pipeline_delay_activation_forwarding=true", "num_pipeline_microbatches=4", "M >= 2S"],
    ),
    (
        ("num_pipeline_microbatches=12",),
        ["global batch 16", "num_pipeline_microbatches=12", "divisible by M"],
    ),
    (
        ("num_pipeline_microbatches=16",),
        ["microbatch size 1", "M=16", "each microbatch must split over data x fsdp"],
    ),
    (
        ("pipeline_fsdp_ag_per_repeat=true", "num_pipeline_repeats=1", "base_num_decoder_layers=4"),
        ["pipeline_fsdp_ag_per_repeat=true", "num_pipeline_repeats=1 (R=1)", "R >= 2"],
    ),
]


@pytest.mark.parametrize(("overrides", "words"), RULES, ids=[" ".join(o) for o, _ in RULES])
def test_every_rule_names_keys_values_and_rule(overrides, words):
    with pytest.raises(ConfigError) as raised:
        tiny("llama2-tiny", *overrides)
    message = str(raised.value)
    assert "config 'llama2-tiny' is invalid" in message or "llama2-tiny" in message
    for word in words:
        assert word in message, f"{word!r} not in:\n{message}"


def test_all_violations_are_listed_at_once():
    with pytest.raises(ConfigError) as raised:
        tiny("llama2-tiny", "head_dim=15", "num_pipeline_microbatches=6")
    assert "head_dim=15" in str(raised.value) and "multiple of S" in str(raised.value)
