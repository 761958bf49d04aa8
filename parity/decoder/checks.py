"""The checks only a pipelined decoder has (`parity.engine.registry` lists every check).

`pipeline` (pipelined against the non-pipelined reference, within each framework), `bubbles`
(NaN in the pipeline buffers reaches nothing), `compile` (both twins' train steps compiled from
abstract inputs: memory, FLOPs, collectives, the loop body at the schedule's minimum),
`efficiency` (the pipeline's matmul work against the schedule's theory) and `program` (the
engine's, or with `--topology` the TPU programs) take a `DecoderPair`.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh

from migrate.config.contract import Config
from parity.analysis import compare, hlo
from parity.analysis.compiled_cost import COST_TOLERANCE
from parity.decoder import cost, slices
from parity.decoder import efficiency as pipeline_work
from parity.decoder.session import BUBBLE_POISON, DecoderPair
from parity.engine import programs
from parity.engine.numeric import run_records, vacuity
from parity.engine.result import CheckResult, human_bytes, skipped, verdict

# The pipeline check's parts: the global gradient norm clipping uses, computed on device from
# the gradients as sharded over stage, fsdp and tensor, must equal the unpipelined reference's.
PIPELINE_PARTS = ("loss", "logits", "grads", "grad_norm")


def pipeline(pair: DecoderPair) -> CheckResult:
    """Pipelined against reference decoder, within each framework, same weights."""
    cfg = pair.cfg
    tol = compare.reshaped_tolerance(cfg)
    if not cfg.using_pipeline:
        return skipped(
            "pipeline", "max_rel", tol.max_rel, "config does not pipeline (S=1): nothing to compare"
        )
    records, named = [], {}
    for framework in ("linen", "nnx"):
        pipelined, reference = pair.pipelined_run(framework), pair.reference_run(framework)
        named |= {f"{framework} pipelined": pipelined, f"{framework} reference": reference}
        records += run_records(
            f"{framework}/",
            pipelined,
            reference,
            tol,
            (*PIPELINE_PARTS, *pair.aux_parts),
            pair.output_name,
        )
    return verdict("pipeline", records, tol, vacuity(pair, named), rank=pair.rank)


def bubbles(pair: DecoderPair) -> CheckResult:
    """Both twins with NaN in every pipeline buffer slot that no stage has written yet:
    logits, loss and every gradient bit-identical to the zero-filled run. Idle slots that
    compute on unmasked buffers pass the forward (their outputs are discarded) but put NaN into
    the weight gradients (NaN x 0 is NaN)."""
    if not pair.cfg.using_pipeline:
        return skipped("bubbles", "max_rel", 0.0, "config does not pipeline (S=1): no bubbles")
    records = []
    for framework in ("linen", "nnx"):
        poisoned = pair.filled_run(framework, BUBBLE_POISON)
        clean = pair.filled_run(framework, 0.0)
        parts = ("logits", "loss", *pair.aux_parts, "grads")
        for record in run_records(
            f"{framework}/", poisoned, clean, compare.EXACT, parts, pair.output_name
        ):
            records.append(record | {"passed": record["passed"] and record["mismatches"] == 0})
    result = verdict("bubbles", records, compare.EXACT, rank=pair.rank)
    note = (
        "NaN-filled buffers: bit-identical to zero-filled"
        if result.passed
        else (
            "NaN or a difference reached an output or gradient from an idle pipeline slot: "
            "mask the stage input of idle slots, not only the discarded output"
        )
    )
    return dataclasses.replace(result, message=note)


# Reported, not held: how long the compile took, the traffic and code size XLA estimates, and
# the compiler's step-time estimate (XLA:TPU's; none on the CPU).
INFORMATIONAL_COSTS = (
    "compile_seconds",
    "bytes_accessed",
    "generated_code_bytes",
    "optimal_seconds",
)
# Pipeline matmul work against `(M*R + d*(S-1)) / (M*R)`. Both are exact counts (dot FLOPs read
# off the compiled HLO), measured equal on every shipped config, mesh and dtype (docs/configs.md);
# the margin only allows for XLA rewriting a tiny dot into elementwise code.
EFFICIENCY_TOLERANCE = 0.001


def program(pair: DecoderPair) -> CheckResult:
    """Both train steps compared instruction by instruction (`programs.program`); with
    `--topology`, the programs XLA:TPU compiled for the slice."""
    if pair.topology is None:
        return programs.program(pair)
    from parity.tpu import check as tpu_check

    return tpu_check.program_on_slice(pair.on_slice())


def compile_cost(pair: DecoderPair) -> CheckResult:
    """Both twins' whole train steps compiled from abstract inputs (no weights allocated):
    per-device memory (arguments, temp, outputs, the bytes aliased by donation, and the peak
    they add up to), FLOPs, bytes accessed, collectives, compile time; NNX must not cost more
    than Linen beyond COST_TOLERANCE, must alias as much, and must issue the same
    collectives."""
    cfg, mesh = pair.cfg, pair.mesh
    if pair.topology is not None:  # `--topology`: XLA:TPU's programs
        from parity.tpu import check as tpu_check

        on_slice = pair.on_slice()
        if on_slice.refused:
            return tpu_check.overflow_result(on_slice.target, on_slice.compiled)
        linen_cost, nnx_cost = (on_slice.compiled[f] for f in ("linen", "nnx"))
        return cost_result(
            cfg,
            on_slice.mesh,
            linen_cost,
            nnx_cost,
            on_slice.fit_records(),
            on_slice.lead(),
            on_slice.mesh_shape(cfg),
        )
    linen_cost, nnx_cost = (
        cost.compile_train_step(cfg, mesh, f, pair.train_step_lowered(f)) for f in ("linen", "nnx")
    )
    return cost_result(cfg, mesh, linen_cost, nnx_cost)


def cost_result(
    cfg: Config,
    mesh: Mesh,
    linen_cost: cost.CompiledCost,
    nnx_cost: cost.CompiledCost,
    leading: tuple[dict, ...] = (),
    lead: str = "per device",
    mesh_shape: dict[str, int] | None = None,
) -> CheckResult:
    """The `compile` verdict on two compiled train steps (`compile_cost`'s; on a TPU slice,
    `parity.tpu.check`'s, which puts its HBM records first: `leading`, gated like the rest)."""
    mesh_shape = dict(mesh.shape) if mesh_shape is None else mesh_shape
    records, loop_summary = loop_body_records(cfg, mesh_shape, linen_cost, nnx_cost)
    records = [*leading, *records]
    for field in (
        "temp_bytes",
        "flops",
        "argument_bytes",
        "output_bytes",
        "alias_bytes",
        "peak_bytes",
        "bytes_accessed",
        "generated_code_bytes",
        "compile_seconds",
        "optimal_seconds",
    ):
        linen_value, nnx_value = getattr(linen_cost, field), getattr(nnx_cost, field)
        ratio = nnx_value / linen_value if linen_value else (1.0 if not nnx_value else math.inf)
        gated = field not in INFORMATIONAL_COSTS
        # More aliasing is not a cost, but a difference either way means the twins donate
        # differently: alias_bytes is held both ways.
        excess = abs(ratio - 1.0) if field == "alias_bytes" else max(ratio - 1.0, 0.0)
        records.append(
            {
                "tensor": field,
                "linen": linen_value,
                "nnx": nnx_value,
                "ratio": ratio,
                "max_rel": excess,
                "passed": not gated or excess <= COST_TOLERANCE,
                "gated": gated,
            }
        )
    for kind in hlo.COLLECTIVES:
        a, b = linen_cost.collectives[kind], nnx_cost.collectives[kind]
        records.append(
            {
                "tensor": f"collectives: {kind}",
                "linen": a,
                "nnx": b,
                "ratio": b / a if a else float(b == 0),
                "max_rel": 0.0 if a == b else 1.0,
                "passed": a == b,
            }
        )
    records += cost.remat_records(linen_cost, nnx_cost)
    outside, outside_summary = outside_loop_records(mesh_shape, linen_cost, nnx_cost)
    records += outside
    slice_records, slice_summary = slices.records(cfg, mesh, linen_cost, nnx_cost)
    records += slice_records
    failing = [r for r in records if not r["passed"]]
    # The worst of what is gated: compile time and bytes accessed are reported, not held;
    # loop-body counts are gated against their own minimum.
    gated = [r for r in records if r.get("gated", True) and not r["tensor"].startswith("loop body")]
    worst = failing[0] if failing else max(gated, key=lambda r: r["max_rel"])
    same_program = linen_cost.program == nnx_cost.program
    records.append(
        {
            "tensor": "optimised program",
            "linen": linen_cost.program,
            "nnx": nnx_cost.program,
            "max_rel": 0.0,
            "passed": True,
            "note": "same" if same_program else "different (informational)",
        }
    )
    per_device = ", ".join(
        f"{name} args {human_bytes(c.argument_bytes)} + temp {human_bytes(c.temp_bytes)} + "
        f"out {human_bytes(c.output_bytes)} - aliased {human_bytes(c.alias_bytes)} = peak "
        f"{human_bytes(c.peak_bytes)}, {c.flops:.3g} flops, {c.compile_source}"
        for name, c in (("linen", linen_cost), ("nnx", nnx_cost))
    )
    per_device += "; same optimised program" if same_program else "; programs differ"
    per_device += f"; {loop_summary}; {outside_summary}"
    per_device += f"; {slice_summary}" if slice_summary else ""
    return CheckResult(
        name="compile",
        passed=not failing,
        metric="nnx/linen-1",
        value=worst["max_rel"],
        tolerance=COST_TOLERANCE,
        where=worst["tensor"],
        details=tuple(records),
        message=f"{lead}: {per_device}",
    )


def loop_body_records(
    cfg: Config, mesh_shape: dict[str, int], linen_cost, nnx_cost
) -> tuple[list[dict], str]:
    """Records of the collectives in both twins' pipeline-loop bodies against
    `cost.loop_body_minimum` (across stages), the ag-once rule (no all-gather over fsdp in
    the loop), and the loops' presence; plus a one-line summary."""
    per_slice = slices.per_slice(linen_cost) or slices.per_slice(nnx_cost)
    minimum = cost.loop_body_minimum(cfg, per_slice)
    if not minimum:
        note = "no iteration loop (S == 1 or iterations unrolled)"
        return [{"tensor": "loop body", "max_rel": 0.0, "passed": True, "note": note}], note
    counts = {
        "linen": cost.loop_body_counts(linen_cost, cfg, mesh_shape),
        "nnx": cost.loop_body_counts(nnx_cost, cfg, mesh_shape),
    }
    records = []
    for direction in cost.DIRECTIONS:
        for framework, found in counts.items():
            if found.loops_found[direction] != 1:
                records.append(
                    {
                        "tensor": f"loop body {direction} ({framework}): loops found",
                        framework: found.loops_found[direction],
                        "minimum": 1,
                        "max_rel": 1.0,
                        "passed": False,
                    }
                )
        for kind in hlo.COLLECTIVES:
            allowed = minimum[direction][kind]
            seen = {fw: c.across_stages[direction][kind] for fw, c in counts.items()}
            if not allowed and not any(seen.values()):
                continue
            excess = max(seen.values()) - allowed
            records.append(
                {
                    "tensor": f"loop body {direction}: {kind} across stages",
                    **seen,
                    "minimum": allowed,
                    "instructions": {
                        fw: c.across_names[direction][kind] for fw, c in counts.items()
                    },
                    "max_rel": float(max(excess, 0)),
                    "passed": excess <= 0,
                }
            )
        if cfg.pipeline_fsdp_ag_once or cfg.pipeline_fsdp_ag_per_repeat:
            mode = "ag-once" if cfg.pipeline_fsdp_ag_once else "ag-per-repeat"
            seen = {fw: c.fsdp_all_gathers[direction] for fw, c in counts.items()}
            records.append(
                {
                    "tensor": f"loop body {direction}: all-gather over fsdp ({mode})",
                    **seen,
                    "minimum": 0,
                    "max_rel": float(max(seen.values())),
                    "passed": not any(seen.values()),
                }
            )
        if cfg.pipeline_fsdp_ag_per_repeat and cfg.ici_fsdp_parallelism > 1 and cfg.num_repeats > 2:
            # The window's gather must stay in the repeat loop: hoisted before it, all R
            # repeats are gathered at once (ag-once's memory). With R = 2 the two-repeat window
            # is the whole stack, the same in every block: XLA rightly hoists it (ag-once).
            seen = {fw: c.repeat_fsdp_all_gathers[direction] for fw, c in counts.items()}
            records.append(
                {
                    "tensor": f"repeat body {direction}: all-gather over fsdp (ag-per-repeat)",
                    **seen,
                    "minimum": 1,
                    "max_rel": float(min(seen.values()) < 1),
                    "passed": min(seen.values()) >= 1 and len(set(seen.values())) == 1,
                }
            )
        records.append(
            {
                "tensor": f"loop body {direction}: within stages",
                **{fw: _kinds(c.within_stages[direction]) for fw, c in counts.items()},
                "max_rel": 0.0,
                "passed": True,
                "note": "the layers' own (data, fsdp, tensor); informational",
            }
        )
    nnx_counts = counts["nnx"].across_stages
    summary = "loop body across stages fwd/bwd: " + ", ".join(
        f"{kind} {nnx_counts['forward'][kind]}/{nnx_counts['backward'][kind]} "
        f"(minimum {minimum['forward'][kind]}/{minimum['backward'][kind]})"
        for kind in hlo.COLLECTIVES
        if minimum["forward"][kind] or nnx_counts["forward"][kind] or nnx_counts["backward"][kind]
    )
    return records, summary


def outside_loop_records(
    mesh_shape: dict[str, int], linen_cost, nnx_cost
) -> tuple[list[dict], str]:
    """Per direction and kind, the collectives across stages outside the loops
    (`cost.outside_loop_counts`: the reshards into and out of the pipeline among them), which
    the twins must issue alike; plus a one-line summary."""
    counts = {
        "linen": cost.outside_loop_counts(linen_cost, mesh_shape),
        "nnx": cost.outside_loop_counts(nnx_cost, mesh_shape),
    }
    records = []
    for direction in cost.DIRECTIONS:
        for kind in hlo.COLLECTIVES:
            seen = {fw: c[direction][kind] for fw, c in counts.items()}
            if any(seen.values()):
                records.append(
                    {
                        "tensor": f"outside the loop {direction}: {kind} across stages",
                        **seen,
                        "max_rel": 0.0 if seen["linen"] == seen["nnx"] else 1.0,
                        "passed": seen["linen"] == seen["nnx"],
                    }
                )
    nnx_counts = counts["nnx"]
    summary = "outside the loop across stages fwd/bwd: " + (
        ", ".join(
            f"{kind} {nnx_counts['forward'][kind]}/{nnx_counts['backward'][kind]}"
            for kind in hlo.COLLECTIVES
            if nnx_counts["forward"][kind] or nnx_counts["backward"][kind]
        )
        or "none"
    )
    return records, summary


def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in counts.items() if n) or "none"


# The theory's formula: all N layers pipelined, or P of them with N - P after the pipeline.
THEORY = {
    False: "(M*R + d*(S-1))/(M*R)",
    True: "(P*(M*R + d*(S-1))/(M*R) + N-P)/N",
}


def efficiency(pair: DecoderPair) -> CheckResult:
    """The matmul work the compiled pipeline performs (per-device dot FLOPs x devices) against
    the useful work (every layer once on the full batch) and the schedule's theory; the loop's
    elementwise overhead is reported beside it."""
    cfg = pair.cfg
    if not cfg.using_pipeline:
        return skipped(
            "efficiency", "overhead_error", EFFICIENCY_TOLERANCE, "config does not pipeline (S=1)"
        )
    measured = pipeline_work.pipeline_efficiency(cfg, pair.mesh)
    record = {
        "tensor": "pipeline matmul overhead",
        "measured": measured.measured_overhead,
        "theoretical": measured.theoretical_overhead,
        "pipeline_dot_flops": measured.pipeline_dot_flops,
        "reference_dot_flops": measured.reference_dot_flops,
        "pipeline_flops": measured.pipeline_flops,
        "reference_flops": measured.reference_flops,
        "loop_elementwise_overhead": measured.loop_elementwise_overhead,
        "max_rel": measured.relative_error,
        "passed": measured.relative_error <= EFFICIENCY_TOLERANCE,
    }
    return CheckResult(
        "efficiency",
        record["passed"],
        "overhead_error",
        measured.relative_error,
        EFFICIENCY_TOLERANCE,
        "pipeline matmul overhead",
        details=(record,),
        message=f"matmul work {measured.measured_overhead:.4f} x the useful work vs "
        f"{THEORY[cfg.num_layers_after_pipeline > 0]} = {measured.theoretical_overhead:.4f}; "
        "the loop's elementwise "
        f"work adds {measured.loop_elementwise_overhead:.2%} of the matmul work",
    )
