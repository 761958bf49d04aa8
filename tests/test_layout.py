"""Pipeline <-> reference layout (the placement formula applied to weights)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny

from migrate.common import axes, layout, placement, schedule

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


def _reference(cfg, feature=3):
    """A reference stack whose row n holds the value n everywhere."""
    n = cfg.base_num_decoder_layers
    return {"w": np.broadcast_to(np.arange(n, dtype=np.float32)[:, None], (n, feature)).copy()}


@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-scan", "llama2-tiny-delay"])
@pytest.mark.parametrize("repeats", [1, 2])
def test_round_trip_and_placement(name, repeats):
    cfg = tiny(name)
    per_stage = cfg.base_num_decoder_layers // (cfg.num_stages * cfg.num_repeats)
    cfg = cfg.replace(
        num_pipeline_repeats=repeats, base_num_decoder_layers=cfg.num_stages * per_stage * repeats
    )
    ref = _reference(cfg)
    pipe = layout.reference_to_pipeline(ref, cfg)
    for layer, (r, s, j) in schedule.placement(cfg).items():
        if cfg.scan_layers_per_stage:
            leaf = pipe["layers"]["w"]
            value = leaf[r, s, j] if repeats > 1 else leaf[s, j]
        else:
            leaf = pipe[f"layers_{j}"]["w"]
            value = leaf[r, s] if repeats > 1 else leaf[s]
        assert np.all(value == layer)
    back = layout.pipeline_to_reference(pipe, cfg)
    np.testing.assert_array_equal(back["w"], ref["w"])


def test_names_round_trip():
    cfg = tiny("llama2-tiny-scan")
    ref_names = (axes.REFERENCE_LAYERS, *axes.QUERY)
    pipe_names = layout.reference_names_to_pipeline(ref_names, cfg)
    assert pipe_names == ("circular_repeats", "layers", "layers_per_stage", *axes.QUERY)
    assert layout.pipeline_names_to_reference(pipe_names, cfg) == ref_names


def test_layout_errors_name_the_problem():
    cfg = tiny("llama2-tiny")
    with pytest.raises(layout.LayoutError, match=r"keys \['layers'\], config expects"):
        layout.pipeline_to_reference({"layers": {}}, cfg)
    with pytest.raises(layout.LayoutError, match="does not start with the stacked axes"):
        layout.pipeline_to_reference({"layers_0": {"w": np.zeros((3, 4, 2))}}, cfg)
    with pytest.raises(layout.LayoutError, match="base_num_decoder_layers=8"):
        layout.reference_to_pipeline({"w": np.zeros((7, 2))}, cfg)
    with pytest.raises(layout.LayoutError, match="do not start with"):
        layout.pipeline_names_to_reference(("layers", "embed"), cfg)


# ------------------------------------------------------------------ a pipelined subset


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama2-tiny-subset", ()),
        # MaxText's odd remainder: 61 layers, 56 pipelined (S=4, R=14), 5 after the pipeline.
        (
            "llama2-tiny",
            (
                "base_num_decoder_layers=61",
                "pipeline_parallel_layers=56",
                "num_pipeline_repeats=14",
            ),
        ),
        # The subset with two scanned layers per stage visit.
        ("llama2-tiny-subset", ("num_layers_per_pipeline_stage=2", "num_pipeline_repeats=1")),
    ],
)
def test_subset_split_join_follow_the_placement(name, overrides):
    cfg = tiny(name, *overrides)
    ref = _reference(cfg)
    stages, after = layout.split_reference(ref, cfg)
    rows_after = 0
    for place in placement.placements(cfg):
        if place.in_pipeline:
            leaf = stages[f"layers_{place.slot}"]["w"]
            value = leaf[place.repeat, place.stage] if cfg.num_repeats > 1 else leaf[place.stage]
        else:
            value = after["w"][place.row_after_pipeline]
            rows_after += 1
        assert np.all(value == place.layer), place
    assert rows_after == cfg.num_layers_after_pipeline == after["w"].shape[0]
    np.testing.assert_array_equal(layout.join_reference(stages, after, cfg)["w"], ref["w"])


def test_placement_of_the_odd_remainder():
    cfg = tiny(
        "llama2-tiny",
        "base_num_decoder_layers=61",
        "pipeline_parallel_layers=56",
        "num_pipeline_repeats=14",
    )
    assert placement.place(cfg, 55).describe() == "stage 3, repeat 13, slot 0"
    assert placement.place(cfg, 56).describe() == "after the pipeline, row 0"
    assert placement.place(cfg, 60).describe() == "after the pipeline, row 4"
    assert placement.work_overhead(cfg) == pytest.approx((56 * (8 * 14 + 3) / (8 * 14) + 5) / 61)
    with pytest.raises(IndexError, match=r"layers 0\.\.60"):
        placement.place(cfg, 61)
    # All pipelined: no layers after the pipeline, and the formula as before.
    full = tiny("llama2-tiny")
    assert not placement.has_layers_after_pipeline(full)
    assert placement.work_overhead(full) == full.pipeline_flop_overhead


def test_subset_names_and_errors():
    cfg = tiny("llama2-tiny-subset")
    ref_names = (axes.REFERENCE_LAYERS, *axes.MLP_IN)
    after_names = layout.reference_names_to_after_pipeline(ref_names)
    assert after_names == (axes.LAYERS_AFTER_PIPELINE, *axes.MLP_IN)
    assert layout.after_pipeline_names_to_reference(after_names) == ref_names
    stages, after = layout.split_reference(_reference(cfg), cfg)
    with pytest.raises(layout.LayoutError, match=r"layers_after_pipeline is missing.* runs 2"):
        layout.join_reference(stages, None, cfg)
    with pytest.raises(layout.LayoutError, match="num_layers_after_pipeline=2"):
        layout.join_reference(stages, {"w": after["w"][:1]}, cfg)
    with pytest.raises(layout.LayoutError, match="base_num_decoder_layers=10"):
        layout.split_reference({"w": np.zeros((8, 2))}, cfg)
