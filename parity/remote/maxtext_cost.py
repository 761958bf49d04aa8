"""The `compile` check of the MaxText gate: each release's compiled forward+backward program
(the one `sharding` and `program` read, compiled by its worker on its own mesh), per device:
memory (arguments, temp, outputs, peak), FLOPs, collectives in the whole program and per
pipeline-loop body across the `stage` axis.

The releases' programs differ (0.2.3's Linen pipeline and 0.2.5's NNX one are different code),
so nothing here is held equal: the NNX release may not cost more than the Linen one, per
field beyond `checks.COST_TOLERANCE`, per collective kind not one more. A pipeline loop is an
outermost while loop of the program whose body rotates data across stages (a
collective-permute over `stage`): MaxText's iteration loop, forward and backward, wherever its
scan or remat puts it; the gate does not assume MaxText's trip counts.
"""

from __future__ import annotations

from typing import Any

from parity.analysis import hlo
from parity.decoder.checks import COST_TOLERANCE, _bytes
from parity.decoder.cost import DIRECTIONS, CompiledCost
from parity.engine.result import CheckResult

SOURCES = ("linen", "nnx")
FIELDS = ("temp_bytes", "flops", "argument_bytes", "output_bytes", "peak_bytes", "alias_bytes")
INFORMATIONAL = ("bytes_accessed", "generated_code_bytes", "compile_seconds")


def _crosses_stages(collective: hlo.Collective, mesh_shape: dict[str, int]) -> bool:
    return "stage" in collective.mesh_axes(mesh_shape)


def pipeline_loops(cost: CompiledCost, mesh_shape: dict[str, int]) -> list[hlo.Loop]:
    """The outermost loops whose body permutes across the stage axis."""
    return [
        loop
        for loop in cost.loops
        if any(
            c.kind == "collective-permute" and _crosses_stages(c, mesh_shape)
            for c in loop.collectives
        )
    ]


def loop_counts(cost: CompiledCost, mesh_shape: dict[str, int]) -> dict[str, Any]:
    """Per direction: pipeline loops found, their trip counts, and per kind the collectives
    of their bodies across stages and within stages."""
    out: dict[str, Any] = {}
    for direction in DIRECTIONS:
        loops = [loop for loop in pipeline_loops(cost, mesh_shape) if loop.direction == direction]
        across = dict.fromkeys(hlo.COLLECTIVES, 0)
        within = dict.fromkeys(hlo.COLLECTIVES, 0)
        for loop in loops:
            for c in loop.collectives:
                (across if _crosses_stages(c, mesh_shape) else within)[c.kind] += 1
        out[direction] = {
            "loops": len(loops),
            "trips": [loop.trip_count for loop in loops],
            "across": across,
            "within": within,
        }
    return out


def _no_more(tensor: str, linen: float, nnx: float, tolerance: float = 0.0) -> dict:
    ratio = nnx / linen if linen else (1.0 if not nnx else float("inf"))
    excess = max(ratio - 1.0, 0.0) if tolerance else float(max(nnx - linen, 0))
    return {
        "tensor": tensor,
        "linen": linen,
        "nnx": nnx,
        "ratio": ratio,
        "max_rel": excess,
        "passed": excess <= tolerance,
    }


def records(costs: dict[str, CompiledCost], meshes: dict[str, dict[str, int]]) -> list[dict]:
    """The check's records: memory and FLOPs (NNX within COST_TOLERANCE of Linen), every
    collective kind in the program and per loop body (NNX not one more), the loops found."""
    linen, nnx = costs["linen"], costs["nnx"]
    out = [_no_more(f, getattr(linen, f), getattr(nnx, f), COST_TOLERANCE) for f in FIELDS]
    for field in INFORMATIONAL:
        out.append(
            {"tensor": field, "linen": getattr(linen, field), "nnx": getattr(nnx, field),
             "max_rel": 0.0, "passed": True, "gated": False}
        )  # fmt: skip
    for kind in hlo.COLLECTIVES:
        if linen.collectives[kind] or nnx.collectives[kind]:
            out.append(
                _no_more(f"collectives: {kind}", linen.collectives[kind], nnx.collectives[kind])
            )
    loops = {f: loop_counts(costs[f], meshes[f]) for f in SOURCES}
    for direction in DIRECTIONS:
        found = {f: loops[f][direction]["loops"] for f in SOURCES}
        out.append(
            {
                "tensor": f"pipeline loops {direction}",
                **found,
                "trips": {f: loops[f][direction]["trips"] for f in SOURCES},
                "max_rel": float(found["linen"] != found["nnx"]),
                "passed": found["linen"] == found["nnx"],
            }
        )
        for where in ("across", "within"):
            for kind in hlo.COLLECTIVES:
                seen = {f: loops[f][direction][where][kind] for f in SOURCES}
                if any(seen.values()):
                    label = f"loop body {direction}: {kind} {where} stages"
                    out.append(_no_more(label, seen["linen"], seen["nnx"]))
    return out


def _summary(name: str, cost: CompiledCost, loops: dict[str, Any]) -> str:
    body = "/".join(str(sum(loops[d]["across"].values())) for d in DIRECTIONS)
    return (
        f"{name} args {_bytes(cost.argument_bytes)} + temp {_bytes(cost.temp_bytes)} + out "
        f"{_bytes(cost.output_bytes)} = peak {_bytes(cost.peak_bytes)}, {cost.flops:.3g} flops, "
        f"{sum(cost.collectives.values())} collectives, {body} across stages per loop body "
        f"fwd/bwd, compiled in {cost.compile_seconds:.1f}s"
    )


def compile_check(pair: Any) -> CheckResult:
    """Both releases' forward+backward programs as their workers compiled them."""
    programs = {f: pair.compiled(f) for f in SOURCES}
    costs = {
        f: CompiledCost.of(p, p.facts.get("compile_seconds", 0.0)) for f, p in programs.items()
    }
    # Each release's own mesh (their axis lists differ: 0.2.5 added `context_usp_ulysses` and
    # dropped `tensor_transpose`); the axes that split devices must be the same.
    meshes = {f: p.facts.get("mesh_shape") or {} for f, p in programs.items()}
    used = {f: {a: n for a, n in m.items() if n > 1} for f, m in meshes.items()}
    if not used["linen"] or used["linen"] != used["nnx"]:
        raise ValueError(f"the releases' meshes split devices differently: {used}")
    found = records(costs, meshes)
    failing = [r for r in found if not r["passed"]]
    gated = [r for r in found if r.get("gated", True)]
    worst = failing[0] if failing else max(gated, key=lambda r: r["max_rel"])
    same = costs["linen"].program == costs["nnx"].program
    loops = {f: loop_counts(costs[f], meshes[f]) for f in SOURCES}
    per_device = "; ".join(_summary(f, costs[f], loops[f]) for f in SOURCES)
    per_device += "; same optimised program" if same else "; programs differ"
    return CheckResult(
        name="compile",
        passed=not failing,
        metric="nnx/linen-1",
        value=worst["max_rel"],
        tolerance=COST_TOLERANCE,
        where=worst["tensor"],
        details=tuple(found),
        message=f"per device (forward+backward): {per_device}",
    )
