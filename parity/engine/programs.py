"""The program-level checks, written once over a pair of Sides: `sharding` and `program`.

`sharding` compares what values cannot show on a CPU: per parameter the logical names, one per
dimension, the PartitionSpec they resolve to (one resolver for both sides, Linen's) and where
the arrays were placed; the compiled programs' input and output shardings, against each other
and against what each side declares them pinned to; the collectives each program issues, in
total and per loop body; and, where a side can trace it, the program's remat regions and
sharding constraints. `program` diffs the two programs instruction by instruction.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import NamedSharding

from migrate.checkpoints import convert
from migrate.common import sharding as sharding_lib
from parity.analysis import compare, hlo, hlo_diff
from parity.engine.compiles import comparing
from parity.engine.pair import SOURCES, Pair
from parity.engine.result import CheckResult, fact_record, facts_verdict

# Program structure counted in the traced forwards of sides that can trace one (module pairs).
PROGRAM_PRIMITIVES = {
    "remat regions": frozenset({"remat2", "checkpoint", "remat"}),  # jax.checkpoint, nn.remat
    "sharding constraints": frozenset({"sharding_constraint"}),  # with_(logical_)constraint
}


def _flat_params(pair: Pair, framework: str) -> tuple[dict, dict]:
    """(arrays, logical names) of one side's own weights, flat by common path."""
    common = pair.side(framework).to_common(pair.weights(framework, framework))
    arrays, names = convert.strip_boxes(common["params"])
    return convert.flatten_dict(arrays), convert.flatten_dict(names)


_resolved = sharding_lib.resolved_spec


def _equivalent(a: Any, b: Any, ndim: int) -> bool:
    return a is not None and b is not None and a.is_equivalent_to(b, ndim)


def _shown(s: Any) -> Any:
    return getattr(s, "spec", s)


def _device_ids(s: Any) -> list[int] | None:
    devices = getattr(getattr(s, "mesh", None), "devices", None)
    return None if devices is None else [d.id for d in devices.flat]


def _placement(s: Any, expected: NamedSharding) -> Any:
    """A placed array's spec, with its mesh's device order where that is not the expected
    mesh's (the same spec over devices laid out differently: another mesh, or slices)."""
    ids = _device_ids(s)
    if ids is None or ids == _device_ids(expected):
        return _shown(s)
    return f"{_shown(s)} on mesh devices {ids}"


def parameter_records(pair: Pair) -> list[dict]:
    """Per parameter: names; one name per dimension; with rules the resolved spec; with a
    mesh where each side's own arrays were placed."""
    (linen_arrays, linen_names), (nnx_arrays, nnx_names) = (_flat_params(pair, f) for f in SOURCES)
    records = []
    for path in sorted(set(linen_arrays) | set(nnx_arrays)):
        where = "/".join(path)
        if path not in linen_arrays or path not in nnx_arrays:
            linen = linen_names.get(path) if path in linen_arrays else "missing"
            nnx = nnx_names.get(path) if path in nnx_arrays else "missing"
            owner = "Linen" if path in linen_arrays else "NNX"
            empty = compare.empty((linen_arrays if owner == "Linen" else nnx_arrays)[path])
            record = fact_record(f"{where}: names", empty, linen, nnx)
            if empty:  # a stack of no layers: nothing to place
                record["note"] = compare.one_sided_empty_note(owner)
            records.append(record)
            continue
        linen, nnx = linen_names[path], nnx_names[path]
        both = linen is not None and nnx is not None
        # Mesh-axis names on one side, logical names on the other: the same where they
        # resolve to the same spec (each side's names through the rules both declare).
        alike = linen == nnx or (
            both
            and pair.rules is not None
            and _resolved(linen, pair.rules) == _resolved(nnx, pair.rules)
        )
        record = fact_record(f"{where}: names", alike, linen, nnx)
        if alike and linen != nnx:
            record["note"] = "different names, the same spec"
        records.append(record)
        if not both:
            continue  # unannotated on both sides (passes) or on one (failed above)
        ndim = linen_arrays[path].ndim
        short = (len(linen) != ndim, len(nnx) != nnx_arrays[path].ndim)
        record = fact_record(
            f"{where}: rank",
            not any(short) or (all(short) and linen == nnx),
            f"{len(linen)} names, ndim {ndim}",
            f"{len(nnx)} names, ndim {nnx_arrays[path].ndim}",
        )
        if all(short) and linen == nnx:  # a defect both sides share: not a difference
            record["warning"] = f"{len(linen)} names on {ndim} dimensions on both sides"
        records.append(record)
        if pair.rules is None:
            # Each side resolved its names with rules of its own (two releases of one
            # framework): where both placed their arrays, the placements must agree.
            placed = [getattr(a[path], "sharding", None) for a in (linen_arrays, nnx_arrays)]
            if all(hasattr(s, "spec") for s in placed):
                records.append(
                    fact_record(
                        f"{where}: placed",
                        _equivalent(placed[0], placed[1], ndim),
                        *(_shown(s) for s in placed),
                    )
                )
            continue
        linen_spec, nnx_spec = _resolved(linen, pair.rules), _resolved(nnx, pair.rules)
        records.append(fact_record(f"{where}: spec", linen_spec == nnx_spec, linen_spec, nnx_spec))
        if pair.mesh is None:
            continue
        expected = NamedSharding(pair.mesh, linen_spec)
        placed = [getattr(a[path], "sharding", None) for a in (linen_arrays, nnx_arrays)]
        records.append(
            fact_record(
                f"{where}: placed",
                all(_equivalent(expected, s, ndim) for s in placed),
                *(_placement(s, expected) for s in placed),
            )
        )
    return records


def _one_sided_empty_parameters(pair: Pair) -> set[tuple[str, ...]]:
    """The common paths of the parameters of zero elements that one side alone has."""
    flat = [_flat_params(pair, f)[0] for f in SOURCES]
    return {
        ("params", *p)
        for a, b in (flat, flat[::-1])
        for p, x in a.items()
        if p not in b and compare.empty(x)
    }


def compiled_sharding_records(pair: Pair) -> list[dict]:
    """Per input and output array of the two compiled programs, matched by label: the two
    sides' shardings must agree, and each must be what its side declares it pinned to."""
    leaves = {f: pair.side(f).program_shardings(pair.compiled(f)) for f in SOURCES}
    records, empty = [], None
    for label in [*leaves["linen"], *(k for k in leaves["nnx"] if k not in leaves["linen"])]:
        linen, ndim, linen_decl = leaves["linen"].get(label, (None, 0, None))
        nnx, _, nnx_decl = leaves["nnx"].get(label, (None, 0, None))
        owner = "NNX" if linen is None else "Linen" if nnx is None else None
        # a parameter (or its gradient) of zero elements that one side alone has
        if owner and empty is None:
            empty = _one_sided_empty_parameters(pair)
        if owner and tuple(label.partition(": ")[2].split("/")[1:]) in (empty or ()):
            record = fact_record(label, True, _shown(linen), _shown(nnx))
            record["note"] = compare.one_sided_empty_note(owner)
            records.append(record)
            continue
        passed = _equivalent(linen, nnx, ndim)
        if linen_decl is not None or nnx_decl is not None:
            passed = (
                passed
                and _equivalent(linen, linen_decl, ndim)
                and _equivalent(nnx, nnx_decl, ndim)
                and _equivalent(linen_decl, nnx_decl, ndim)
            )
        record = fact_record(label, passed, _shown(linen), _shown(nnx))
        if linen_decl is not None:
            record["declared"] = str(_shown(linen_decl))
        records.append(record)
    return records


def collective_records(linen_text: str, nnx_text: str) -> list[dict]:
    """The count of each collective kind, in total and per loop body (remat recomputation
    apart): the two programs must issue the same."""
    records = []
    linen_counts, nnx_counts = hlo.collective_counts(linen_text), hlo.collective_counts(nnx_text)
    for kind in hlo.COLLECTIVES:
        records.append(
            fact_record(
                f"collectives: {kind}",
                linen_counts[kind] == nnx_counts[kind],
                linen_counts[kind],
                nnx_counts[kind],
            )
        )
    linen_loops = hlo.loop_collective_counts(linen_text)
    nnx_loops = hlo.loop_collective_counts(nnx_text)
    for key in sorted(set(linen_loops) | set(nnx_loops)):
        linen, nnx = linen_loops.get(key, 0), nnx_loops.get(key, 0)
        records.append(fact_record(f"collectives: loop body {key}", linen == nnx, linen, nnx))
    return records


def count_primitives(jaxpr: Any, names: frozenset[str]) -> int:
    """Equations whose primitive is in `names`, nested jaxprs (scan, cond, remat) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in names
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    count += count_primitives(inner, names)
    return count


def structure_records(pair: Pair) -> list[dict]:
    """Remat regions and sharding constraints in the two traced forwards, counted (for sides
    that can trace their forward on its own: `Side.jaxpr`)."""
    jaxprs = [pair.side(f).jaxpr(pair.weights(f, f)) for f in SOURCES]
    if any(j is None for j in jaxprs):
        return []
    records = []
    for what, primitives in PROGRAM_PRIMITIVES.items():
        linen, nnx = (count_primitives(j, primitives) for j in jaxprs)
        records.append(fact_record(f"program: {what}", linen == nnx, linen, nnx))
    return records


def sharding(pair: Pair) -> CheckResult:
    """Parameter annotations and placements; the compiled programs' shardings and collectives;
    program structure. A side that fails to trace or compile fails one record, after the
    per-parameter records (which need neither)."""
    records = parameter_records(pair)
    note = "names, ranks, specs, placements, compiled shardings, program structure: equal"
    try:
        if pair.programs_on_mesh:
            records += compiled_sharding_records(pair)
            linen_text, nnx_text = (pair.compiled(f).as_text() for f in SOURCES)
            records += collective_records(linen_text, nnx_text)
            counts = hlo.collective_counts(linen_text)
            note = f"collectives per {pair.program_name}: " + ", ".join(
                f"{k}={v}" for k, v in counts.items()
            )
        records += structure_records(pair)
    except Exception as error:  # a side that does not trace: reported, not raised
        message = f"{type(error).__name__}: {error}"
        side = getattr(error, "framework", None)  # a `SideError` says whose module raised
        linen, nnx = (message, "-") if side == "linen" else ("-", message)
        if side == "nnx":  # the Linen side traced and compiled before
            linen = "traced"
        records.append(fact_record("program: trace and compile", False, linen, nnx))
    shared = [r for r in records if "warning" in r]
    if shared:
        note += (
            f"; warning: {len(shared)} annotation(s) with a name count other than the rank on "
            f"both sides alike (a defect the models share, not a migration difference), first "
            f"{shared[0]['tensor'].removesuffix(': rank')}: {shared[0]['warning']}"
        )
    return facts_verdict("sharding", records, note)


def program(pair: Pair) -> CheckResult:
    """The two sides' programs, each lowered for its own weights, compared instruction by
    instruction before and after XLA's optimisation: identical programs are the strongest
    parity evidence; otherwise the first differing instruction is named on each side."""
    records, summaries = [], []
    for stage in ("pre-optimisation", "optimised"):
        if stage == "optimised":
            texts = [pair.compiled(f).as_text() for f in SOURCES]
        else:
            texts = [pair.lowered(f).as_text(dialect="hlo", debug_info=True) for f in SOURCES]
        with comparing():
            found = hlo_diff.diff_texts(*texts)
        summaries.append(found.summary(f"{stage} HLO"))
        records.append(
            {
                "tensor": f"{stage} HLO",
                "passed": found.identical,
                "max_rel": 0.0 if found.identical else 1.0,
                "instructions": list(found.instructions),
                "kind": found.kind,
                "position": found.position,
                "linen": [i.describe() for i in found.linen],
                "nnx": [i.describe() for i in found.nnx],
            }
        )
    failing = [r for r in records if not r["passed"]]
    worst = failing[0] if failing else records[-1]
    return CheckResult(
        name="program",
        passed=not failing,
        metric="programs differ",
        value=float(len(failing)),
        tolerance=0.0,
        where=(
            f"{worst['tensor']}: {worst['kind']} at instruction {worst['position']}"
            if failing
            else "identical programs"
        ),
        details=tuple(records),
        message="; ".join(summaries),
    )
