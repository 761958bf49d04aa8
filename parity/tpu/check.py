"""The `compile` check on a TPU slice (`parity CONFIG --checks=compile --topology=NAME`): both
twins' whole train steps compiled by XLA:TPU for the slice, held to what the CPU check holds
(NNX <= Linen x (1 + COST_TOLERANCE) per device, equal collectives, the pipeline loops'
collectives) and to the chip: each side must fit one device's HBM, as the compiler judges it.
A side the compiler refuses for HBM is a finding (exit 1) that names it, with the compiler's
own words; both refused is a config that does not fit the slice.
"""

from __future__ import annotations

from migrate.config.contract import Config
from parity.decoder.checks import cost_result
from parity.decoder.cost import CompiledCost
from parity.engine.result import CheckResult, human_bytes
from parity.tpu import devices, train_step
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
        f"{human_bytes(usable - compiled.peak_bytes)}, step >= {compiled.optimal_seconds:.3g}s"
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


def compile_on_topology(cfg: Config, target: Target) -> CheckResult:
    """Both twins' train steps compiled for `target`, judged against each other and the chip."""
    mesh, layout = devices.make_mesh(cfg, target.topology, target.num_slices)
    compiled = {f: train_step.compile_step(cfg, mesh, f) for f in SIDES}
    if any(isinstance(c, Overflow) for c in compiled.values()):
        return overflow_result(target, compiled)
    usable = target.topology.usable_hbm_per_device
    fits = [hbm_record(f, compiled[f], usable) for f in SIDES]
    lead = (
        f"XLA:TPU on {target.describe()}, mesh laid on the {layout}; "
        f"{human_bytes(usable)} HBM usable per device: "
        + ", ".join(_fit_line(f, compiled[f], usable) for f in SIDES)
        + "; per device"
    )
    return cost_result(cfg, mesh, compiled["linen"], compiled["nnx"], tuple(fits), lead)
