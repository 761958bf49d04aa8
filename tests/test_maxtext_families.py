"""MaxText's decoder families through the gate (`configs/maxtext/FAMILY.yml`): the release map
by the kind of parameter (gemma2's two attentions, deepseek's and llama4's routers), a stack of
zero layers on one release only (deepseek's `dense_layers` in 0.2.3) a note, not a failure.
The fast tests hold the comparisons to that rule on host arrays; the slow ones run the gate on
a family with few checks each (CI time), and in full on the families that hold every check."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_maxtext import gate, needs_envs

from migrate.errors import BadInput
from parity.analysis import compare, init_check
from parity.engine import result
from parity.maxtext import gate_config, release_pair

EMPTY = np.zeros((64, 0, 128), np.float32)  # one release's stack of no dense layer


def test_a_zero_element_leaf_on_one_side_only_is_a_note_and_one_on_both_is_a_leaf():
    linen = {"decoder": {"dense_layers": {"wo": EMPTY}, "norm": np.ones(4, np.float32)}}
    nnx = {"decoder": {"norm": np.ones(4, np.float32)}}
    records = result.keyed_records("grads", nnx, linen, compare.EXACT)
    empty = next(r for r in records if "dense_layers" in r["tensor"])
    assert empty["passed"] and empty["note"] == compare.one_sided_empty_note("Linen")
    assert all(r["passed"] for r in records)
    # present on both sides, a zero-element leaf is compared as a leaf: its shape and dtype
    other = {"decoder": {"dense_layers": {"wo": np.zeros((64, 0, 64), np.float32)}}}
    (shape,) = result.keyed_records(
        "grads", other, {"decoder": {"dense_layers": {"wo": EMPTY}}}, compare.EXACT
    )
    assert not shape["passed"] and "shape" in shape["note"]
    typed = {"decoder": {"dense_layers": {"wo": EMPTY.astype(np.float16)}}}
    (dtype,) = result.keyed_records(
        "grads", typed, {"decoder": {"dense_layers": {"wo": EMPTY}}}, compare.EXACT
    )
    assert not dtype["passed"] and "dtype" in dtype["note"]
    # a leaf with elements on one side only still fails
    (one,) = result.keyed_records("grads", {}, {"w": np.ones(2, np.float32)}, compare.EXACT)
    assert not one["passed"] and one["note"] == "on the Linen side only"


def test_init_notes_a_zero_element_leaf_on_one_side_only():
    linen = {"dense_layers": {"wo": EMPTY}, "w": np.ones(2, np.float32)}
    nnx = {"w": np.ones(2, np.float32), "extra": np.ones(2, np.float32)}
    records = {r["tensor"]: r for r in init_check.init_records(linen, nnx)}
    assert records["dense_layers/wo: present"]["passed"]
    assert records["dense_layers/wo: present"]["note"] == compare.one_sided_empty_note("Linen")
    assert not records["extra: present"]["passed"]


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


@needs_envs
@pytest.mark.slow
def test_gemma2s_local_and_global_attention_carry_the_declared_rename(tmp_path):
    """The attention rename declared by kind reaches `self_attention_local` and
    `self_attention_global`: the weights cross both ways bit-exact and each release's own
    initialisation agrees in names."""
    status, report, err = gate(tmp_path, "gemma2.yml", "--checks=roundtrip,init")
    assert status == 0, err[-3000:]
    init = _checks(report)["init"]
    names = {r["tensor"]: r for r in init["details"] if r["tensor"].endswith(": names")}
    local = "decoder/pipeline_module/layers/self_attention_local/key/kernel: names"
    assert names[local]["passed"] and "'embed'" in names[local]["linen"]


@needs_envs
@pytest.mark.slow
def test_deepseeks_empty_dense_stack_is_a_note_and_its_router_rename_is_declared(tmp_path):
    """Every layer MoE: 0.2.3 builds `dense_layers` with no layer, 0.2.5 none. The weights
    cross, the gradients and the placements agree; each of those leaves is a passed record
    that says so; the routers' `embed_moe` -> `embed_router` is mapped."""
    status, report, err = gate(
        tmp_path, "deepseekmoe.yml", "--checks=roundtrip,init,grads,sharding"
    )
    assert status == 0, err[-3000:]
    checks = _checks(report)
    note = compare.one_sided_empty_note("Linen")
    for name in ("init", "grads", "sharding"):
        noted = [r for r in checks[name]["details"] if "dense_layers" in r["tensor"]]
        assert noted and all(r["passed"] and r["note"] == note for r in noted), name
    router = "layers_0/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel: names"
    (record,) = [r for r in checks["init"]["details"] if r["tensor"].endswith(router)]
    assert record["passed"] and "embed_moe" in record["linen"]


@needs_envs
@pytest.mark.slow
def test_qwen3s_declared_tier_holds_its_gradient_and_its_sharding_change_fails(tmp_path):
    """qwen3's releases part in one gradient (docs/maxtext.md): its config declares the
    reordering tier with the cause; grads and train pass within it, naming that layer norm and
    why, and the sharding change that causes it still fails the run."""
    status, report, err = gate(tmp_path, "qwen3.yml", "--checks=grads,sharding,train")
    assert status == 1, err[-3000:]
    checks = _checks(report)
    assert checks["sharding"]["status"] == "failed"
    assert checks["sharding"]["worst"]["where"].endswith("post_self_attention_layer_norm/scale")
    for name in ("grads", "train"):
        check = checks[name]
        assert check["status"] == "passed", name
        assert check["worst"]["where"].endswith("layers/post_self_attention_layer_norm/scale")
        assert 0 < check["worst"]["value"] < 1e-6
        declared = check["details"][0]
        assert declared["tier"] == declared["held"] == "reordering", name
        assert "shard_mode" in declared["why"] and "why: " in check["message"]


FAMILY = "maxtext:\n  decoder_block: qwen3\n"


@pytest.mark.parametrize(
    ("gate", "fragment"),
    [
        ("gate:\n  tier: loose\n  why: x\n", "tier='loose': must be one of ['bit-exact'"),
        ("gate:\n  tier: reordering\n", "tier reordering needs `why`"),
        ("gate:\n  tier: reordering\n  why: '  '\n", "needs `why`"),
        ("gate:\n  tier: reordering\n  why: x\n  max_rel: 1\n", "unknown keys ['max_rel']"),
        ("gate: reordering\n", "gate: must be a mapping"),
        ("tier: reordering\n", "unknown top-level keys ['tier']"),
    ],
)
def test_a_declared_tier_is_read_strictly(tmp_path, gate, fragment):
    """Only a tier `compare.TIERS` knows, with the reason written beside it; nothing else."""
    path = tmp_path / "family.yml"
    path.write_text(FAMILY + gate)
    with pytest.raises(BadInput, match=re.escape(fragment)):
        gate_config.load(path, [])


def test_a_declared_tier_holds_the_numeric_checks_and_says_why(tmp_path):
    """qwen3's config declares `reordering` with its cause; the pair's numeric checks hold to
    it, and a result says which tier it held and why (a record and the message)."""
    config = gate_config.load(gate_config.loading.resolve("qwen3", "maxtext"), [])
    assert config.declared.tier == "reordering" and "shard_mode" in config.declared.why
    tol = release_pair.tolerance(config)
    assert tol.max_rel == compare.F32_RESHAPED.max_rel and "declared tier" in tol.reason
    assert release_pair.tolerance(gate_config.load("pp4", [])) is compare.EXACT
    eps = float(np.finfo(np.float32).eps)
    linen = {"scale": np.ones(4, np.float32), "w": np.ones(2, np.float32)}
    nnx = {"scale": np.ones(4, np.float32) * (1 + eps), "w": np.ones(2, np.float32)}
    records = result.keyed_records("grads", nnx, linen, tol)
    checked = release_pair.with_tiers(result.verdict("grads", records, tol), config.declared)
    assert checked.passed
    first, *rest = checked.details
    assert first["tensor"] == "declared tier" and first["held"] == "reordering"
    assert first["why"] == config.declared.why
    assert {r["tensor"]: r["tier"] for r in rest} == {
        "grads/scale": "reordering",
        "grads/w": "bit-exact",
    }
    assert "held: reordering" in checked.message and "why: 0.2.5's" in checked.message
    # undeclared: the records carry their tier, the message is the tolerance's alone
    exact = result.keyed_records("grads", nnx, linen, compare.EXACT)
    plain = release_pair.with_tiers(result.verdict("grads", exact, compare.EXACT), None)
    assert not plain.passed and plain.message == "required: " + compare.EXACT.reason
    assert [r["tier"] for r in plain.details] == ["reordering", "bit-exact"]


def test_a_difference_is_classified_by_tier():
    eps = float(np.finfo(np.float32).eps)
    assert compare.tier(0.0) == "bit-exact"
    assert compare.tier(17.5 * eps) == "reordering"
    assert compare.tier(65 * eps) == "beyond"


@needs_envs
@pytest.mark.slow
def test_layers_locates_deepseeks_difference_in_its_dense_layer(tmp_path):
    """The drill-down runs both releases on the same weights and names, by module path, the
    first capture that differs: the dense layer's first norm, its input (the embedding)
    bit-exact; every pipelined capture carries its iteration and stage. Every difference holds
    the reordering tier deepseek.yml declares with that cause."""
    status, report, err = gate(tmp_path, "deepseek.yml", "--checks=layers")
    assert status == 0, err[-3000:]
    layers = _checks(report)["layers"]
    assert layers["details"][0]["held"] == layers["details"][0]["tier"] == "reordering"
    records = [r for r in layers["details"] if "mismatches" in r]
    first = next(r for r in records if r["max_rel"] > 0)
    assert first["tensor"] == "decoder/dense_layers/pre_self_attention_layer_norm"
    assert records[0]["tensor"] == "token_embedder" and records[0]["tier"] == "bit-exact"
    stages = {(r["iteration"], r["stage"]) for r in records if "iteration" in r}
    assert stages == {(i, s) for i in range(7) for s in range(4)}
    assert {r["tier"] for r in records} == {"bit-exact", "reordering"}


@needs_envs
@pytest.mark.slow
def test_llama4s_sharding_reads_a_program_that_drops_an_unused_input(tmp_path):
    """Both releases' llama4 programs never read `inputs_position` (jit drops it): the
    sharding check labels the arrays by path and passes."""
    status, report, err = gate(tmp_path, "llama4.yml", "--checks=sharding")
    assert status == 0, err[-3000:]
    labels = [r["tensor"] for r in _checks(report)["sharding"]["details"]]
    assert not any("inputs_position" in label for label in labels)
