"""Pipeline <-> reference layout (the placement formula applied to weights)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny

from migrate import axes, layout, schedule


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
