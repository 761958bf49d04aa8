"""TPU slices by MaxText's names (`v5p-16`, `v5e-8`, ...), what libtpu needs to lay out their
compile-only devices, and each chip's HBM. No JAX: `--topology` is validated before JAX starts.

A name is `<generation>-<N>`. What N counts, the slice's grid of chips, the chip configuration
and the host bounds follow MaxText's `maxtext/utils/accelerator_to_spec_map.py` (its table of
`compile_topology` names, checked name by name in `tests/test_tpu.py` against the installed
MaxText 0.2.5): for v4 and v5p N counts TensorCores (two per chip, one device per chip:
`megacore`), for v5e and v6e chips, for tpu7x devices (two per chip). The power-of-two slices of
each generation are known here; MaxText's odd shapes (tpu7x-384, ...) are not.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import sys
from collections.abc import Sequence
from typing import Any

from migrate.errors import BadInput

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: MaxText's name prefix, libtpu's, and its chips."""

    prefix: str  # MaxText's: `v5p`
    libtpu_prefix: str  # libtpu's topology name: `v5`
    device_kind: str  # what jax reports (`TPU v5`)
    chip_config: str  # libtpu's chip configuration: `megacore` (one device per chip) or default
    grid_dims: int  # chips in a 2D or a 3D torus
    devices_per_chip: int
    name_units_per_chip: int  # what N of `<prefix>-N` counts per chip
    # HBM per chip, as Google Cloud's TPU documentation states it (the pages "TPU v4", "TPU
    # v5e", "TPU v5p", "TPU v6e", "TPU7x (Ironwood)" of cloud.google.com/tpu/docs)
    hbm_per_chip: int
    # What libtpu's compiler says one device may use (its `CompileTimeHbmOom` message, "exceeds
    # available HBM (...)"), measured with libtpu 0.0.50.1: the figure a program must fit in
    usable_hbm_per_device: int
    largest: int  # the largest N known here


GENERATIONS = {
    g.prefix: g
    for g in (
        Generation("v4", "v4", "TPU v4", "megacore", 3, 1, 2, 32 * GIB, int(30.75 * GIB), 4096),
        Generation("v5p", "v5", "TPU v5", "megacore", 3, 1, 2, 95 * GIB, int(95.73 * GIB), 4096),
        Generation(
            "v5e", "v5e", "TPU v5 lite", "default", 2, 1, 1, 16 * GIB, int(15.75 * GIB), 256
        ),
        Generation(
            "v6e", "v6e", "TPU v6 lite", "default", 2, 1, 1, 32 * GIB, int(31.24 * GIB), 256
        ),
        Generation(
            "tpu7x", "tpu7x", "TPU7x", "default", 3, 2, 2, 192 * GIB, int(94.74 * GIB), 8192
        ),
    )
}
SMALLEST_CHIPS = 4  # one host's 2x2 chips: the smallest slice known here
HOST_BOUNDS = (2, 2, 1)  # chips per host: every slice known here


@dataclasses.dataclass(frozen=True)
class Topology:
    """One TPU slice, by MaxText's name, as libtpu lays it out."""

    name: str  # MaxText's: `v5p-16`
    generation: Generation
    grid: tuple[int, ...]  # chips per torus dimension

    @property
    def chips(self) -> int:
        return _product(self.grid)

    @property
    def devices_per_slice(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def libtpu_name(self) -> str:
        return f"{self.generation.libtpu_prefix}:{'x'.join(map(str, self.grid))}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Which torus dimensions close into rings (wrap-around links): a 3D slice of 4x4x4
        chips and up is a full torus; a 2D one closes a dimension of 16 chips."""
        if self.generation.grid_dims == 3:
            return (min(self.grid) >= 4,) * 3
        return (self.grid[0] == 16, self.grid[1] == 16, False)

    @property
    def usable_hbm_per_device(self) -> int:
        return self.generation.usable_hbm_per_device

    def describe(self, num_slices: int = 1) -> str:
        slices = f" x {num_slices} slices" if num_slices > 1 else ""
        per_device = (
            f", {self.generation.devices_per_chip} devices per chip"
            if self.generation.devices_per_chip > 1
            else ""
        )
        return (
            f"{self.name}{slices} ({self.generation.device_kind}, libtpu {self.libtpu_name}, "
            f"{self.devices_per_slice * num_slices} devices{per_device}; "
            f"{self.generation.hbm_per_chip / GIB:.0f} GiB HBM per chip)"
        )


@dataclasses.dataclass(frozen=True)
class Target:
    """What `--topology` and `--num_slices` name: the slice and how many of them."""

    topology: Topology
    num_slices: int = 1

    def describe(self) -> str:
        return self.topology.describe(self.num_slices)


def _product(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _grid(chips: int, dims: int) -> tuple[int, ...] | None:
    """The chips of a power-of-two slice as its torus grid: a 2D slice grows 2x2, 2x4, 4x4,
    4x8, ...; a 3D one 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ... (the last dimension
    doubles first)."""
    if chips < SMALLEST_CHIPS or chips & (chips - 1):
        return None
    doublings = chips.bit_length() - 1 - 2  # beyond one host's 2x2
    if dims == 2:
        grid = [2, 2]
    elif doublings == 0:
        return (2, 2, 1)
    else:
        grid, doublings = [2, 2, 2], doublings - 1
    for i in range(doublings):
        grid[dims - 1 - i % dims] *= 2
    return tuple(grid)


def known_names() -> list[str]:
    """Every topology name known here, by generation and size."""
    names = []
    for g in GENERATIONS.values():
        n = SMALLEST_CHIPS * g.name_units_per_chip
        while n <= g.largest:
            names.append(f"{g.prefix}-{n}")
            n *= 2
    return names


_NAME = re.compile(r"^([a-z0-9]+)-(\d+)$")


def parse(name: str) -> Topology:
    """MaxText's topology name as a `Topology`; an unknown one is `BadInput` listing the known
    generations and sizes."""
    match = _NAME.match(name.strip())
    generation = GENERATIONS.get(match.group(1)) if match else None
    if generation is not None:
        units = int(match.group(2))
        chips, odd = divmod(units, generation.name_units_per_chip)
        grid = None if odd else _grid(chips, generation.grid_dims)
        if grid is not None and units <= generation.largest:
            return Topology(f"{generation.prefix}-{units}", generation, grid)
    sizes = "; ".join(
        f"{g.prefix}-{SMALLEST_CHIPS * g.name_units_per_chip}..{g.prefix}-{g.largest} "
        "(powers of two)"
        for g in GENERATIONS.values()
    )
    raise BadInput(f"--topology={name}: not a TPU topology known here; known: {sizes}")


# ------------------------------------------------------------------ libtpu


def expected_libtpu() -> str | None:
    """The libtpu version the installed jax names for its `tpu` extra (`0.0.50.*`), or None."""
    try:
        requirements = importlib.metadata.requires("jax") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        match = re.match(r"libtpu\s*==\s*([\w.*]+)", requirement)
        if match and 'extra == "tpu"' in requirement:
            return match.group(1)
    return None


def _matches(version: str, wanted: str) -> bool:
    if wanted.endswith(".*"):
        return version == wanted[:-2] or version.startswith(wanted[:-1])
    return version == wanted


def libtpu_problem() -> str | None:
    """Why this environment cannot compile TPU programs (libtpu missing, or not the version
    the installed jax names), with the one command that fixes it; None when it can."""
    wanted = expected_libtpu()
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return "jax is not installed"
    install = f"{sys.executable} -m pip install 'jax[tpu]=={jax_version}'"
    try:
        found = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return f"--topology needs libtpu (not installed); install it: {install}"
    if wanted is not None and not _matches(found, wanted):
        return (
            f"--topology: libtpu {found} is installed but jax {jax_version} needs libtpu "
            f"{wanted}; install it: {install}"
        )
    return None


def check(name: str, num_slices: int, devices_needed: int) -> Topology:
    """`--topology=name --num_slices=num_slices` for a mesh of `devices_needed` devices: the
    topology, or `BadInput` (an unknown name, a device count that is not the slices', libtpu
    missing or not the version jax names)."""
    topology = parse(name)
    have = topology.devices_per_slice * num_slices
    if have != devices_needed:
        raise BadInput(
            f"--topology={topology.name} x {num_slices} slice(s) has {have} devices but the "
            f"config's mesh needs {devices_needed}"
        )
    problem = libtpu_problem()
    if problem:
        raise BadInput(problem)
    return topology


def no_topology(num_slices: int | None) -> None:
    """Without `--topology`, `--num_slices` has nothing to count."""
    if num_slices is not None:
        raise BadInput("--num_slices: only with --topology")


def twins_target(
    cfg: Any, selected: Sequence[str], elsewhere: bool, name: str | None, num_slices: int | None
) -> Target | None:
    """`parity CONFIG --topology=name [--num_slices=N]` validated before JAX (the checks it
    compiles for, the slices against the config's `dcn_*` axes, the devices, libtpu); None
    without it. `elsewhere`: the sides run in other processes."""
    if name is None:
        no_topology(num_slices)
        return None
    if not {"compile", "program"} & set(selected):
        raise BadInput(
            "--topology: compiles the compile and program checks' programs for the slice; add "
            "--checks=compile (or program)"
        )
    if elsewhere:
        raise BadInput(
            "--topology: the TPU compile runs in this process (not with --num_processes, "
            "--linen_python/--nnx_python or --linen_path/--nnx_path)"
        )
    slices = cfg.num_slices if num_slices is None else num_slices
    if slices != cfg.num_slices:
        raise BadInput(
            f"--num_slices={slices}: the config's mesh spans {cfg.num_slices} slice(s) "
            f"(dcn_data_parallelism={cfg.dcn_data_parallelism} x "
            f"dcn_pipeline_parallelism={cfg.dcn_pipeline_parallelism})"
        )
    return Target(check(name, slices, cfg.num_devices), slices)
