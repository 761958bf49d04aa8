"""The placement formula and the GPipe schedule."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny

from migrate.common import schedule

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


def test_placement_example_of_pipeline_md():
    # 24 layers, S=4, L=3, R=2: stage 0 runs layers 0-2 and 12-14.
    cfg = tiny(
        "llama2-tiny",
        "base_num_decoder_layers=24",
        "num_layers_per_pipeline_stage=3",
        "num_pipeline_repeats=2",
    )
    assert schedule.stage_layers(cfg, 0) == [0, 1, 2, 12, 13, 14]
    assert schedule.stage_layers(cfg, 3) == [9, 10, 11, 21, 22, 23]
    assert schedule.layer_index(1, 2, 1, 4, 3) == 19


def test_placement_is_a_bijection_in_row_major_order():
    cfg = tiny("llama2-tiny-scan")
    place = schedule.placement(cfg)
    assert sorted(place) == list(range(cfg.base_num_decoder_layers))
    rsl = np.arange(cfg.base_num_decoder_layers).reshape(
        cfg.num_repeats, cfg.num_stages, cfg.layers_per_stage
    )
    for layer, (r, s, j) in place.items():
        assert rsl[r, s, j] == layer


def test_layer_index_rejects_out_of_range():
    with pytest.raises(ValueError, match="slot 3"):
        schedule.layer_index(0, 0, 3, 4, 3)
    with pytest.raises(ValueError, match="stage 4"):
        schedule.layer_index(0, 4, 0, 4, 3)


def _simulate(cfg):
    """Per (stage, iteration): (microbatch, repeat) or None for a bubble."""
    table = {}
    for t in range(cfg.num_iterations):
        micro, repeat, valid = (np.asarray(a) for a in schedule.stage_work(cfg, t))
        for s in range(cfg.num_stages):
            table[s, t] = (int(micro[s]), int(repeat[s])) if valid[s] else None
    return table


@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-delay"])
def test_every_stage_sees_every_microbatch_and_repeat_once_in_order(name):
    cfg = tiny(name)
    table = _simulate(cfg)
    for s in range(cfg.num_stages):
        work = [table[s, t] for t in range(cfg.num_iterations) if table[s, t] is not None]
        expected = [(m, r) for r in range(cfg.num_repeats) for m in range(cfg.num_microbatches)]
        assert work == expected
        # Stage s starts d*s iterations after stage 0.
        first = min(t for t in range(cfg.num_iterations) if table[s, t] is not None)
        assert first == cfg.forwarding_delay * s


@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-delay"])
def test_stage_input_was_produced_by_the_left_neighbour_d_iterations_earlier(name):
    cfg = tiny(name)
    table = _simulate(cfg)
    d = cfg.forwarding_delay
    for (s, t), work in table.items():
        if work is None or s == 0:
            continue
        assert table[s - 1, t - d] == work


def test_bubble_count_matches_the_bubble_fraction():
    cfg = tiny("llama2-tiny")
    table = _simulate(cfg)
    bubbles = sum(v is None for v in table.values())
    assert bubbles / len(table) == pytest.approx(cfg.bubble_fraction)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama2-tiny-agrepeat", ()),
        ("llama2-tiny-delay", ("pipeline_fsdp_ag_per_repeat=true",)),
        ("llama2-tiny", ("pipeline_fsdp_ag_per_repeat=true",)),
    ],
)
def test_each_block_window_holds_every_stage_repeat(name, overrides):
    """`pipeline_fsdp_ag_per_repeat`: during block b (iterations b*M .. b*M + M - 1, block R
    the drain) every stage's repeat, bubbles' clipped ones too, is one of the two repeats
    `window_start(b), window_start(b) + 1`; and the window moves (traced and Python agree)."""
    cfg = tiny(name, *overrides)
    m, r = cfg.num_microbatches, cfg.num_repeats
    starts = []
    for t in range(cfg.num_iterations):
        block = min(t // m, r)
        start = schedule.window_start(cfg, block)
        assert int(schedule.window_start(cfg, np.int32(block))) == start
        _, repeats, _ = (np.asarray(a) for a in schedule.stage_work(cfg, t))
        assert set((repeats - start).tolist()) <= {0, 1}, (t, repeats, start)
        starts.append(start)
    assert starts[0] == 0 and starts[-1] == r - 2
