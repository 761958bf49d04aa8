"""The MaxText gate's `compile` on a TPU slice: `parity --maxtext CONFIG --checks=compile
--topology=NAME [--num_slices=N]`. Each release's own `train_compile.py` (its topology devices,
mesh, shaped train state and train step, as shipped) runs in the release's environment with
`compile_topology=NAME`, through the training worker (`parity.maxtext.train_factory`); 0.2.5 is
held to 0.2.3 per device as on the CPU (`compile_check.records`: memory and FLOPs within
`COST_TOLERANCE`, not one collective more executed), and each to the chip's HBM, the compiler's
refusal a finding that names the release (`parity.tpu.check.overflow_result`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

from parity.analysis import hlo
from parity.analysis.compiled_cost import CompiledCost
from parity.engine.registry import Check, Front
from parity.engine.result import CheckResult, human_bytes
from parity.maxtext import compile_check, release_fault, train_worker
from parity.maxtext.gate_config import RELEASES, MaxTextConfig
from parity.remote.client import WorkerSet
from parity.remote.environments import Environment
from parity.remote.proxy import RemoteProgram
from parity.reports.progress import progress
from parity.tpu.check import SIDES, hbm_record, overflow_result
from parity.tpu.topologies import Target
from parity.tpu.train_step import Overflow


def compiled_on_slice(
    config: MaxTextConfig,
    environments: dict[str, Environment],
    target: Target,
    sides: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Each release's `train_compile` for `target`, in its worker: the facts it reported;
    what each worker runs (versions, interpreter) added to `sides`."""
    workers = WorkerSet()
    variables = {
        "DECOUPLE_GCLOUD": "TRUE",
        "JAX_PLATFORMS": "cpu",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # libtpu's process lock: both releases at once
    }
    facts: dict[str, dict[str, Any]] = {}
    try:
        trainers = train_worker.start(workers, config, environments, variables)
        releases = " and ".join(RELEASES[s] for s in SIDES)
        progress(f"compile: MaxText {releases}'s train_compile for {target.describe()}")

        def compile_on(side: str) -> dict[str, Any]:
            return trainers[side].train_compile(target.topology.name, target.num_slices)

        # Each release compiles in its own process: side by side, the slower one sets the time;
        # a release's own exception is a finding (`release_fault`), with the other's outcome.
        doing = f"train_compile for {target.describe()}"
        facts.update(
            release_fault.run_both(doing, {s: functools.partial(compile_on, s) for s in SIDES})
        )
        sides.update(
            {side: {**w.versions(), "interpreter": w.python} for side, w in workers.items()}
        )
    finally:
        workers.close()
    return facts


def slice_mesh(mesh_shape: dict[str, int], keys: dict[str, Any], target: Target) -> hlo.SliceMesh:
    """A release's mesh as its per-slice TPU program is read: each `dcn_<axis>_parallelism`
    key's share of its axis (`pipeline` is the `stage` axis; a -1 takes the slices left)."""
    dcn = {}
    for key, value in keys.items():
        if (m := re.fullmatch(r"dcn_(\w+)_parallelism", key)) and isinstance(value, int):
            dcn["stage" if m[1] == "pipeline" else m[1]] = value
    known = math.prod(n for n in dcn.values() if n > 0)
    dcn = {a: (target.num_slices // known if n == -1 else n) for a, n in dcn.items()}
    return hlo.SliceMesh(mesh_shape, dcn)


def verdict(target: Target, facts: dict[str, dict[str, Any]], keys: dict[str, Any]) -> CheckResult:
    """The releases' TPU train steps judged against each other and the chip."""
    compiled: dict[str, CompiledCost | Overflow] = {}
    for side in SIDES:
        if "overflow" in facts[side]:
            compiled[side] = Overflow.of(side, Exception(facts[side]["overflow"]))
        else:
            f = facts[side]
            compiled[side] = CompiledCost.of(
                RemoteProgram(f), f["compile_seconds"], f["compile_source"]
            )
    if any(isinstance(c, Overflow) for c in compiled.values()):
        return overflow_result(target, compiled)
    meshes = {side: slice_mesh(facts[side]["mesh_shape"], keys, target) for side in SIDES}
    usable = target.topology.usable_hbm_per_device
    fits = tuple(hbm_record(side, compiled[side], usable) for side in SIDES)
    hbm = ", ".join(
        f"{side} ({RELEASES[side]}) peak {human_bytes(compiled[side].peak_bytes)} = "
        f"{100 * compiled[side].peak_bytes / usable:.3g}% of HBM"
        for side in SIDES
    )
    lead = (
        f"each release's train_compile, XLA:TPU on {target.describe()}; "
        f"{human_bytes(usable)} HBM usable per device: {hbm}; per device (train step)"
    )
    return compile_check.verdict(compiled, meshes, lead, fits)


class SlicePair:
    """Both releases' `train_compile` for one TPU slice: the one pair of `Front.MAXTEXT_SLICE`,
    whose one check is `compile` (`compile_on_slice`)."""

    front = Front.MAXTEXT_SLICE

    def __init__(
        self, config: MaxTextConfig, environments: dict[str, Environment], target: Target
    ) -> None:
        self.config, self.environments, self.target = config, environments, target
        self.sides: dict[str, dict[str, Any]] = {}  # each release's versions, once compiled

    def prepared(self, check: Check, function: Callable[..., Any]) -> Callable[..., Any]:
        """A release's own exception is the verdict (`release_fault.guarded`)."""
        return release_fault.guarded(check.name, function)


def compile_on_slice(pair: SlicePair) -> CheckResult:
    """`compile` on a slice: each release's train step compiled by XLA:TPU, then judged."""
    facts = compiled_on_slice(pair.config, pair.environments, pair.target, pair.sides)
    return verdict(pair.target, facts, pair.config.keys)


def run_on_slice(
    config: MaxTextConfig, environments: dict[str, Environment], target: Target
) -> tuple[list, list, dict[str, dict[str, Any]]]:
    """`parity maxtext CONFIG --checks=compile --topology=...`: (results, costs, sides), as
    `release_pair.run_gate` returns them; the workers stop however the check ends."""
    from parity.engine import run_loop

    pair = SlicePair(config, environments, target)
    results, costs = run_loop.run_checks(pair, ["compile"])
    return results, costs, pair.sides
