"""The pipeline loop's communication: the schedule's scalar bookkeeping, the rotation's transpose,
the HLO reading behind the compile check's loop-body gate (held on every shipped config by the
config matrix, tests/test_cli.py), and a seeded extra collective that the gate must catch
(monkeypatched into the NNX side)."""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIG_DIR, TINY_CONFIGS, tiny

import migrate.nnx.pipeline as nnx_pipeline
from migrate.common import schedule
from parity import cli
from parity.analysis import hlo
from parity.decoder import checks as decoder_checks
from parity.decoder import cost, twins
from parity.decoder.session import DecoderPair


@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-delay", "llama2-tiny-scan"])
def test_last_stage_bookkeeping_from_the_counter_equals_the_stage_arrays(name):
    cfg = tiny(name)
    for t in range(-2, cfg.num_iterations + 2):
        micro, _, valid = schedule.stage_work(cfg, t)
        finished, finished_valid = schedule.last_stage_microbatch(cfg, t)
        assert jnp.ndim(finished) == 0 and jnp.ndim(finished_valid) == 0
        assert bool(finished_valid) == bool(valid[-1]), t
        if finished_valid:
            assert int(finished) == int(micro[-1]), t


def test_rotation_transposes_to_the_opposite_rotation_exactly():
    rotate = schedule.permutation(
        lambda x: jnp.roll(x, 1, axis=0), lambda x: jnp.roll(x, -1, axis=0)
    )
    x = jax.random.normal(jax.random.key(0), (4, 3, 5))
    weights = jax.random.normal(jax.random.key(1), (4, 3, 5))
    assert np.array_equal(rotate(x), jnp.roll(x, 1, axis=0))
    ours = jax.grad(lambda x: jnp.sum(weights * jnp.sin(rotate(x))))(x)
    autodiff = jax.grad(lambda x: jnp.sum(weights * jnp.sin(jnp.roll(x, 1, axis=0))))(x)
    assert np.array_equal(ours, autodiff)


def test_first_stage_store_and_input_stay_per_stage_row():
    micro = jnp.arange(3 * 2, dtype=jnp.float32).reshape(3, 2)  # M=3 microbatches
    store = schedule.first_stage_store(micro, 4, jnp.float32(jnp.nan))
    assert store.shape == (4, 3, 2)
    assert np.array_equal(store[0], micro) and np.isnan(store[1:]).all()
    shift = jnp.full((4, 2), -1.0)
    inputs = schedule.first_stage_input(store, shift, 3, 4)  # t=4: microbatch 1
    assert np.array_equal(inputs[0], micro[1]) and (inputs[1:] == -1).all()


# ------------------------------------------------------------------ reading the HLO


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("source_target_pairs={{0,2},{6,0}}", ((0, 2), (6, 0))),
        ("replica_groups={{0,2,4,6},{1,3,5,7}}", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("replica_groups={}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("replica_groups=[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", ((0, 4), (2, 6), (1, 5), (3, 7))),
        (
            "replica_groups=mesh['data'=1,'stage'=4,'fsdp'=2,'tensor'=1] {'stage'}",
            ((0, 2, 4, 6), (1, 3, 5, 7)),
        ),
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=2,'axis_3'=4], "
            "device_ids=([4,2]T(1,0)) {'axis_2'}",
            ((0, 1), (2, 3), (4, 5), (6, 7)),
        ),
        # Sub-axes (jax 0.12, llama2-tiny-scan's reshard out of the pipeline): stage split
        # major to minor into 2 x 2; (1)2 is its major half, (2)2 its minor half.
        (
            "replica_groups=mesh['data'=2,'stage'=4,'fsdp'=1,'tensor'=1] {'data','stage':(1)2}",
            ((0, 2, 4, 6), (1, 3, 5, 7)),
        ),
        (
            "replica_groups=mesh['data'=2,'stage'=4,'fsdp'=1,'tensor'=1] {'stage':(1)2}",
            ((0, 2), (1, 3), (4, 6), (5, 7)),
        ),
        (
            "replica_groups=mesh['data'=2,'stage'=4,'fsdp'=1,'tensor'=1] {'stage':(2)2}",
            ((0, 1), (2, 3), (4, 5), (6, 7)),
        ),
    ],
)
def test_device_groups_in_every_printed_form(text, groups):
    line = f"  %x = f32[2]{{0}} all-reduce(%y), channel_id=1, {text}, use_global_device_ids=true"
    assert hlo.device_groups(line, 8) == groups


def test_device_groups_refuse_an_unknown_form():
    with pytest.raises(ValueError, match="unrecognised device groups"):
        hlo.device_groups("  %x = f32[2] all-reduce(%y), replica_groups=<something new>", 8)
    for groups, error in (
        ("{'pipe'}", "unknown mesh axes 'pipe'"),
        ("{'stage':(4)2}", "does not divide mesh axis stage=4"),
    ):
        with pytest.raises(ValueError, match=error):
            hlo.device_groups(
                f"  %x = f32[2] all-reduce(%y), replica_groups=mesh['stage'=4,'fsdp'=2] {groups}",
                8,
            )


def test_mesh_axes_of_a_collective():
    mesh = {"data": 1, "stage": 4, "fsdp": 2, "tensor": 1}
    ring = hlo.Collective("collective-permute", "r", ((0, 2), (2, 4), (4, 6), (6, 0)))
    gather = hlo.Collective("all-gather", "g", ((0, 1), (2, 3), (4, 5), (6, 7)))
    everything = hlo.Collective("all-reduce", "a", (tuple(range(8)),))
    assert ring.mesh_axes(mesh) == {"stage"}
    assert gather.mesh_axes(mesh) == {"fsdp"}
    assert everything.mesh_axes(mesh) == {"stage", "fsdp"}


def test_loops_finds_the_outermost_loops_and_their_nested_collectives():
    text = """HloModule m, num_partitions=4

%inner_body (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %g = f32[2]{0} all-gather(%p), replica_groups=[2,2]<=[4], dimensions={0}, REMAT
}

%outer_body (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  %c = f32[2]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %w = f32[2]{0} while(%c), condition=%cond, body=%inner_body
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  ROOT %l = f32[2]{0} while(%a), condition=%cond, body=%outer_body, METADATA
}
""".replace(
        "REMAT", 'metadata={op_name="jit(f)/transpose(jvp())/checkpoint/rematted_computation/x"}'
    ).replace(
        "METADATA",
        'metadata={op_name="jit(f)/transpose(jvp())/while"}, '
        'backend_config={"known_trip_count":{"n":"7"}}',
    )
    (loop,) = hlo.loops(text)
    assert loop.direction == "backward" and loop.trip_count == 7
    assert sorted(c.kind for c in loop.collectives) == ["all-gather", "collective-permute"]
    assert hlo.loop_collective_counts(text) == {
        "backward all-gather recomputed by remat": 1,
        "backward collective-permute": 1,
    }


def test_xla_tpu_program_forms():
    """What XLA:TPU writes where XLA:CPU does not: a loop whose trip count only its condition
    states, a program compiled per slice (partitions = one slice's devices) and a transfer
    between slices (a host-transfer `send` naming its megascale transfer type)."""
    text = """HloModule m, num_partitions=4

%cond (p: (s32[], f32[2])) -> pred[] {
  %k = s32[]{:T(128)} constant(19)
  %p = (s32[], f32[2]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %k), direction=LT
}

%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %p = (s32[], f32[2]) parameter(0)
  %c = (f32[2], f32[2]) collective-permute-start(%p), source_target_pairs={{0,2},{2,0}}
  %s = (f32[2], u32[], token[]) send(%p, %t), is_host_transfer=true, ONE_TO_ONE
  ROOT %r = (s32[], f32[2]) tuple(%p)
}

ENTRY %main (a: (s32[], f32[2])) -> (s32[], f32[2]) {
  %a = (s32[], f32[2]) parameter(0)
  %g = (u32[2,4], u32[]) send(%a, %t), is_host_transfer=true, ALL_GATHER
  ROOT %w = (s32[], f32[2]) while(%a), condition=%cond, body=%body, FORWARD
}
"""
    for transfer_type in ("ONE_TO_ONE", "ALL_GATHER"):
        attributes = "frontend_attributes={_xla_megascale_target={{100000->200000}},"
        attributes += f'megascale_transfer_type="{transfer_type}"}}'
        text = text.replace(transfer_type, attributes)
    text = text.replace("FORWARD", 'metadata={op_name="jit(f)/jvp()/while"}')
    (loop,) = hlo.loops(text)
    assert loop.trip_count == 19
    permute, transfer = loop.collectives
    assert (permute.kind, permute.dcn, transfer.kind, transfer.dcn) == (
        "collective-permute",
        False,
        "collective-permute",
        True,
    )
    # stage 2 x fsdp 2 in each of 2 slices (stage over DCN): partition 2 of a slice's program
    # is the next stage within the slice, and the transfer crosses the slices' stage blocks
    mesh = hlo.SliceMesh({"data": 1, "stage": 4, "fsdp": 2}, {"stage": 2})
    assert permute.mesh_axes(mesh) == {"stage"}
    assert hlo.Collective("all-gather", "g", ((0, 1),), partitions=4).mesh_axes(mesh) == {"fsdp"}
    assert transfer.mesh_axes(mesh) == {"stage"}
    ((_, gathered),) = hlo.outside_loops(text)
    assert (gathered.kind, gathered.dcn, gathered.dtype) == ("all-gather", True, "u32")
    assert hlo.collective_counts(text)["collective-permute"] == 2


# ------------------------------------------------------------------ the gate


def test_loop_body_minimum_is_one_rotation_each_way_and_nothing_without_a_loop():
    for name in TINY_CONFIGS:
        minimum = cost.loop_body_minimum(tiny(name))
        for direction in cost.DIRECTIONS:
            assert minimum[direction] == {
                kind: int(kind == "collective-permute") for kind in hlo.COLLECTIVES
            }
    assert cost.loop_body_minimum(tiny("llama2-tiny", "scan_pipeline_iterations=false")) == {}
    no_pipeline = tiny("llama2-tiny", "ici_pipeline_parallelism=1", "ici_data_parallelism=4")
    assert cost.loop_body_minimum(no_pipeline) == {}


# Every shipped config's loop communicates at the minimum: the config matrix asserts it on the
# compile check's report (tests/test_cli.py, `assert_loop_communicates_at_the_minimum`).


@pytest.mark.slow
def test_ag_per_repeat_with_two_repeats_is_held_to_ag_once():
    """R = 2: the two-repeat window is the whole stack in every block, its gather loop-invariant;
    XLA hoists it before the loop (ag-once), which is no failure (it was a false alarm)."""
    result = decoder_checks.compile_cost(
        DecoderPair(tiny("llama2-tiny", "pipeline_fsdp_ag_per_repeat=true"))
    )
    assert result.passed, [r for r in result.details if not r["passed"]]
    by_tensor = {r["tensor"]: r for r in result.details}
    for direction in cost.DIRECTIONS:
        in_loop = by_tensor[f"loop body {direction}: all-gather over fsdp (ag-per-repeat)"]
        assert in_loop["linen"] == in_loop["nnx"] == 0
    assert not any(t.startswith("repeat body") for t in by_tensor)


def finished_output_broadcast_to_every_stage(monkeypatch):
    """The finished microbatch written into every stage's row of the store (stage 0's row
    broadcast), as a stage-replicated output buffer would: same values, one more collective
    across stages per iteration."""
    wrong = types.SimpleNamespace(**vars(nnx_pipeline.schedule))

    def store_finished(cfg, store, rotated, iteration):
        finished, finished_valid = schedule.last_stage_microbatch(cfg, iteration)
        kept = store[:, finished]
        return store.at[:, finished].set(jnp.where(finished_valid, rotated[0][None], kept))

    wrong.store_finished = store_finished
    monkeypatch.setattr(nnx_pipeline, "schedule", wrong)


@pytest.mark.slow
def test_an_extra_collective_in_the_loop_body_fails_the_compile_check(monkeypatch, tmp_path):
    twins.clear_nnx_caches()
    try:
        finished_output_broadcast_to_every_stage(monkeypatch)
        report = tmp_path / "report.json"
        argv = cli.FLAGS(
            ["parity", str(CONFIG_DIR / "llama2-tiny.yml"), "--checks=compile", f"--json={report}"]
        )
        try:
            status = cli.run(argv)
        finally:
            cli.FLAGS.unparse_flags()
    finally:
        twins.clear_nnx_caches()
    assert status == cli.EXIT_FAIL
    (check,) = json.loads(report.read_text())["checks"]
    assert check["worst"]["where"] == "loop body forward: all-reduce across stages"
    failing = {d["tensor"]: d for d in check["details"] if not d["passed"]}
    extra = failing["loop body forward: all-reduce across stages"]
    assert (extra["linen"], extra["nnx"], extra["minimum"]) == (0, 1, 0)
    assert extra["instructions"]["nnx"][0].startswith("all-reduce")
