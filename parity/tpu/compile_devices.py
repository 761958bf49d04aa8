"""libtpu's compile-only devices for a topology, and a config's mesh laid on them as MaxText lays
it: each slice's devices by their physical torus (`mesh_utils.create_device_mesh` on the ICI
shape), the slices on the `dcn_*` axes (`create_hybrid_device_mesh`). The process's own arrays
stay on the CPU (`JAX_PLATFORMS=cpu`); these devices only compile.
"""

from __future__ import annotations

import functools
import os
import re

import jax
from jax.experimental import mesh_utils
from jax.experimental import topologies as jax_topologies
from jax.sharding import AxisType, Mesh

from migrate.common import sharding
from migrate.config.contract import Config
from migrate.config.rules import MESH_AXES
from parity.engine import compiles
from parity.tpu.topologies import HOST_BOUNDS, Topology

# What libtpu logs when it loads on a host that is not a TPU VM (no worker hostnames, no
# accelerator type): noise here, where nothing runs on a TPU.
LIBTPU_NOISE = re.compile(
    r"TPU_WORKER_HOSTNAMES|TPU_ACCELERATOR_TYPE|host bounds for accelerator type|"
    r"Source Location Trace|libtpu_init_utils|Logging before InitGoogle|^\s*$"
)


@functools.cache
def topology_devices(topology: Topology, num_slices: int) -> tuple[jax.Device, ...]:
    """The compile-only devices of `num_slices` slices of `topology` (each with `slice_index`).
    libtpu takes a process lock file: ALLOW_MULTIPLE_LIBTPU_LOAD lets several runs (and the
    test suite's workers) compile side by side."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with compiles.compiler_output(LIBTPU_NOISE):
        description = jax_topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology.libtpu_name,
            chip_config_name=topology.generation.chip_config,
            chips_per_host_bounds=HOST_BOUNDS,
            num_slices=num_slices,
            wrap=topology.wrap,
        )
    return tuple(description.devices)


def make_mesh(cfg: Config, topology: Topology, num_slices: int) -> tuple[Mesh, str]:
    """`cfg`'s mesh on the topology's devices, and how it was laid: by the physical torus, or
    (a shape the torus cannot hold whole) with physical axes split, as MaxText's
    `allow_split_physical_axes=true` lays it."""
    devices = topology_devices(topology, num_slices)
    ici, dcn = sharding.ici_shape(cfg), sharding.dcn_shape(cfg)

    def lay(split: bool):
        if num_slices > 1:
            return mesh_utils.create_hybrid_device_mesh(
                ici, dcn, devices, allow_split_physical_axes=split
            )
        return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=split)

    try:
        grid, layout = lay(False), "physical torus"
    except (ValueError, NotImplementedError, AssertionError):
        grid, layout = lay(True), "physical torus, axes split"
    mesh = Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return mesh, layout
