"""Multi-slice stages (`dcn_pipeline_parallelism`, `dcn_data_parallelism`): MaxText's hybrid
mesh, slices simulated on CPU, stages that cross slices where the layout says, and the
pipeline's rotation crossing the slice boundary exactly at the stage-block boundaries."""

from __future__ import annotations

import dataclasses
import json
import random

import jax
import numpy as np
import pytest
from conftest import CONFIG_DIR, tiny
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh
from test_cli import run_in_process

from migrate.common import sharding
from migrate.config.rules import MESH_AXES
from parity import cli
from parity.decoder import cost, slices

MULTISLICE = "llama2-tiny-multislice"
DCN_DATA = ("dcn_data_parallelism=2", "ici_data_parallelism=1")


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What `create_hybrid_device_mesh` reads off a device of a multi-slice TPU."""

    id: int
    slice_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"
    process_index: int = 0


def ids(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.id, otypes=[int])(grid)


def in_order_mesh(cfg) -> Mesh:
    """The mesh that ignores slices: `jax.make_mesh` over the ici x dcn sizes (on CPU, the
    devices in order, reshaped)."""
    sizes = tuple(cfg.mesh_shape[a] for a in MESH_AXES)
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        DCN_DATA,
        ("ici_data_parallelism=1", "ici_fsdp_parallelism=2"),
        ("dcn_data_parallelism=2", "ici_fsdp_parallelism=2", "per_device_batch_size=4"),
        ("dcn_pipeline_parallelism=1", "ici_pipeline_parallelism=4", "dcn_data_parallelism=2"),
    ],
)
def test_hybrid_grid_is_jax_create_hybrid_device_mesh(overrides):
    """API contract: on devices that report their slice, the grid is exactly what
    `jax.experimental.mesh_utils.create_hybrid_device_mesh(ici, dcn)` builds (MaxText's mesh),
    whatever order the devices come in."""
    cfg = tiny(MULTISLICE, *overrides)
    per_slice = cfg.num_devices // cfg.num_slices
    devices = [FakeDevice(i, i // per_slice) for i in range(cfg.num_devices)]
    shuffled = random.Random(0).sample(devices, len(devices))
    for given in (devices, shuffled):  # grouped by slice_index, in the order given within one
        expected = mesh_utils.create_hybrid_device_mesh(
            sharding.ici_shape(cfg), sharding.dcn_shape(cfg), given
        )
        assert (ids(sharding.hybrid_device_grid(cfg, given)) == ids(expected)).all()
    by_slice = sharding.group_into_slices(shuffled, cfg.num_slices)
    assert [{d.slice_index for d in group} for group in by_slice] == [
        {k} for k in range(cfg.num_slices)
    ]


def test_devices_in_another_number_of_slices_are_refused():
    cfg = tiny(MULTISLICE)
    devices = [FakeDevice(i, i // 2) for i in range(8)]  # 4 slices; the config spans 2
    with pytest.raises(sharding.MeshError, match="in 4 slices but the config's mesh spans 2"):
        sharding.make_mesh(cfg, devices)


def test_simulated_slices_hold_contiguous_devices_and_stage_blocks():
    """On CPU slice k is devices 4k .. 4k+3; stage k's devices are all in slice k // 2 (both
    data rows), which the devices in order, reshaped, would not give (data across slices)."""
    cfg = tiny(MULTISLICE)
    mesh = sharding.make_mesh(cfg)
    grid = ids(mesh.devices).reshape(cfg.mesh_shape["data"], cfg.num_stages)
    per_block = cfg.num_stages // cfg.dcn_pipeline_parallelism
    for k in range(cfg.num_stages):
        assert {i // 4 for i in grid[:, k]} == {k // per_block}, grid
    assert grid.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert all(r["passed"] for r in slices.layout_records(cfg, mesh))
    flat = slices.layout_records(cfg, in_order_mesh(cfg))
    assert [r["found"] for r in flat] == [[0, 1]] * 4  # every stage in both slices
    assert not any(r["passed"] for r in flat)


def test_dcn_data_variant_puts_data_rows_in_slices():
    cfg = tiny(MULTISLICE, *DCN_DATA)
    assert cfg.num_slices == 4 and cfg.mesh_shape["data"] == 2 and cfg.num_stages == 4
    grid = ids(sharding.make_mesh(cfg).devices).reshape(2, 4)
    # slice = 2 * data + stage // 2 (DCN shape data 2 x stage 2), 2 devices each
    for d in range(2):
        for k in range(4):
            assert grid[d, k] // 2 == 2 * d + k // 2, grid
    assert all(r["passed"] for r in slices.layout_records(cfg, sharding.make_mesh(cfg)))


@pytest.mark.slow
def test_rotation_crosses_slices_exactly_at_the_stage_block_boundaries():
    """The compiled train step's loop bodies: the forward rotation crosses slices on hops
    1 -> 2 and 3 -> 0 only, the backward on their reverses, on each of the 2 data rows. The
    same program on the in-order mesh would cross on no hop (its slices are data rows)."""
    cfg = tiny(MULTISLICE)
    mesh = sharding.make_mesh(cfg)
    compiled = cost.compile_train_step(cfg, mesh, "nnx")
    records, summary = slices.permute_records(cfg, mesh, {"nnx": compiled})
    hops = {r["tensor"].split()[2]: r for r in records}
    assert hops["forward"]["stage_hops"] == [(1, 2), (3, 0)]
    assert hops["backward"]["stage_hops"] == [(0, 3), (2, 1)]
    assert all(r["passed"] and r["found"] == 4 for r in records), records
    assert "fwd/bwd: 4/4 (expected 4)" in summary
    across = slices.across_slice_counts(cfg, mesh, compiled)
    assert across["collective-permute"] == 2  # the rotation, forward and backward

    flat, _ = slices.permute_records(cfg, in_order_mesh(cfg), {"nnx": compiled})
    assert [r["found"] for r in flat] == [0, 0] and not any(r["passed"] for r in flat)


@pytest.mark.slow
def test_dcn_data_variant_passes_pipeline_and_compile(tmp_path):
    """Data parallelism across slices too (4 slices of 2 devices): the twins exact, the pipeline
    within its tier, and the compile check's slice records."""
    args = (str(CONFIG_DIR / f"{MULTISLICE}.yml"), *DCN_DATA)
    report = tmp_path / "r.json"
    status = run_in_process(*args, "--checks=forward,pipeline,compile", f"--json={report}")
    assert status == cli.EXIT_PASS
    data = json.loads(report.read_text())
    compile_check = next(c for c in data["checks"] if c["name"] == "compile")
    tensors = {r["tensor"] for r in compile_check["details"]}
    assert {f"slices: stage {k}" for k in range(4)} <= tensors
    assert "loop body forward (nnx): permute hops across slices" in tensors


@pytest.mark.slow
def test_processes_that_split_slices_unevenly_are_refused(capsys):
    """A slice is whole hosts: 6 slices of 2 devices over 4 processes of 3 is refused (exit 2)
    before anything starts; 2 slices of 4 over 4 processes of 2 is fine."""
    config = str(CONFIG_DIR / f"{MULTISLICE}.yml")
    uneven = ("dcn_data_parallelism=3", "ici_data_parallelism=1", "per_device_batch_size=3")
    args = ("num_pipeline_microbatches=4", "--num_processes=4", "--dry_run")
    assert run_in_process(config, *uneven, *args) == cli.EXIT_USAGE
    assert "a process must hold whole slices, or a slice whole processes" in capsys.readouterr().err
    assert run_in_process(config, "--num_processes=4", "--dry_run") == cli.EXIT_PASS
    assert "(2 slices of 4: dcn_data_parallelism=1 x dcn_pipeline_parallelism=2)" in (
        capsys.readouterr().out
    )
