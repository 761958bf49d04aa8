"""Multi-slice facts for the `compile` check: where the stages sit and what crosses slices.

A config with `dcn_pipeline_parallelism > 1` puts blocks of S / dcn consecutive stages in
different slices (`migrate.common.sharding.hybrid_device_grid`): the devices of stage k are in the
slice(s) of DCN stage coordinate k // (S / dcn), and the pipeline's rotation crosses the slow
network (DCN) exactly at the block boundaries, once per boundary of the stage ring (for
dcn = 2: stage S/2 - 1 -> S/2 and the wrap S - 1 -> 0, forward; the reverse, backward). These
records check both against the devices themselves: the slice of each device comes from how
the devices were grouped (`migrate.common.sharding.group_into_slices`), not from the mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from migrate.common import sharding
from migrate.config.contract import Config
from migrate.config.rules import MESH_AXES
from parity.analysis import hlo
from parity.decoder import cost as decoder_cost

DIRECTIONS = ("forward", "backward")


def device_slices(cfg: Config, mesh: Mesh) -> np.ndarray:
    """The slice of the device at each mesh position (an int array of the mesh's shape): a
    TPU device's own `slice_index`; for the simulated devices `make_mesh` takes by default
    (the first `cfg.num_devices`), the slice they were grouped into."""
    if all(d.platform == "tpu" for d in mesh.devices.flat):
        return np.vectorize(lambda d: d.slice_index, otypes=[int])(mesh.devices)
    of = sharding.slice_of_device(cfg, jax.devices()[: cfg.num_devices])
    return np.vectorize(lambda d: of[d.id], otypes=[int])(mesh.devices)


def per_slice(cost) -> bool:
    """A program compiled per slice (XLA:TPU's multi-slice programs): its transfers between
    slices are their own instructions (`hlo.Collective.dcn`), not partition groups."""
    return any(c.dcn for loop in cost.loops for c in loop.collectives) or any(
        c.dcn for _, c in cost.outside_loops
    )


def expected_slices(cfg: Config) -> np.ndarray:
    """The slice each mesh position must be in: its DCN coordinates (the outer factor of each
    axis, `index // ici size`) ravelled over the DCN shape."""
    ici, dcn = sharding.ici_shape(cfg), sharding.dcn_shape(cfg)
    coords = np.indices(tuple(cfg.mesh_shape[a] for a in MESH_AXES))
    outer = tuple(c // n for c, n in zip(coords, ici, strict=True))
    return np.ravel_multi_index(outer, dcn)


def layout_records(cfg: Config, mesh: Mesh) -> list[dict]:
    """Per stage, the slices its devices are in against the hybrid layout's."""
    found, wanted = device_slices(cfg, mesh), expected_slices(cfg)
    stage_axis = MESH_AXES.index("stage")
    records = []
    for k in range(cfg.num_stages):
        have = sorted({int(s) for s in np.take(found, k, axis=stage_axis).flat})
        want = sorted({int(s) for s in np.take(wanted, k, axis=stage_axis).flat})
        same = bool(
            (np.take(found, k, axis=stage_axis) == np.take(wanted, k, axis=stage_axis)).all()
        )
        records.append(
            {
                "tensor": f"slices: stage {k}",
                "found": have,
                "expected": want,
                "max_rel": 0.0 if same else 1.0,
                "passed": same,
            }
        )
    return records


def ring_boundaries(cfg: Config, direction: str) -> set[tuple[int, int]]:
    """(source stage, target stage) of the rotation's hops between stage blocks of different
    slices: forward s -> s + 1 (mod S), backward the reverse."""
    s, per = cfg.num_stages, cfg.num_stages // cfg.dcn_pipeline_parallelism
    hops = {(k, (k + 1) % s) for k in range(s) if k // per != ((k + 1) % s) // per}
    return hops if direction == "forward" else {(b, a) for a, b in hops}


def crossing(collective: hlo.Collective, slices: np.ndarray) -> list[tuple[int, int]]:
    """(source, target) partitions of a collective-permute's hops between slices; for other
    kinds, (first, other) of every group that spans slices. Partition p is the p-th device of
    the mesh, row-major."""
    flat = slices.reshape(-1)
    out = []
    for group in collective.groups:
        if len({int(flat[p]) for p in group}) > 1:
            out.append((group[0], group[-1]))
    return out


def transfer_records(cfg: Config, costs: dict) -> tuple[list[dict], str]:
    """Per loop body and twin of a per-slice program: the rotation's transfers between slices,
    one instruction carrying every block boundary's hop (XLA:TPU sends them together)."""
    records, seen = [], {}
    for direction in DIRECTIONS:
        for framework, cost in costs.items():
            found = sum(
                c.dcn and c.kind == "collective-permute"
                for loop in decoder_cost.batch_loops(cost, cfg)
                if loop.trip_count == cfg.num_iterations and loop.direction == direction
                for c in loop.collectives
            )
            seen[direction, framework] = found
            records.append(
                {
                    "tensor": f"loop body {direction} ({framework}): transfers across slices",
                    "found": found,
                    "expected": 1,
                    "max_rel": 0.0 if found == 1 else 1.0,
                    "passed": found == 1,
                }
            )
    summary = "rotation transfers across slices per iteration fwd/bwd: {}/{} (expected 1)".format(
        seen["forward", "nnx"], seen["backward", "nnx"]
    )
    return records, summary


def permute_records(cfg: Config, mesh: Mesh, costs: dict) -> tuple[list[dict], str]:
    """Per loop body and twin, the rotation's hops that cross slices: exactly the stage
    ring's block boundaries, on every replica of the other axes, and no other hop (for a
    per-slice program, `transfer_records`)."""
    if any(per_slice(c) for c in costs.values()):
        return transfer_records(cfg, costs)
    slices = device_slices(cfg, mesh)
    shape = tuple(cfg.mesh_shape[a] for a in MESH_AXES)
    stage_axis = MESH_AXES.index("stage")
    replicas = cfg.num_devices // cfg.num_stages
    records, seen_counts = [], {}
    for direction in DIRECTIONS:
        want = ring_boundaries(cfg, direction)
        for framework, cost in costs.items():
            hops: list[tuple[int, int]] = []
            for loop in decoder_cost.batch_loops(cost, cfg):
                if loop.trip_count != cfg.num_iterations or loop.direction != direction:
                    continue
                for c in loop.collectives:
                    if c.kind == "collective-permute" and "stage" in c.mesh_axes(cfg.mesh_shape):
                        hops += crossing(c, slices)
            stages = {
                tuple(int(np.unravel_index(p, shape)[stage_axis]) for p in hop) for hop in hops
            }
            passed = stages == want and len(hops) == replicas * len(want)
            seen_counts[direction, framework] = len(hops)
            records.append(
                {
                    "tensor": f"loop body {direction} ({framework}): permute hops across slices",
                    "found": len(hops),
                    "expected": replicas * len(want),
                    "stage_hops": sorted(stages),
                    "expected_stage_hops": sorted(want),
                    "max_rel": 0.0 if passed else 1.0,
                    "passed": passed,
                }
            )
    summary = "permute hops across slices per iteration fwd/bwd: {}/{} (expected {})".format(
        seen_counts["forward", "nnx"],
        seen_counts["backward", "nnx"],
        replicas * len(ring_boundaries(cfg, "forward")),
    )
    return records, summary


def across_slice_counts(cfg: Config, mesh: Mesh, cost) -> dict[str, int]:
    """Collective instructions whose device groups span slices, by kind, over the whole
    program (loop bodies counted once): what runs over DCN."""
    slices = device_slices(cfg, mesh)
    counts = dict.fromkeys(hlo.COLLECTIVES, 0)
    found = [c for loop in cost.loops for c in loop.collectives]
    found += [c for _, c in cost.outside_loops]
    for collective in found:
        counts[collective.kind] += collective.dcn or bool(crossing(collective, slices))
    return counts


def records(cfg: Config, mesh: Mesh, linen_cost, nnx_cost) -> tuple[list[dict], str]:
    """Every multi-slice record of the `compile` check and a one-line summary; none for a
    config in one slice."""
    if cfg.num_slices == 1:
        return [], ""
    out = layout_records(cfg, mesh)
    summary = ""
    if cfg.using_pipeline and cfg.scan_pipeline_iterations:
        permutes, summary = permute_records(cfg, mesh, {"linen": linen_cost, "nnx": nnx_cost})
        out += permutes
    counts = {
        fw: across_slice_counts(cfg, mesh, c)
        for fw, c in (("linen", linen_cost), ("nnx", nnx_cost))
    }
    out.append(
        {
            "tensor": "collectives across slices",
            **counts,
            "max_rel": 0.0 if counts["linen"] == counts["nnx"] else 1.0,
            "passed": counts["linen"] == counts["nnx"],
        }
    )
    kinds = ", ".join(f"{k} {n}" for k, n in counts["nnx"].items() if n) or "none"
    layout = (
        f"{cfg.num_slices} slices, stage blocks of {cfg.num_stages // cfg.dcn_pipeline_parallelism}"
    )
    return out, "; ".join(p for p in (layout, summary, f"collectives across slices: {kinds}") if p)
