"""`pipeline` on MaxText: each release's pipelined decoder against its own decoder without
pipelining. The layout and the drill-down run everywhere (numpy only); the end-to-end verdicts
(a shape both releases compute correctly, one both compute wrongly) need the MaxText
environments (skipped, saying why, where they were not built)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
from hostile import REPO, run

from migrate import errors
from migrate.checkpoints.weight_map import WeightMapError
from parity.analysis import compare
from parity.maxtext import gate_config, oracle, pipeline_layout

MISSING = [s for s in gate_config.RELEASES if gate_config.default_python(s) is None]
needs_envs = pytest.mark.skipif(
    bool(MISSING) or sys.version_info < (3, 12),
    reason="MaxText runs on the default stack (Python 3.12) with make maxtext-envs built",
)
PIPE = pipeline_layout.PIPELINE
LEAF = ("mlp", "wi_0", "kernel")


def layout(stages=2, repeats=2, per_stage=2, outside=0, moe_first=False, scan_axis=1):
    pipelined = stages * repeats * per_stage
    return pipeline_layout.Layout(
        stages, repeats, per_stage, pipelined, pipelined + outside, scan_axis, moe_first
    )


def pipelined_tree(lay: pipeline_layout.Layout) -> dict:
    """Pipelined weights whose every value says which reference layer it is (r*S + s)*L + j
    (the layers outside the pipeline: P..N-1, or 0..N-P-1 for DeepSeek's, which run first)."""
    lead = ((lay.repeats,) if lay.repeats > 1 else ()) + (lay.stages,)
    tree = {("params", "decoder", "decoder_norm", "scale"): np.ones(4, np.float32)}
    for j in range(lay.per_stage):
        slot = (f"layers_{j}",) if lay.per_stage > 1 else ()
        values = np.zeros((lay.repeats, lay.stages, 4, 3), np.float32)
        for r in range(lay.repeats):
            for s in range(lay.stages):
                values[r, s] = lay.layer(r, s, j)
        tree[(*PIPE, *slot, *LEAF)] = values.reshape(*lead, 4, 3)
    count = lay.layers - lay.pipelined
    if count:
        first = 0 if lay.moe_first else lay.pipelined
        stack = np.stack([np.full((4, 3), first + i, np.float32) for i in range(count)], axis=1)
        tree[(*lay.outside, *LEAF)] = stack
    return tree


@pytest.mark.parametrize(
    "lay",
    [
        layout(),
        layout(stages=4, repeats=1, per_stage=1),
        layout(stages=4, repeats=2, per_stage=1, outside=2),
        layout(stages=2, repeats=1, per_stage=1, outside=3, moe_first=True),
    ],
    ids=["S2-R2-L2", "S4-R1-L1", "S4-R2-L1-subset", "deepseek-moe-first"],
)
def test_the_reference_stacks_layer_r_s_j_at_its_place_and_maps_back(lay):
    tree = pipelined_tree(lay)
    reference = pipeline_layout.to_reference(tree, lay)
    stack = reference[(*lay.reference, *LEAF)]
    assert stack.shape == (4, lay.layers, 3)
    for layer in range(lay.layers):
        assert np.all(np.take(stack, layer, axis=1) == layer), layer
    back = pipeline_layout.from_reference(reference, lay, tree)
    assert back.keys() == tree.keys()
    for path, value in tree.items():
        np.testing.assert_array_equal(back[path], value)


def test_the_layout_maps_strictly_both_ways():
    lay = layout()
    tree = pipelined_tree(lay)
    extra = {**tree, (*PIPE, "layers_2", *LEAF): tree[(*PIPE, "layers_0", *LEAF)]}
    with pytest.raises(WeightMapError, match=r"layers_2.*not a slot of 2 per stage"):
        pipeline_layout.to_reference(extra, lay)
    short = {**tree, (*PIPE, "layers_0", *LEAF): tree[(*PIPE, "layers_0", *LEAF)][:, :1]}
    with pytest.raises(WeightMapError, match=r"lacks the axes \(2, 2\)"):
        pipeline_layout.to_reference(short, lay)
    with pytest.raises(WeightMapError, match=r"R\*S\*L = 2\*2\*2 != P 6"):
        pipeline_layout.Layout(2, 2, 2, 6, 6, 1)
    reference = pipeline_layout.to_reference(tree, lay)
    unknown = {**reference, ("params", "decoder", "stray"): np.zeros(2)}
    with pytest.raises(WeightMapError, match="stray: of the reference only"):
        pipeline_layout.from_reference(unknown, lay, tree)


def test_the_reference_folds_the_stage_axes_into_data_and_drops_the_pipeline_keys():
    keys = {
        "ici_pipeline_parallelism": 4,
        "ici_fsdp_parallelism": 2,
        "dcn_pipeline_parallelism": 2,
        "num_pipeline_microbatches": 8,
        "num_pipeline_repeats": 2,
        "pipeline_fsdp_ag_per_repeat": True,
        "num_layers_per_pipeline_stage": 1,
        "base_num_decoder_layers": 16,
    }
    out = pipeline_layout.reference_overrides(keys)
    assert out == {
        "ici_fsdp_parallelism": 2,
        "ici_data_parallelism": 4,
        "dcn_data_parallelism": 2,
        "base_num_decoder_layers": 16,
        "scan_layers": True,
    }
    # An axis of -1 takes the devices the stage axis leaves: nothing is added to data.
    auto = pipeline_layout.reference_overrides({**keys, "ici_fsdp_parallelism": -1})
    assert "ici_data_parallelism" not in auto and auto["ici_fsdp_parallelism"] == -1


# ------------------------------------------------------------------ the drill-down's mapping


def captures(lay, microbatches, delay, rows=2, wrong=None):
    """Both runs' captures of one module per layer (`mlp`) and the final norm: the reference's
    rows are (layer + 1) * (microbatch + 1); the pipelined run's stage s at iteration t holds
    microbatch m of repeat r (t - delay*s processed) and computes layer (r*S + s)*L + j's rows
    for it, NaN in the bubbles. `wrong`: (iteration, stage) that computes with layer 0's
    weights."""
    width = 3
    reference_rows = lambda layer, m: np.full((rows, width), (layer + 1) * (m + 1), np.float32)
    arrays = {}
    for layer in range(lay.layers):
        whole = np.concatenate([reference_rows(layer, m) for m in range(microbatches)])
        arrays[("reference", "decoder/layers/mlp", str(layer), "0")] = whole
    iterations = microbatches * lay.repeats + delay * (lay.stages - 1)
    for t in range(iterations):
        for s in range(lay.stages):
            processed = t - delay * s
            if 0 <= processed < microbatches * lay.repeats:
                m, r = processed % microbatches, processed // microbatches
                layer = 0 if (t, s) == wrong else lay.layer(r, s, 0)
                value = reference_rows(layer, m)
            else:
                value = np.full((rows, width), np.nan, np.float32)
            arrays[
                ("pipelined", "decoder/pipeline_module/layers/mlp", str(t * lay.stages + s), "0")
            ] = value
    norm = np.ones((rows * microbatches, width), np.float32)
    for run_name in ("pipelined", "reference"):
        arrays[(run_name, "decoder/decoder_norm", "0", "0")] = norm
    order = ["decoder/pipeline_module/layers/mlp", "decoder/decoder_norm"]
    facts = {
        "layout": {**lay.__dict__},
        "delay": delay,
        "microbatches": microbatches,
        "pipelined_order": order,
        "reference_order": ["decoder/layers/mlp", "decoder/decoder_norm"],
    }
    return arrays, facts


@pytest.mark.parametrize("delay", [1, 2])
def test_the_drill_down_compares_each_stage_visit_with_its_layer_and_microbatch(delay):
    """Every visit that holds a microbatch is compared with the reference layer's rows of that
    microbatch (bubbles, NaN here, left out); the module after the pipeline call by call."""
    lay = layout(stages=4, repeats=2, per_stage=1)
    arrays, facts = captures(lay, microbatches=8, delay=delay)
    records = oracle._capture_records(arrays, facts, compare.F32_RESHAPED, "maxtext 0.2.5")
    staged = [r for r in records if "iteration" in r]
    assert len(staged) == 8 * 2 * 4  # every microbatch, repeat and stage once, no bubble
    assert all(r["passed"] and r["max_rel"] == 0.0 for r in records)
    visits = {(r["repeat"], r["stage"], r["microbatch"]) for r in staged}
    assert visits == {(r, s, m) for r in range(2) for s in range(4) for m in range(8)}
    assert {r["layer"] for r in staged} == set(range(8))
    assert records[-1]["module"] == "decoder/decoder_norm"  # after the pipeline, in data flow


def test_the_drill_down_names_the_first_visit_that_computes_with_the_wrong_weights():
    lay = layout(stages=4, repeats=2, per_stage=1)
    # Stage 2 at iteration 9 (processed 7: microbatch 7 of repeat 0, layer 2) runs layer 0.
    arrays, facts = captures(lay, microbatches=8, delay=1, wrong=(9, 2))
    records = oracle._capture_records(arrays, facts, compare.F32_RESHAPED, "maxtext 0.2.5")
    failing = [r for r in records if not r["passed"]]
    assert len(failing) == 1
    (first,) = failing
    assert (first["iteration"], first["stage"], first["layer"]) == (9, 2, 2)
    assert (first["microbatch"], first["repeat"]) == (7, 0)
    assert first["tensor"] == (
        "maxtext 0.2.5: decoder/pipeline_module/layers/mlp iteration 9 stage 2 "
        "(layer 2, microbatch 7, repeat 0)"
    )
    assert first["tier"] == "beyond"


# ------------------------------------------------------------------ end to end on both releases


def gate(tmp_path, config: str, *args: str) -> tuple[int, dict, str]:
    report = tmp_path / "report.json"
    result = run(
        "parity", "--maxtext", str(REPO / "configs" / "maxtext" / config), f"--json={report}",
        *args, timeout=900,
    )  # fmt: skip
    data = json.loads(report.read_text()) if report.exists() else {}
    return result.returncode, data, result.stderr.decode()


@pytest.mark.slow
@needs_envs
def test_per_repeat_gathering_at_four_stages_fails_its_own_reference_on_both_releases(tmp_path):
    """MaxText's `pipeline_fsdp_ag_per_repeat` at S=4, R=2, M=4 (agrepeat.yml's M=8 halved: the
    drill-down captures half the iterations): both releases agree bit for bit and both part
    from their own decoder without pipelining (the finding in docs/maxtext.md): exit 1, the
    difference MaxText's own, the first module, iteration and stage named."""
    shape = ("num_pipeline_microbatches=4", "per_device_batch_size=1")
    status, report, err = gate(tmp_path, "agrepeat.yml", *shape, "--checks=pipeline")
    assert status == errors.EXIT_FAIL, err[-3000:]
    (check,) = report["checks"]
    assert check["name"] == "pipeline" and check["status"] == "failed"
    summary = check["details"][0]
    assert summary["failing_releases"] == ["0.2.3", "0.2.5"]
    assert summary["whose"].startswith("both releases, bit-identically: MaxText's pipeline")
    logits = [r for r in check["details"] if r["tensor"].endswith("/logits")]
    assert len(logits) == 2 and all(r["max_rel"] > 0.5 for r in logits)  # off by their size
    # Where: stage 2 runs a visit of repeat 1 with repeat 0's weights (docs/maxtext.md).
    for release in ("0.2.3", "0.2.5"):
        where = summary["parts_at"][release]
        assert where.startswith(f"maxtext {release}: decoder/pipeline_module/layers/"), where
        assert " stage 2 " in where and "repeat 1)" in where, where
    assert "first parts at maxtext 0.2.3: decoder/pipeline_module/layers/" in check["message"]


def test_a_module_called_twice_per_layer_is_matched_whatever_order_its_captures_ran():
    """RoPE runs on the query and on the key: two captures per layer per visit, in an order XLA
    picks (`jax.debug.callback`s are unordered), in each run its own. Each pipelined capture
    is compared with the closer of its layer's two; a wrong value still fails."""
    lay = layout(stages=2, repeats=1, per_stage=1)
    microbatches, rows, module = 2, 2, "self_attention/rotary_embedding"
    value = lambda layer, m, o: np.full((rows, 3), 100 * o + 10 * layer + m + 1, np.float32)
    arrays = {}
    for layer in range(2):
        for o in range(2):
            whole = np.concatenate([value(layer, m, o) for m in range(microbatches)])
            arrays[("reference", f"decoder/layers/{module}", str(2 * layer + o), "0")] = whole
    iterations = microbatches + lay.stages - 1
    for t in range(iterations):
        for o in range(2):
            for s in range(lay.stages):
                m = t - s
                bubble = not 0 <= m < microbatches
                # the key's capture first at odd iterations; stage 1 at iteration 2 wrong
                got = value(s, m, (1 - o) if t % 2 else o) if not bubble else np.nan
                if (t, s, o) == (2, 1, 0):
                    got = value(0, m, 0)
                call = t * 2 * lay.stages + o * lay.stages + s
                path = f"decoder/pipeline_module/layers/{module}"
                arrays[("pipelined", path, str(call), "0")] = np.full((rows, 3), got, np.float32)
    # one module called once per visit (the MLP): what the iterations are counted by
    mlp = captures(lay, microbatches, delay=1, rows=rows)[0]
    arrays |= {k: v for k, v in mlp.items() if k[1].endswith("/mlp")}
    facts = {
        "layout": {**lay.__dict__},
        "delay": 1,
        "microbatches": microbatches,
        "pipelined_order": [f"decoder/pipeline_module/layers/{m}" for m in (module, "mlp")],
    }
    records = oracle._capture_records(arrays, facts, compare.F32_RESHAPED, "maxtext 0.2.3")
    rope = [r for r in records if r["module"].endswith(module)]
    assert len(rope) == 2 * 2 * microbatches  # two calls per visit, no bubble
    failing = [r for r in records if not r["passed"]]
    assert [(r["iteration"], r["stage"], r["layer"]) for r in failing] == [(2, 1, 1)]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            "subset.yml",
            "--against=twin: pipeline_parallel_layers=4 of 6 layers: the twins' map carries no "
            "MaxText layers_outside_pipeline",
        ),
        ("nopp.yml", "--against=twin: a pipelined config whose layers per stage are not scanned"),
    ],
)
def test_the_twin_as_a_second_oracle_is_refused_in_one_line_where_its_map_cannot_carry(
    config, message
):
    """Before any worker: the pipelined subset (its pipeline check holds each release to its own
    reference instead) and a config with no pipeline."""
    from parity.maxtext import twin_gate

    keys = gate_config.load(REPO / "configs" / "maxtext" / config, []).keys
    with pytest.raises(errors.BadInput) as refused:
        twin_gate.twins_config(keys)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_a_zero_element_leaf_the_reference_lacks_comes_back_empty():
    """0.2.3 builds DeepSeek's `dense_layers` with no layer (first_num_dense_layers 0) beside its
    pipeline, its reference none: nothing to re-lay, the gradient's empty array comes back."""
    lay = layout(stages=2, repeats=1, per_stage=1)
    tree = pipelined_tree(lay)
    empty = ("params", "decoder", "dense_layers", "mlp", "wi_0", "kernel")
    tree[empty] = np.zeros((4, 0, 3), np.float32)
    reference = pipeline_layout.to_reference(tree, lay)
    reference.pop(empty)  # the reference decoder builds no such leaf
    back = pipeline_layout.from_reference(reference, lay, tree)
    assert back[empty].shape == (4, 0, 3) and back[empty].dtype == np.float32


@pytest.mark.parametrize("block", ["gemma3", "llama4"])
def test_a_decoder_scanned_in_blocks_is_not_compared_and_says_why(block):
    """gemma3 and llama4 scan blocks of layers per step: the layer map does not carry them, so
    the oracle is skipped with the reason (never a crash of this tool, never a silent pass)."""

    pair = types.SimpleNamespace(
        keys={"ici_pipeline_parallelism": 4, "decoder_block": block, "dtype": "float32"}
    )
    result = oracle.pipeline(pair)
    assert result.status == "skipped"
    assert result.message.startswith(f"not compared: {block} scans its layers in blocks")


def test_several_layers_per_stage_map_each_slot_to_its_layer():
    """L=2: slot j of stage s is layer s*L + j (R=1); the stage's own call (its L layers as
    one module) has no counterpart in the reference and is left out."""
    lay = layout(stages=2, repeats=1, per_stage=2)
    microbatches, rows = 2, 2
    value = lambda layer, m: np.full((rows, 3), 10 * layer + m + 1, np.float32)
    arrays = {}
    for layer in range(4):
        whole = np.concatenate([value(layer, m) for m in range(microbatches)])
        arrays[("reference", "decoder/layers/mlp", str(layer), "0")] = whole
    prefix = "decoder/pipeline_module/layers"
    for t in range(microbatches + lay.stages - 1):
        for s in range(lay.stages):
            m = t - s
            for j, path in (
                (0, f"{prefix}/layers_0/mlp"),
                (1, f"{prefix}/layers_1/mlp"),
                (9, prefix),
            ):
                got = value(lay.layer(0, s, j), m) if 0 <= m < microbatches and j < 2 else np.nan
                arrays[("pipelined", path, str(t * lay.stages + s), "0")] = np.full(
                    (rows, 3), got, np.float32
                )
    facts = {
        "layout": {**lay.__dict__},
        "delay": 1,
        "microbatches": microbatches,
        "pipelined_order": [prefix, f"{prefix}/layers_0/mlp", f"{prefix}/layers_1/mlp"],
    }
    records = oracle._capture_records(arrays, facts, compare.F32_RESHAPED, "maxtext 0.2.3")
    assert {r["module"] for r in records} == {f"{prefix}/layers_0/mlp", f"{prefix}/layers_1/mlp"}
    assert all(r["passed"] and r["max_rel"] == 0.0 for r in records)
    assert {(r["stage"], r["layer"]) for r in records} == {(0, 0), (0, 1), (1, 2), (1, 3)}
