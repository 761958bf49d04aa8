"""MaxText 0.2.5's NNX decoder against the project's NNX twin (`parity --maxtext CONFIG
--against=twin`), and the twins <-> MaxText map beyond one layer per stage: several layers per
stage and circular repeats, strict both ways. The map's facts run everywhere; the end-to-end
runs need the MaxText environments (skipped, saying why, where they were not built)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from hostile import REPO, run

from migrate.checkpoints import maxtext_layouts
from migrate.checkpoints.weight_map import WeightMapError
from migrate.common import layout
from migrate.config.loading import SHIPPED, load_config
from parity.maxtext import gate_batch, gate_config

MISSING = [s for s in gate_config.RELEASES if gate_config.default_python(s) is None]
needs_envs = pytest.mark.skipif(
    bool(MISSING) or sys.version_info < (3, 12),
    reason="MaxText runs on the default stack (Python 3.12) with make maxtext-envs built",
)
LAYER = {  # one decoder layer's leaves (no stacked axes), tiny
    ("mlp", "wi_0", "kernel"): (4, 8),
    ("pre_self_attention_layer_norm", "scale"): (4,),
    ("self_attention", "query", "kernel"): (4, 2, 4),
}


def maxtext_tree(repeats: int, stages: int, per_stage: int) -> dict:
    """A MaxText pipeline tree (flat) whose every value says which layer it is: (r*S + s)*L + j."""
    lead = ((repeats,) if repeats > 1 else ()) + (stages,)
    rows = np.arange(repeats * stages * per_stage).reshape(repeats, stages, per_stage)
    out = {
        ("token_embedder", "embedding"): np.ones((16, 4), np.float32),
        ("decoder", "decoder_norm", "scale"): np.ones(4, np.float32),
        ("decoder", "logits_dense", "kernel"): np.ones((4, 16), np.float32),
    }
    for j in range(per_stage):
        slot = () if per_stage == 1 else (f"layers_{j}",)
        for path, shape in LAYER.items():
            index = rows[..., j].reshape(lead)
            out[("decoder", "pipeline_module", "layers", *slot, *path)] = np.broadcast_to(
                index.reshape(*lead, *(1,) * len(shape)), (*lead, *shape)
            ).astype(np.float32)
    return out


@pytest.mark.parametrize(
    ("repeats", "stages", "per_stage"), [(1, 4, 1), (1, 4, 2), (2, 4, 1), (2, 2, 2)]
)
def test_several_layers_per_stage_and_repeats_map_to_the_reference_in_layer_order_and_back(
    repeats, stages, per_stage
):
    tree = maxtext_tree(repeats, stages, per_stage)
    shape = (repeats, stages, per_stage)
    for kind in ("params", "mu", "nu"):
        reference = maxtext_layouts.to_reference(tree, 16, kind, "pipeline", shape)
        norm = reference[("layers", "pre_self_attention_layer_norm", "scale")]
        # layer (r*S + s)*L + j at row (r*S + s)*L + j: the twins' placement formula
        assert norm.shape == (repeats * stages * per_stage, 4)
        assert (norm[:, 0] == np.arange(norm.shape[0])).all()
        query = reference[("layers", "self_attention", "query", "kernel")]
        scale = maxtext_layouts.query_scale(16, kind)
        assert (query[:, 0, 0, 0] == np.arange(norm.shape[0]) * np.float32(scale)).all()
        back = maxtext_layouts.from_reference(reference, 16, kind, "pipeline", shape)
        assert sorted(back) == sorted(tree)
        assert all(back[p].tobytes() == np.ascontiguousarray(tree[p]).tobytes() for p in tree)


def test_the_map_stacks_as_the_twins_own_layout_does():
    """MaxText's [R, S] stacking, mapped onto the twins' pipeline layout, is the layout the
    twins' own `reference_to_pipeline` makes of the same reference weights."""
    cfg = load_config(
        SHIPPED / "base.yml",
        ["ici_pipeline_parallelism=2", "num_pipeline_repeats=2", "base_num_decoder_layers=8",
         "num_layers_per_pipeline_stage=2", "num_pipeline_microbatches=2"],
    )  # fmt: skip
    tree = maxtext_tree(2, 2, 2)
    reference = maxtext_layouts.to_reference(tree, 16, "params", "pipeline", (2, 2, 2))
    layers = {p[1:]: a for p, a in reference.items() if p[0] == "layers"}
    ours = layout.reference_to_pipeline(_nested(layers), cfg)
    staged = maxtext_layouts.pipeline_map(16, 2).forward(tree)
    for j in range(2):
        for path in LAYER:
            mine = staged[("pipeline", "layers", f"layers_{j}", *path)]
            theirs = _get(ours[f"layers_{j}"], path)
            assert mine.tobytes() == np.ascontiguousarray(theirs).tobytes()


def test_the_map_refuses_a_missing_slot_an_extra_slot_and_a_wrong_stacking():
    tree = maxtext_tree(2, 4, 2)
    dropped = {p: a for p, a in tree.items() if "layers_1" not in p}
    with pytest.raises(WeightMapError, match="slots"):
        maxtext_layouts.to_reference(dropped, 16, "params", "pipeline", (2, 4, 2))
    extra = {**tree, ("decoder", "pipeline_module", "layers", "layers_2", "mlp", "wo", "kernel"): (
        np.zeros((2, 4, 8, 4), np.float32))}  # fmt: skip
    with pytest.raises(WeightMapError, match="no entry"):
        maxtext_layouts.to_reference(extra, 16, "params", "pipeline", (2, 4, 2))
    with pytest.raises(WeightMapError, match="lacks the axes"):  # R=2 read as R=4
        maxtext_layouts.to_reference(tree, 16, "params", "pipeline", (4, 4, 2))
    reference = maxtext_layouts.to_reference(tree, 16, "params", "pipeline", (2, 4, 2))
    with pytest.raises(WeightMapError, match="layers"):  # 16 layers read as 8
        maxtext_layouts.from_reference(reference, 16, "params", "pipeline", (1, 4, 2))


def test_the_map_renames_maxtexts_embed_vocab_and_gives_it_back():
    names = {
        ("token_embedder", "embedding"): ("vocab", "embed_vocab"),
        ("decoder", "logits_dense", "kernel"): ("embed_vocab", "vocab"),
        ("decoder", "pipeline_module", "layers", "layers_0", "mlp", "wo", "kernel"): (
            "circular_repeats", "layers", "mlp", "embed"),
    }  # fmt: skip
    table = maxtext_layouts.pipeline_map(16, 2)
    twins = table.names(names)
    assert twins[("token_embedder", "embedding")] == ("vocab", "embed")
    assert twins[("logits_dense", "kernel")] == ("embed", "vocab")
    assert table.names(twins, forward=False) == names
    with pytest.raises(WeightMapError, match="rename"):  # already the twins' name: undeclared
        table.names({("token_embedder", "embedding"): ("vocab", "embed")})


def _nested(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _get(tree: dict, path: tuple) -> np.ndarray:
    for key in path:
        tree = tree[key]
    return tree


# The failures measured on every shape (docs/maxtext.md, "MaxText 0.2.5 against the NNX twin"):
# the placements both decoders choose differently (the twins shard vocab over stage too, MaxText
# shards its batch over every axis), their compiled shardings and collectives, and the cost.
PLACEMENTS = (
    "token_embedder/embedding",
    "logits_dense/kernel",
    "batch/",
    "output: logits",
    "collectives",
)


@needs_envs
@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "keys"),
    [("lps2", ()), ("circular", ("num_pipeline_microbatches=4", "per_device_batch_size=1"))],
)
def test_maxtext_0_2_5_against_the_nnx_twin_on_several_layers_per_stage_and_repeats(
    shape, keys, tmp_path
):
    report = tmp_path / "report.json"
    done = run(
        "parity", "--maxtext", str(REPO / "configs" / "maxtext" / f"{shape}.yml"), *keys,
        "--against=twin", "--checks=roundtrip,forward,grads,train,sharding,compile",
        "--steps=1", f"--json={report}", timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr.decode()[-2000:]
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert checks["roundtrip"]["passed"] and checks["roundtrip"]["worst"]["value"] == 0
    for name in ("forward", "grads"):  # the tier of two programs, with room measured
        assert checks[name]["passed"] and checks[name]["worst"]["value"] < 2e-6
    train = checks["train"]
    first = train["steps"][0]
    assert not train["passed"] and abs(first["loss_linen"] / first["loss_nnx"] - 1) < 1e-6
    failed = [r["tensor"] for r in checks["sharding"]["details"] if not r["passed"]]
    assert failed and all(any(p in t for p in PLACEMENTS) for t in failed), failed
    assert not checks["compile"]["passed"]


def test_a_packed_maxtext_batch_holds_documents_counted_from_zero_then_padding():
    keys = {"per_device_batch_size": 2, "max_target_length": 32, "vocab_size": 64}
    unpacked = gate_batch.batch(keys, 8, 0, 0, "train")
    packed = gate_batch.batch({**keys, "packing": True}, 8, 0, 0, "train")
    assert np.array_equal(packed["inputs"], unpacked["inputs"])  # the same tokens
    assert (unpacked["inputs_segmentation"] == 1).all()
    segments, positions = packed["inputs_segmentation"], packed["inputs_position"]
    assert np.array_equal(packed["targets_segmentation"], segments)
    for row_segments, row_positions in zip(segments, positions, strict=True):
        real = int((row_segments != 0).sum())
        assert real >= 32 - 8 and not row_segments[real:].any() and row_segments[0] == 1
        steps = np.diff(row_segments[:real])
        assert set(steps.tolist()) <= {0, 1}
        expected = np.concatenate([np.arange(n) for n in np.bincount(row_segments[:real])[1:]])
        assert np.array_equal(row_positions[:real], expected)
    assert segments.max() > 2  # several documents per row


@needs_envs
@pytest.mark.slow
def test_maxtext_0_2_5_packs_sequences_as_the_twin_does(tmp_path):
    """Packed rows (several documents, padding) through MaxText 0.2.5's pipelined decoder and
    the NNX twin: the same logits and gradients in float32's reshaped tier, so its segment ids
    and positions reach every microbatch's attention as the twin's do."""
    report = tmp_path / "report.json"
    done = run(
        "parity", "--maxtext", str(REPO / "configs" / "maxtext" / "pp4.yml"), "packing=true",
        "--against=twin", "--checks=forward,grads", f"--json={report}", timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert all(checks[name]["worst"]["value"] < 2e-6 for name in ("forward", "grads"))


@pytest.mark.slow
def test_against_is_refused_without_maxtext(capsys):
    from parity import cli

    argv = cli.FLAGS(["parity", "llama2-tiny", "--against=twin"])
    try:
        assert cli.run(argv) == 2
    finally:
        cli.FLAGS.unparse_flags()
    assert "--against: only with --maxtext" in capsys.readouterr().err
