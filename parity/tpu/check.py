"""The `compile` check on a TPU slice (`parity CONFIG --checks=compile --topology=NAME`): both
twins' whole train steps compiled by XLA:TPU for the slice, held to what the CPU check holds
(NNX <= Linen x (1 + COST_TOLERANCE) per device, equal collectives, the pipeline loops'
collectives) and to the chip: each side must fit one device's HBM, as the compiler judges it.
A side the compiler refuses for HBM is a finding (exit 1) that names it, with the compiler's
own words; both refused is a config that does not fit the slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from migrate.config.contract import Config
from parity.analysis import hlo
from parity.analysis.compiled_cost import CompiledCost
from parity.engine.result import CheckResult, human_bytes
from parity.tpu import compile_devices, train_step
from parity.tpu.topologies import Target
from parity.tpu.train_step import Overflow

SIDES = ("linen", "nnx")


def hbm_record(framework: str, compiled: CompiledCost, usable: int) -> dict:
    """One side's peak per device against the HBM one device may use (reported; the
    compiler already refused what does not fit)."""
    return {
        "tensor": f"HBM ({framework})",
        framework: compiled.peak_bytes,
        "hbm_bytes": usable,
        "share": compiled.peak_bytes / usable,
        "margin_bytes": usable - compiled.peak_bytes,
        "max_rel": 0.0,
        "passed": True,
        "gated": False,
    }


def _fit_line(framework: str, compiled: CompiledCost, usable: int) -> str:
    return (
        f"{framework} peak {human_bytes(compiled.peak_bytes)} = "
        f"{100 * compiled.peak_bytes / usable:.3g}% of HBM, margin "
        f"{human_bytes(usable - compiled.peak_bytes)}, "
        + (
            f"step >= {compiled.optimal_seconds:.3g}s"
            if compiled.optimal_seconds > 0
            else "no step estimate"  # XLA:TPU gives none (negative) for a multi-slice program
        )
    )


def overflow_result(target: Target, compiled: dict[str, CompiledCost | Overflow]) -> CheckResult:
    """The verdict when the compiler refused one side or both for HBM."""
    usable = target.topology.usable_hbm_per_device
    refused = [f for f in SIDES if isinstance(compiled[f], Overflow)]
    records = []
    for framework in SIDES:
        found = compiled[framework]
        if isinstance(found, Overflow):
            records.append(
                {
                    "tensor": f"HBM ({framework})",
                    framework: found.required_bytes,
                    "hbm_bytes": found.available_bytes or usable,
                    "what": found.what,
                    "compiler": found.message,
                    "max_rel": 1.0,
                    "passed": False,
                }
            )
        else:
            records.append(hbm_record(framework, found, usable))
    words = "; ".join(f"{f}: {compiled[f].message}" for f in refused)
    if len(refused) == len(SIDES):
        where = "HBM (both sides)"
        message = f"neither side's train step fits one device of {target.describe()}: {words}"
    else:
        (side,) = refused
        other = next(f for f in SIDES if f != side)
        where = f"HBM ({side})"
        message = (
            f"{side}'s train step does not fit one device of {target.describe()} where "
            f"{other}'s does ({_fit_line(other, compiled[other], usable)}): {words}"
        )
    value = max(
        (compiled[f].required_bytes or 0) / (compiled[f].available_bytes or usable) for f in refused
    )
    return CheckResult(
        name="compile",
        passed=False,
        metric="HBM needed/available",
        value=value,
        tolerance=1.0,
        where=where,
        details=tuple(records),
        message=message,
    )


@dataclasses.dataclass(frozen=True)
class OnSlice:
    """Both twins' train steps compiled for a slice: each a cost, or the compiler's refusal."""

    target: Target
    mesh: Mesh
    layout: str  # how the mesh was laid on the slice's devices
    programs: dict[str, train_step.SliceProgram]

    @property
    def compiled(self) -> dict[str, CompiledCost | Overflow]:
        return {f: p.cost for f, p in self.programs.items()}

    def lowered(self, framework: str) -> jax.stages.Lowered:
        """As `programs.program` reads a pair's programs."""
        return self.programs[framework].lowered

    def executable(self, framework: str) -> jax.stages.Compiled:
        found = self.programs[framework].executable
        if found is None:
            raise ValueError(f"{framework}: {self.compiled[framework].message}")
        return found

    @property
    def refused(self) -> bool:
        return any(isinstance(c, Overflow) for c in self.compiled.values())

    def mesh_shape(self, cfg: Config) -> hlo.SliceMesh:
        """The mesh's shape as the slice's programs are read: XLA:TPU compiles a multi-slice
        program per slice, its partitions one slice's devices."""
        dcn = {"data": cfg.dcn_data_parallelism, "stage": cfg.dcn_pipeline_parallelism}
        return hlo.SliceMesh(dict(self.mesh.shape), dcn)

    def fit_records(self) -> tuple[dict, ...]:
        usable = self.target.topology.usable_hbm_per_device
        return tuple(hbm_record(f, self.compiled[f], usable) for f in SIDES)

    def lead(self) -> str:
        """The verdict's opening: the slice, how the mesh lies on it, each side against HBM."""
        usable = self.target.topology.usable_hbm_per_device
        return (
            f"XLA:TPU on {self.target.describe()}, mesh laid on the {self.layout}; "
            f"{human_bytes(usable)} HBM usable per device: "
            + ", ".join(_fit_line(f, self.compiled[f], usable) for f in SIDES)
            + "; per device"
        )


def compile_on_slice(
    cfg: Config, target: Target, lower: Callable[[Mesh, str], jax.stages.Lowered]
) -> OnSlice:
    """Both sides' train steps (`lower(mesh, side)`: each lowered for the slice's mesh)
    compiled for `target` (the `compile` check's verdict on them is the caller's, or
    `overflow_result` where the compiler refused one)."""
    mesh, layout = compile_devices.make_mesh(cfg, target.topology, target.num_slices)
    compiled = {f: train_step.compile_step(lower(mesh, f), f) for f in SIDES}
    return OnSlice(target, mesh, layout, compiled)


class _Programs:
    """The twins' TPU programs, read as `programs.program` reads a pair's."""

    def __init__(self, on_slice: OnSlice) -> None:
        self.lowered, self.compiled = on_slice.lowered, on_slice.executable


def program_on_slice(on_slice: OnSlice) -> CheckResult:
    """The `program` check on the TPU programs: both train steps, before and after XLA:TPU's
    optimisation, instruction by instruction."""
    from parity.engine import programs

    result = programs.program(_Programs(on_slice))
    lead = f"XLA:TPU on {on_slice.target.describe()}: "
    return dataclasses.replace(result, message=lead + result.message)
