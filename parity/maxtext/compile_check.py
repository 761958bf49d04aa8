"""The `compile` check of the MaxText gate: each release's compiled forward+backward program
(the one `sharding` and `program` read, compiled by its worker on its own mesh), per device:
memory (arguments, temp, outputs, peak), FLOPs, and the collectives one run executes.

The releases' programs differ (0.2.3's Linen pipeline and 0.2.5's NNX one are different code),
so nothing here is held equal: the NNX release may not cost more than the Linen one, per field
beyond `checks.COST_TOLERANCE`, and may not execute one collective more of any kind, across or
within stages. Collectives are counted as executed (a loop body's times its trip count, nested
loops multiplied), because the releases lay their loops out differently; the collectives as
written in the program and the pipeline loops' trip counts are shown beside, not gated.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from parity.analysis import hlo
from parity.analysis.compiled_cost import COST_TOLERANCE, DIRECTIONS, CompiledCost
from parity.engine.result import CheckResult, human_bytes

SOURCES = ("linen", "nnx")
FIELDS = ("temp_bytes", "flops", "argument_bytes", "output_bytes", "peak_bytes", "alias_bytes")
INFORMATIONAL = ("bytes_accessed", "generated_code_bytes", "compile_seconds", "optimal_seconds")


# Collectives of RNG key data (JAX's key arrays are unsigned 32-bit) are counted apart, shown and
# not gated: 0.2.5's NNX train step carries its `nnx.Rngs` streams' keys through the pipeline
# loop and gathers them across stages after it, which 0.2.3's Linen step (one key, split inside)
# does not. Measured on configs/maxtext/tpu/llama2-7b-pp2.yml for v5p-16: 6 all-gathers more
# across stages (u32[8,2,4] x 3 and u32[2,1,8] x 3, out of `jvp()/while`), every other
# collective executed the same, temp +0.9 MB per device (docs/tpu.md).
RNG_KEY_DTYPES = ("u32",)
RNG_KEYS = "of RNG key data"


def _kind(collective: hlo.Collective) -> str:
    """What a collective counts as: its kind, or its kind of RNG key data (`RNG_KEY_DTYPES`)."""
    if collective.dtype in RNG_KEY_DTYPES:
        return f"{collective.kind} {RNG_KEYS}"
    return collective.kind


def _crosses_stages(collective: hlo.Collective, mesh_shape: dict[str, int]) -> bool:
    return "stage" in collective.mesh_axes(mesh_shape)


def _where(collective: hlo.Collective, mesh_shape: dict[str, int]) -> str:
    return "across" if _crosses_stages(collective, mesh_shape) else "within"


def executed(cost: CompiledCost, mesh_shape: dict[str, int]) -> Counter:
    """Collectives one run of the program executes, by (across|within stages, kind): those
    outside the loops once, a loop body's times its trip count (nested loops multiplied). The
    releases structure their loops differently (0.2.3 unrolls the repeats of
    `pipeline_fsdp_ag_per_repeat` into one loop each, 0.2.5 nests the iteration loop in a loop
    over repeats), so what is compared is what runs, not what is written."""
    counts: Counter = Counter()
    for _, c in cost.outside_loops:
        counts[_where(c, mesh_shape), _kind(c)] += 1

    def visit(loop: hlo.Loop, times: int) -> None:
        times *= loop.trip_count or 1
        for c in loop.own_collectives():
            counts[_where(c, mesh_shape), _kind(c)] += times
        for inner in loop.inner:
            visit(inner, times)

    for loop in cost.loops:
        visit(loop, 1)
    return counts


def loop_structure(cost: CompiledCost, mesh_shape: dict[str, int]) -> dict[str, list]:
    """Per direction, the trip counts of the outermost loops that permute across stages (the
    pipeline's iteration loops, or the loops over repeats around them), inner trips nested."""

    def trips(loop: hlo.Loop) -> Any:
        inner = [
            trips(i)
            for i in loop.inner
            if any(c.kind == "collective-permute" for c in i.collectives)
        ]
        return [loop.trip_count, inner] if inner else loop.trip_count

    out: dict[str, list] = {d: [] for d in DIRECTIONS}
    for loop in cost.loops:
        if any(
            c.kind == "collective-permute" and _crosses_stages(c, mesh_shape)
            for c in loop.collectives
        ):
            out[loop.direction].append(trips(loop))
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


def _shown(tensor: str, linen: Any, nnx: Any) -> dict:
    return {
        "tensor": tensor,
        "linen": linen,
        "nnx": nnx,
        "max_rel": 0.0,
        "passed": True,
        "gated": False,
    }


def records(costs: dict[str, CompiledCost], meshes: dict[str, dict[str, int]]) -> list[dict]:
    """The check's records: memory and FLOPs (NNX within COST_TOLERANCE of Linen), the
    collectives one step executes per kind, across and within stages (NNX not one more);
    shown, not gated: the collectives written in the program and the pipeline loops' trips."""
    linen, nnx = costs["linen"], costs["nnx"]
    out = [_no_more(f, getattr(linen, f), getattr(nnx, f), COST_TOLERANCE) for f in FIELDS]
    out += [_shown(f, getattr(linen, f), getattr(nnx, f)) for f in INFORMATIONAL]
    runs = {f: executed(costs[f], meshes[f]) for f in SOURCES}
    for where in ("across", "within"):
        for kind in hlo.COLLECTIVES:
            seen = {f: runs[f][where, kind] for f in SOURCES}
            if any(seen.values()):
                out.append(_no_more(f"executed {kind} {where} stages", *seen.values()))
            keys = {f: runs[f][where, f"{kind} {RNG_KEYS}"] for f in SOURCES}
            if any(keys.values()):
                out.append(_shown(f"executed {kind} {RNG_KEYS} {where} stages", *keys.values()))
    for kind in hlo.COLLECTIVES:
        if linen.collectives[kind] or nnx.collectives[kind]:
            out.append(_shown(f"written {kind}", linen.collectives[kind], nnx.collectives[kind]))
    structure = {f: loop_structure(costs[f], meshes[f]) for f in SOURCES}
    for direction in DIRECTIONS:
        out.append(
            _shown(
                f"pipeline loops {direction} (trips)",
                structure["linen"][direction],
                structure["nnx"][direction],
            )
        )
    return out


def _summary(name: str, cost: CompiledCost, runs: Counter) -> str:
    across = sum(n for (where, _), n in runs.items() if where == "across")
    return (
        f"{name} args {human_bytes(cost.argument_bytes)} + temp "
        f"{human_bytes(cost.temp_bytes)} + out {human_bytes(cost.output_bytes)} = peak "
        f"{human_bytes(cost.peak_bytes)}, {cost.flops:.3g} flops, "
        f"{sum(runs.values())} collectives executed ({across} across stages), "
        f"{cost.compile_source}"
    )


def compile_check(pair: Any) -> CheckResult:
    """Both releases' forward+backward programs as their workers compiled them."""
    programs = {f: pair.compiled(f) for f in SOURCES}
    costs = {
        f: CompiledCost.of(p, p.facts.get("compile_seconds", 0.0), p.facts.get("compile_source"))
        for f, p in programs.items()
    }
    # Each release's own mesh (their axis lists differ: 0.2.5 added `context_usp_ulysses` and
    # dropped `tensor_transpose`); the axes that split devices must be the same.
    meshes = {f: p.facts.get("mesh_shape") or {} for f, p in programs.items()}
    return verdict(costs, meshes, "per device (forward+backward)")


def verdict(
    costs: dict[str, CompiledCost],
    meshes: dict[str, dict[str, int]],
    lead: str,
    leading: tuple[dict, ...] = (),
) -> CheckResult:
    """The releases' compiled programs (forward+backward here; on a TPU slice their train
    steps, `parity.maxtext.tpu_gate`, whose HBM records come first: `leading`) judged."""
    used = {f: {a: n for a, n in m.items() if n > 1} for f, m in meshes.items()}
    if not used["linen"] or used["linen"] != used["nnx"]:
        raise ValueError(f"the releases' meshes split devices differently: {used}")
    found = [*leading, *records(costs, meshes)]
    failing = [r for r in found if not r["passed"]]
    gated = [r for r in found if r.get("gated", True)]
    worst = failing[0] if failing else max(gated, key=lambda r: r["max_rel"])
    same = costs["linen"].program == costs["nnx"].program
    per_device = "; ".join(_summary(f, costs[f], executed(costs[f], meshes[f])) for f in SOURCES)
    per_device += "; same optimised program" if same else "; programs differ"
    return CheckResult(
        name="compile",
        passed=not failing,
        metric="nnx/linen-1",
        value=worst["max_rel"],
        tolerance=COST_TOLERANCE,
        where=worst["tensor"],
        details=tuple(found),
        message=f"{lead}: {per_device}",
    )
