"""The mesh from a config, its logical axis rules, and one resolver for both frameworks.

Linen and NNX resolve logical names differently (NNX: dict lookup, unmatched names pass through
as mesh axes; Linen: rules in priority order, a mesh axis used at most once per tensor, unmatched
names replicated). Everything here resolves with Linen's resolver so both twins are judged by the
same PartitionSpecs.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from migrate.common import axes
from migrate.config.contract import Config, Rules
from migrate.config.rules import MESH_AXES
from migrate.errors import BadInput

LogicalNames = tuple[str | None, ...]


class MeshError(BadInput, RuntimeError):
    """The mesh that a config asks for cannot be built from the devices present."""


def simulated_devices_hint(count: int) -> str:
    """How to get `count` devices on a CPU-only machine."""
    return (
        f"on a CPU, simulate them by setting XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{count} before jax is imported"
    )


def ici_shape(cfg: Config) -> tuple[int, ...]:
    """The mesh within one slice (ICI), per axis of `MESH_AXES`."""
    ici = {"data": cfg.ici_data_parallelism, "stage": cfg.ici_pipeline_parallelism}
    return tuple(ici.get(a, cfg.mesh_shape[a]) for a in MESH_AXES)


def dcn_shape(cfg: Config) -> tuple[int, ...]:
    """The mesh of slices (DCN), per axis of `MESH_AXES`: only `data` and `stage` span slices."""
    dcn = {"data": cfg.dcn_data_parallelism, "stage": cfg.dcn_pipeline_parallelism}
    return tuple(dcn.get(a, 1) for a in MESH_AXES)


def group_into_slices(devices: Sequence[jax.Device], num_slices: int) -> list[list[jax.Device]]:
    """`devices` grouped into `num_slices` slices of equal size.

    Devices that report `slice_index` (multi-slice TPUs) are grouped by it, in index order.
    Devices that do not (CPU, a single slice, simulated devices) are split into contiguous runs
    in the order given: slice k holds devices k*n .. (k+1)*n - 1. With several processes each
    holding whole slices, a process's devices stay in its slices.
    """
    indices = {getattr(d, "slice_index", None) for d in devices}
    if len(devices) % num_slices:
        raise MeshError(f"{len(devices)} devices do not split into {num_slices} equal slices")
    if None in indices or len(indices) == 1:
        size = len(devices) // num_slices
        return [list(devices[k * size : (k + 1) * size]) for k in range(num_slices)]
    if len(indices) != num_slices:
        raise MeshError(
            f"the devices are in {len(indices)} slices but the config's mesh spans {num_slices} "
            "(dcn_data_parallelism x dcn_pipeline_parallelism)"
        )
    groups = [[d for d in devices if d.slice_index == i] for i in sorted(indices)]
    if len({len(g) for g in groups}) != 1:
        raise MeshError(f"slices of unequal sizes: {[len(g) for g in groups]} devices")
    return groups


def hybrid_device_grid(cfg: Config, devices: Sequence[jax.Device]) -> np.ndarray:
    """The devices as a grid of the config's mesh shape, laid out as MaxText's hybrid mesh.

    Each mesh axis is a DCN factor (slow: across slices) times an ICI factor (within a slice),
    the DCN factor outer: mesh index `i = dcn_i * ici_size + ici_i`. The slices form a grid of
    the DCN shape (slice k at the k-th position, row-major) and each slice's devices, in order,
    a grid of the ICI shape: the semantics of `jax.experimental.mesh_utils.
    create_hybrid_device_mesh(ici, dcn)`, which needs `slice_index` (absent on CPU). With
    `dcn_pipeline_parallelism > 1` stages 0 .. S/dcn - 1 are in the first slice(s), and so on.
    """
    ici, dcn = ici_shape(cfg), dcn_shape(cfg)
    slices = group_into_slices(devices, cfg.num_slices)
    per_slice = [np.array(s, dtype=object).reshape(ici) for s in slices]
    grid = np.empty(tuple(i * d for i, d in zip(ici, dcn, strict=True)), dtype=object)
    for k, block in enumerate(per_slice):
        at = np.unravel_index(k, dcn)
        grid[tuple(slice(c * n, (c + 1) * n) for c, n in zip(at, ici, strict=True))] = block
    return grid


def slice_of_device(cfg: Config, devices: Sequence[jax.Device]) -> dict[int, int]:
    """Device id -> the slice `hybrid_device_grid` puts it in."""
    slices = group_into_slices(devices, cfg.num_slices)
    return {d.id: k for k, group in enumerate(slices) for d in group}


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes `MESH_AXES` sized by the config, over the first devices present.

    Axes are `Auto`, the model Linen's `with_sharding_constraint` assumes. A config that spans
    several slices (`cfg.num_slices`) gets the hybrid layout (`hybrid_device_grid`); one slice is
    the same layout: the devices in order, reshaped.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(cfg.mesh_shape[a] for a in MESH_AXES)
    needed = math.prod(shape)
    if len(devices) < needed:
        sizes = ", ".join(f"{a}={n}" for a, n in cfg.mesh_shape.items())
        slices = f" in {cfg.num_slices} slices" if cfg.num_slices > 1 else ""
        flags = os.environ.get("XLA_FLAGS", "")
        raise MeshError(
            f"config {cfg.model_name!r} needs {needed} devices (mesh {sizes}){slices} but "
            f"{len(devices)} are present; {simulated_devices_hint(needed)}"
            + (f" (XLA_FLAGS is now {flags!r})" if flags else "")
        )
    grid = hybrid_device_grid(cfg, devices[:needed])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def abstract_mesh(cfg: Config) -> AbstractMesh:
    """The config's mesh without devices: for shape-only work (eval_shape, lowering 7B)."""
    return AbstractMesh(
        tuple(cfg.mesh_shape[a] for a in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )


def logical_rules(cfg: Config) -> Rules:
    """The config's logical axis rules, in priority order."""
    return cfg.logical_axis_rules


def logical_to_spec(names: LogicalNames, rules: Rules) -> PartitionSpec:
    """Logical names -> PartitionSpec with Linen's resolver (the one resolver of the project)."""
    return nn.logical_to_mesh_axes(tuple(names), rules)


def resolved_spec(names: LogicalNames, rules: Rules) -> PartitionSpec:
    """The spec `names` resolve to: logical names through `rules` (Linen's resolver), and a
    name that is itself a mesh axis of the rules (a port annotated with mesh axes) to that
    axis, as NNX's resolver passes it through."""
    targets = (t if isinstance(t, tuple) else (t,) for _, t in rules)
    mesh_axes = {a for target in targets for a in target if a is not None}
    logical = {name for name, _ in rules}
    identity = tuple((a, a) for a in sorted(mesh_axes - logical, key=str))
    return logical_to_spec(names, (*rules, *identity))


def same_placement(rules: Rules | None):
    """A predicate on two annotations: the same names, or (with `rules`) names of the same
    length that resolve to the same spec (`resolved_spec`: logical on one side, mesh axes on
    the other)."""

    def same(a: LogicalNames | None, b: LogicalNames | None) -> bool:
        if a == b:
            return True
        if rules is None or a is None or b is None or len(a) != len(b):
            return False
        return resolved_spec(a, rules) == resolved_spec(b, rules)

    return same


def named_sharding(names: LogicalNames, mesh: Mesh, rules: Rules) -> NamedSharding:
    """Logical names -> NamedSharding on `mesh`."""
    return NamedSharding(mesh, logical_to_spec(names, rules))


def fitted_sharding(
    names: LogicalNames | None, shape: tuple[int, ...], mesh: Mesh, rules: Rules
) -> NamedSharding:
    """The sharding `names` resolve to on `mesh`, with a dim its mesh axes do not divide
    replicated: the reference of a pipelined subset stacks N layers on `layers` (the `stage`
    mesh axis), and N need not be a multiple of S once only P of them are pipelined."""
    spec = logical_to_spec(tuple(names), rules) if names else PartitionSpec()
    entries = []
    for dim, entry in zip(shape, (*spec, *(None,) * (len(shape) - len(spec))), strict=True):
        axes_ = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        entries.append(entry if dim % math.prod(mesh.shape[a] for a in axes_) == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*entries))


@functools.cache
def after_pipeline_config(cfg: Config) -> Config:
    """`cfg` as the layers after a pipelined subset see it: `activation_batch` resolves to the
    mesh axes of `activation_embed_and_logits_batch`, so that those layers run on the batch the
    pipeline hands out (split over stages too, like the embedding and the logits) instead of
    gathering it over stages and computing the same rows on every stage; inside an MoE block
    (`activation_batch_no_exp`) the tokens stay split over stages too."""
    rules = cfg.logical_axis_rules
    logits_batch = [target for name, target in rules if name == "activation_embed_and_logits_batch"]
    if not logits_batch:
        return cfg

    def split_over_stages_too(name: str, target):
        if name == "activation_batch":
            return logits_batch[0]
        if name == axes.BATCH_NO_EXP_LENGTH_EMBED[0]:  # an MoE block's tokens: over stages as well
            found = () if target is None else target if isinstance(target, tuple) else (target,)
            return found if "stage" in found else (*found, "stage")
        return target

    remapped = tuple((name, split_over_stages_too(name, target)) for name, target in rules)
    return cfg.replace(logical_axis_rules=remapped)


def batch_sharding(cfg: Config, mesh: Mesh) -> NamedSharding:
    """The sharding of token batches `[B, T]`: rows over the batch axes (`activation_batch`)."""
    return named_sharding(axes.BATCH_LENGTH, mesh, cfg.logical_axis_rules)


def without_mesh_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """`spec` with mesh axis `axis` removed from every entry (that dimension is gathered)."""
    entries = []
    for entry in spec:
        if entry == axis:
            entries.append(None)
        elif isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != axis)
            entries.append(kept if len(kept) > 1 else (kept[0] if kept else None))
        else:
            entries.append(entry)
    return PartitionSpec(*entries)


def gathered_over_fsdp(names: LogicalNames, mesh: Mesh, cfg: Config) -> NamedSharding:
    """The sharding of a weight with logical `names`, gathered over `fsdp` for use (FSDP)."""
    spec = logical_to_spec(tuple(names), logical_rules(cfg))
    return NamedSharding(mesh, without_mesh_axis(spec, "fsdp"))


def stage_weights_need_gathering(cfg: Config) -> bool:
    """Whether the pipeline gathers each stage's weights over `fsdp` explicitly for its visit.

    Needed when the mesh has `fsdp` and `tensor` axes both larger than 1: left to choose there,
    XLA (jax 0.10.2 and 0.12) reshards batches split over (data, fsdp) by swapping the
    equal-sized fsdp and tensor axes and returns rows from the wrong devices
    (tests/test_sharding.py shows it on four lines). Elsewhere XLA's own plan is right and
    cheaper: explicit gathering raises the 7B train step's temp memory from 25.2 to 30.4 GiB
    per device.
    """
    return cfg.ici_fsdp_parallelism > 1 and cfg.ici_tensor_parallelism > 1


def constrain(x: jax.Array, names: LogicalNames, mesh: Mesh, rules: Rules) -> jax.Array:
    """`with_sharding_constraint` of `x` to the sharding its logical names resolve to."""
    return jax.lax.with_sharding_constraint(x, named_sharding(names, mesh, rules))
