"""The numeric checks, written once over a pair of Sides.

`roundtrip`, `forward`, `grads`, `init`, `train` and `layers` take a `Pair` and return a
`CheckResult`; they never ask which framework a side is. The program-level checks (sharding,
program) are in `parity.engine.programs`; checks that only a pipelined decoder has are in
`parity.decoder.checks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from parity.analysis import compare, init_check
from parity.engine.pair import Pair
from parity.engine.result import (
    CheckResult,
    exact_records,
    keyed_records,
    numeric_records,
    one_sided_record,
    ranked_errors,
    verdict,
)
from parity.engine.side import ByCall, Run, returned_sharding_mismatches
from parity.multiprocess import distributed


def run_records(
    prefix: str,
    actual: Run,
    expected: Run,
    tol: compare.Tolerance,
    parts: Sequence[str] = ("loss", "outputs", "grads"),
    output_name: str = "outputs",
) -> list[dict]:
    """Records for the named parts of two runs (NNX `actual` against Linen `expected`),
    matched leaf by leaf on their paths; the outputs are recorded under `output_name` (a
    pair's: `logits` for a decoder). With the outputs come the state the calls updated and
    the values they sowed, wherever a side reports them; a run of several calls is recorded
    call by call (`train/outputs`, `train/state/...`, then `eval/...`)."""
    extra = [
        p
        for p in ("state", "sown")
        if getattr(actual, p) is not None or getattr(expected, p) is not None
    ]
    records = []
    for part in parts:
        if part != output_name:
            records += keyed_records(
                f"{prefix}{part}", getattr(actual, part), getattr(expected, part), tol
            )
            continue
        per_call = isinstance(expected.outputs, ByCall) and isinstance(actual.outputs, ByCall)
        names = (
            [*expected.outputs, *(n for n in actual.outputs if n not in expected.outputs)]
            if per_call
            else [None]
        )
        for name in names:
            for field in ("outputs", *extra):
                label = output_name if field == "outputs" else field
                nnx, linen = getattr(actual, field), getattr(expected, field)
                if name is not None:
                    nnx, linen = nnx.get(name), linen.get(name)
                where = f"{prefix}{name}/{label}" if name is not None else f"{prefix}{label}"
                records += keyed_records(where, nnx, linen, tol)
    return records


def vacuity(pair: Pair, named_runs: dict[str, Run]) -> list[str]:
    return [f"{label}: {p}" for label, run in named_runs.items() for p in pair.vacuity(run)]


# ------------------------------------------------------------------ weights


def roundtrip(pair: Pair) -> CheckResult:
    """Linen -> NNX -> Linen and NNX -> Linen -> NNX give back every leaf bit-exactly, with its
    dtype, for both weight sources (and any round trip the pair adds: layouts)."""
    records = []
    for source in pair.sources:
        linen_weights, nnx_weights = pair.weights("linen", source), pair.weights("nnx", source)
        linen, nnx, label = pair.linen, pair.nnx, pair.source_label(source)
        back = linen.from_common(nnx.to_common(nnx.from_common(linen.to_common(linen_weights))))
        records += exact_records(
            f"{label}/linen->nnx->linen", linen.plain(back), linen.plain(linen_weights)
        )
        back = nnx.from_common(linen.to_common(linen.from_common(nnx.to_common(nnx_weights))))
        records += exact_records(
            f"{label}/nnx->linen->nnx", nnx.plain(back), nnx.plain(nnx_weights)
        )
        records += pair.extra_roundtrip_records(source)
    return verdict("roundtrip", records, compare.EXACT, note=pair.roundtrip_note)


def init(pair: Pair) -> CheckResult:
    """Linen's and NNX's own initialisations: per parameter the logical names, shape and dtype
    exactly, and the distribution (mean, std, kurtosis, tail, zeros, distinct stacked slices)
    within bounds derived from the element counts."""
    linen_common = pair.linen.to_common(pair.weights("linen", "linen"))
    nnx_common = pair.nnx.to_common(pair.weights("nnx", "nnx"))
    records = init_check.init_records(linen_common["params"], nnx_common["params"])
    failing = [r for r in records if not r["passed"]]
    worst = failing[0] if failing else max(records, key=lambda r: r["max_rel"])
    return CheckResult(
        name="init",
        passed=not failing,
        metric=init_check.METRIC,
        value=worst["max_rel"],
        tolerance=1.0,
        where=worst["tensor"],
        details=tuple(records),
        message=(
            f"Linen {worst['linen']} vs NNX {worst['nnx']}"
            if failing
            else "same names, shapes, dtypes; every statistic within its bound "
            f"({init_check.initstats.Z_BOUND:g} standard errors)"
        ),
    )


# ------------------------------------------------------------------ forward and backward


def _both_sources(pair: Pair, name: str, parts: Sequence[str], pick=None) -> CheckResult:
    tol = pair.tolerance
    records, named = [], {}
    for source in pair.sources:
        linen_run, nnx_run = pair.run("linen", source), pair.run("nnx", source)
        label = pair.source_label(source)
        named |= {f"linen ({label})": linen_run, f"nnx ({label})": nnx_run}
        records += run_records(f"{label}/", nnx_run, linen_run, tol, parts, pair.output_name)
    earliest = name in pair.earliest
    problems = vacuity(pair, named)
    return verdict(name, records, tol, problems, rank=pair.rank, earliest=earliest, pick=pick)


def _where_backward_parts(pair: Pair) -> Callable[[list[dict]], dict]:
    """The failing gradient record to name, in a pair that knows its modules (`module_of`):
    where the forward pass already differs, inside the first module whose output differs (every
    gradient downstream and upstream of it follows from it); otherwise in the last module, in
    execution order, whose gradients differ (the first the backward pass reaches: the modules
    before it receive its cotangent). The largest error there. The inputs' gradients, which
    the backward pass reaches last, are named only where no parameter's differs. The forward
    records are compared only when a gradient fails (the runs are the ones `grads` compared)."""

    def pick(failing: list[dict]) -> dict:
        failing = [r for r in failing if "/input_grads/" not in r["tensor"]] or failing
        forward_failing = [
            r
            for source in pair.sources
            for r in run_records(
                f"{pair.source_label(source)}/",
                pair.run("nnx", source),
                pair.run("linen", source),
                pair.tolerance,
                pair.forward_parts,
                pair.output_name,
            )
            if not r["passed"]
        ]
        error = ranked_errors(failing)

        def largest(candidates: list[dict]) -> dict:
            return min(candidates, key=lambda r: (-error(r), pair.rank(r["tensor"])))

        modules = {id(r): pair.module_of(r["tensor"]) for r in failing}
        placed = [r for r in failing if modules[id(r)]]
        if forward_failing:
            first = min(forward_failing, key=lambda r: pair.rank(r["tensor"]))
            module = pair.module_of(first["tensor"]) or ()
            for depth in range(len(module), 0, -1):  # that module, else the one holding it
                inside = [r for r in placed if modules[id(r)][:depth] == module[:depth]]
                if inside:
                    return largest(inside)
            return largest(failing)
        if not placed:
            return largest(failing)
        last = max(pair.rank(r["tensor"]) for r in placed)
        return largest([r for r in placed if pair.rank(r["tensor"]) == last])

    return pick


def forward(pair: Pair) -> CheckResult:
    """Outputs and loss, NNX against Linen, from Linen's and from NNX's initial weights."""
    return _both_sources(pair, "forward", pair.forward_parts)


def grads(pair: Pair) -> CheckResult:
    """Every gradient leaf (NNX's mapped through the converter), the global gradient norm and,
    where a side reports them, the gradients of the inputs, NNX against Linen, from both weight
    sources."""
    run = pair.run("linen", "linen")
    parts = ("grads", "grad_norm") if run.grad_norm is not None else ("grads",)
    parts += ("input_grads",) if run.input_grads is not None else ()
    pick = _where_backward_parts(pair) if pair.module_of is not None else None
    return _both_sources(pair, "grads", parts, pick)


# ------------------------------------------------------------------ training


def _unchanged(prefix: str, before: Any, after: Any) -> list[dict]:
    return exact_records(prefix, after, before)


def _consumed(prefix: str, native: Any) -> list[dict]:
    """A failing record for every array of `native` that a call deleted (donated): such a
    state cannot even be read back, let alone compared or stepped."""
    note = "deleted: the evaluation consumed (donated) it"
    return [
        {"tensor": f"{prefix}/{compare.path_str(path)}", "passed": False, "max_rel": math.inf}
        | {"note": note}
        for path, x in jax.tree_util.tree_flatten_with_path(native)[0]
        if isinstance(x, jax.Array) and x.is_deleted()
    ]


def _returned_state_records(prefix: str, side_plain, compiled_step, params, opt_state) -> list:
    """Each returned parameter and optimizer-state array against the sharding the compiled
    step takes it with; only the mismatches are recorded."""
    del side_plain
    if hasattr(compiled_step, "returned_mismatches"):  # a worker's step checked them there
        mismatches = compiled_step.returned_mismatches
    else:
        mismatches = returned_sharding_mismatches(compiled_step, params, opt_state)
    return [
        {"tensor": f"{prefix}: {m['path']}", "passed": False, "max_rel": math.inf}
        | {"returned": m["returned"], "expected": m["expected"]}
        for m in mismatches
    ]


def train(
    pair: Pair, steps: int = 5, on_step: Callable[[int, bool], None] | None = None
) -> CheckResult:
    """`steps` optimizer steps on both sides from the same weights and optimizer state, with a
    forward-only evaluation before the first step and after the last. Per step: loss, gradient
    norm, every updated parameter and every optimizer-state leaf, matched by path with its
    dtype, as `forward` compares (equal values in another dtype differ: the next step computes
    in that dtype); the first diverging step is named. `on_step(step, passed)` is called after
    each step."""
    tol = pair.tolerance
    linen, nnx = pair.linen, pair.nnx
    linen_t = linen.trainer(pair.weights("linen", "linen"))
    nnx_t = nnx.trainer(pair.weights("nnx", "linen"))
    linen_params, linen_opt = linen_t.params, linen_t.opt_state
    nnx_params, nnx_opt = nnx_t.params, nnx_t.opt_state
    eval_batch = pair.batch(split="eval")
    records: list[dict] = []
    per_step: list[dict] = []

    def evaluate(label: str) -> bool:
        """Both evaluations, which must leave no state behind and must not consume (donate)
        the parameters; False when they did (nothing left to step)."""
        before = (linen.plain(linen_params), nnx.plain(nnx_params))  # host copies
        linen_loss = linen_t.evaluate(linen_params, eval_batch)
        nnx_loss = nnx_t.evaluate(nnx_params, eval_batch)
        records.extend(keyed_records(f"eval-{label}/loss", nnx_loss, linen_loss, tol))
        usable = True
        for side, params, kept in ((linen, linen_params, before[0]), (nnx, nnx_params, before[1])):
            prefix = f"eval-{label}/{side.framework}-params"
            consumed = _consumed(prefix, params)
            records.extend(consumed or _unchanged(prefix, kept, side.plain(params)))
            usable = usable and not consumed
        return usable

    records.extend(keyed_records("init/opt_state", nnx.plain(nnx_opt), linen.plain(linen_opt), tol))
    usable = evaluate("before")
    losses = []
    for step in range(steps if usable else 0):
        batch = pair.batch(step)
        linen_params, linen_opt, linen_metrics = linen_t.step(linen_params, linen_opt, batch)
        nnx_params, nnx_opt, nnx_metrics = nnx_t.step(nnx_params, nnx_opt, batch)
        linen_metrics, nnx_metrics = distributed.to_host((linen_metrics, nnx_metrics))
        # A step whose outputs are not valid inputs of the next cannot be stepped again: say
        # where, as a parity failure of that step, instead of letting the next call raise.
        step_records = _returned_state_records(
            f"step {step}/linen returned", linen.plain, linen_t.step, linen_params, linen_opt
        ) + _returned_state_records(
            f"step {step}/nnx returned", nnx.plain, nnx_t.step, nnx_params, nnx_opt
        )
        resumable = all(r["passed"] for r in step_records)
        for key in ("loss", "grad_norm", "aux_loss"):
            if key in linen_metrics or key in nnx_metrics:
                step_records += keyed_records(
                    f"step {step}/{key}", nnx_metrics.get(key), linen_metrics.get(key), tol
                )
        step_records += keyed_records(
            f"step {step}/params", nnx.plain(nnx_params), linen.plain(linen_params), tol
        )
        step_records += keyed_records(
            f"step {step}/opt_state", nnx.plain(nnx_opt), linen.plain(linen_opt), tol
        )
        records.extend(step_records)
        losses.append(float(linen_metrics["loss"]))
        per_step.append(
            {
                "step": step,
                "loss_linen": float(linen_metrics["loss"]),
                "loss_nnx": float(nnx_metrics["loss"]),
                "max_rel": max(r["max_rel"] for r in step_records),
                "passed": all(r["passed"] for r in step_records),
            }
        )
        if on_step is not None:
            on_step(step, per_step[-1]["passed"])
        if not resumable:
            break
    else:
        if usable:
            evaluate("after")
    problems = []
    if losses and not losses[-1] < losses[0] + 1.0:
        problems.append(f"training diverged: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    result = verdict("train", records, tol, problems)
    return dataclasses.replace(result, steps=tuple(per_step))


# ------------------------------------------------------------------ drill-down


def layers(pair: Pair) -> CheckResult:
    """Drill-down: the model cut into stages (`Side.drill_stages`), each fed on both sides the
    same input (Linen's output of the stage it reads from); every capture of every stage,
    NNX against Linen, in execution order: the first divergence is named. A capture of one
    side alone is judged by `randomness.one_sided` against the other's in the same stage."""
    from parity.engine.randomness import one_sided

    tol = pair.tolerance
    linen_stages = pair.linen.drill_stages(pair.weights("linen", "linen"))
    nnx_stages = pair.nnx.drill_stages(pair.weights("nnx", "linen"))
    if [s.name for s in linen_stages] != [s.name for s in nnx_stages]:
        raise ValueError(
            f"drill-down stages differ: Linen {[s.name for s in linen_stages]} vs NNX "
            f"{[s.name for s in nnx_stages]}"
        )
    records: list[dict] = []
    details: list[dict] = []  # with the captures of one side that are not compared
    outputs: dict[str, Any] = {}
    previous: Any = None
    for linen_stage, nnx_stage in zip(linen_stages, nnx_stages, strict=True):
        x = outputs[linen_stage.input_from] if linen_stage.input_from else previous
        linen_out, linen_caps = linen_stage.apply(x)
        _, nnx_caps = nnx_stage.apply(x)
        order = {name: i for i, name in enumerate(linen_stage.order)}
        # Execution order, then the name: never the order of a set (it changes with hashing).
        names = sorted(set(linen_caps) | set(nnx_caps), key=lambda n: (order.get(n, len(order)), n))
        for name in names:
            if (name not in linen_caps and pair.linen.opaque(name)) or (
                name not in nnx_caps and pair.nnx.opaque(name)
            ):
                continue  # inside a bridged layer: that side captures only the layer's output
            fields = linen_stage.fields(name)
            if name not in linen_caps or name not in nnx_caps:
                differs, note = one_sided(name, linen_caps, nnx_caps)
                side, captured = ("linen", linen_caps) if name in linen_caps else ("nnx", nnx_caps)
                if side == "linen" and pair.called_by_linen_only(name):
                    differs = True
                    note = "called by Linen only: the NNX port holds its weights, never calls it"
                shape = getattr(captured[name], "shape", None)
                record = {"tensor": name, "passed": not differs, "max_rel": 0.0, "note": note}
                record |= fields | {"side": side, "shape": None if shape is None else list(shape)}
                if differs:
                    record |= {"max_rel": float("inf"), "mismatches": -1, "nonfinite": 0}
                    records.append(record)
                details.append(record)
                continue
            diff = compare.leaf_diff(name, nnx_caps[name], linen_caps[name])
            records.append(
                numeric_records(name, [dataclasses.replace(diff, path="")], tol)[0] | fields
            )
            details.append(records[-1])
        if (linen_caps or nnx_caps) and not set(linen_caps) & set(nnx_caps):
            # Nothing in common: no capture compared says nothing about this stage.
            note = f"no capture on both sides (Linen {len(linen_caps)}, NNX {len(nnx_caps)})"
            records.append(one_sided_record(f"stage {linen_stage.name}", note))
            details.append(records[-1])
        outputs[linen_stage.name] = previous = linen_out
    return dataclasses.replace(verdict("layers", records, tol), details=tuple(details))
