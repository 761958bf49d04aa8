"""`pipeline` on MaxText: each release's pipelined decoder against the same release's decoder
without pipelining, on the same weights and batch (an oracle that is neither release).

Two releases that agree can both be wrong: `forward` and `grads` hold 0.2.5 to 0.2.3, this
check holds each to its own non-pipelined decoder (`pipeline_layout.reference_overrides`:
the pipeline axes folded into data parallelism, the layers scanned; the weights re-laid as its
layer stack, layer `(r*S + s)*L + j`, strictly). Each release's worker builds its reference
beside its pipelined decoder and runs both (`decoder_factory.MaxTextSide.pipeline_reference`)
on the Linen release's initial weights; logits, loss, the global gradient norm and every
parameter's gradient are compared here, held to the tier of the same math on other shapes
(`compare.reshaped_tolerance`'s: the twins' `pipeline` tier). The verdict says whose
difference it is: a release that parts from its own reference fails the check even where the
two releases agree, and where both part alike (their pipelined runs bit-identical) the
difference predates the migration: MaxText's pipeline, not the port.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from parity.analysis import compare
from parity.engine.numeric import run_records
from parity.engine.result import CheckResult, skipped, verdict
from parity.engine.side import Run
from parity.maxtext import gate_config, pipeline_layout, release_fault
from parity.remote import protocol

PARTS = ("loss", "logits", "grads", "grad_norm")


def tolerance(keys: dict[str, Any]) -> compare.Tolerance:
    """The twins' pipeline tier for the config's dtypes (MaxText's defaults: activations in
    bfloat16, weights in float32). Measured on MaxText in float32, both releases, every shape
    of the sweeps that holds (`bench/maxtext_pipeline_sweep.py`, docs/maxtext.md): worst
    1.6e-6 on the llama2 shapes (13 ulp at scale; S=2, R=4, M=8), 4.8x under the tier's 64
    ulp, 2.8e-6 over the shipped families (deepseek); the shapes that fail are off by 1.08 to
    1.3, five orders of magnitude beyond it."""
    float32 = keys.get("dtype", "bfloat16") == "float32"
    float32 = float32 and keys.get("weight_dtype", "float32") == "float32"
    return compare.F32_RESHAPED if float32 else compare.BF16_RESHAPED


def release_label(framework: str) -> str:
    return f"maxtext {gate_config.RELEASES[framework]}"


def source_of(frameworks: tuple[str, ...]) -> str:
    """Whose initial weights both runs take: the Linen release's where it is among
    `frameworks` (the MaxText pair's own `linen` side), else the first's (the twin pair's
    MaxText side)."""
    return "linen" if "linen" in frameworks else frameworks[0]


def _in_workers(
    pair: Any, frameworks: tuple[str, ...], method: str, source: str, side_by_side: bool = True
) -> dict[str, tuple[dict, dict]]:
    """Per framework, its worker's `method` (a `MaxTextSide` remote method taking a weights
    file and the reference's overrides) on `source`'s initial weights: (arrays, facts). The
    workers run side by side (each builds and compiles its own reference: the releases'
    processes share nothing; `side_by_side=False`: one after the other), a release's own
    exception `release_fault.Faults`."""
    plain = protocol.flatten(pair.side(source).plain(pair.weights(source, source)))
    overrides = pipeline_layout.reference_overrides(pair.keys)
    with tempfile.TemporaryDirectory(prefix="parity-maxtext-pipeline-") as directory:
        weights_file = Path(directory) / "weights.npz"
        np.savez(weights_file, **{"/".join(path): value for path, value in plain.items()})
        kwargs = {"weights_file": str(weights_file), "overrides": overrides}

        def one(framework: str) -> tuple[dict, dict]:
            worker = pair.side(framework).worker
            reply = worker.call("call", method=method, kwargs=kwargs)
            return worker.receive_tree(reply["tree"])[0], reply["facts"]

        doing = f"the pipeline oracle's {method}"
        jobs = {f: functools.partial(one, f) for f in frameworks}
        return release_fault.run_both(doing, jobs, side_by_side)


def reference_runs(pair: Any, frameworks: tuple[str, ...]) -> dict[str, tuple[Run, Run, dict]]:
    """Per framework (a MaxText release's side of `pair`): (its pipelined run, its reference
    run, the worker's facts), both on the same initial weights (`source_of`)."""
    out = {}
    replies = _in_workers(pair, frameworks, "pipeline_reference", source_of(frameworks))
    for framework, (arrays, facts) in replies.items():
        runs = {}
        for name in ("pipelined", "reference"):
            grads = {p[2:]: a for p, a in arrays.items() if p[:2] == (name, "grads")}
            runs[name] = Run(
                loss=arrays[(name, "loss")],
                outputs=arrays[(name, "logits")],
                grads=protocol.nest(grads),
                grad_norm=arrays[(name, "grad_norm")],
            )
        out[framework] = (runs["pipelined"], runs["reference"], facts)
    return out


def pipeline(pair: Any) -> CheckResult:
    """The check (module docstring) on the MaxText releases among the pair's sides
    (`pair.oracle_sides`)."""
    tol = tolerance(pair.keys)
    if pipeline_layout.stages(pair.keys) <= 1:
        return skipped(
            "pipeline", "max_rel", tol.max_rel, "config does not pipeline (S=1): nothing to compare"
        )
    if (why := pipeline_layout.unmapped(pair.keys)) is not None:
        return skipped(
            "pipeline",
            "max_rel",
            tol.max_rel,
            f"not compared: {why}, which the oracle's layer map does not carry (docs/maxtext.md)",
        )
    frameworks = pair.oracle_sides
    runs = reference_runs(pair, frameworks)
    records: list[dict] = []
    problems: list[str] = []
    failing, worst = [], {}
    for framework, (pipelined, reference, _) in runs.items():
        label = release_label(framework)
        own = run_records(f"{label}/", pipelined, reference, tol, PARTS, "logits")
        records += [r | {"release": gate_config.RELEASES[framework]} for r in own]
        for run_name, run in (("pipelined", pipelined), ("reference", reference)):
            problems += [f"{label} {run_name}: {p}" for p in pair.vacuity(run)]
        if any(not r["passed"] for r in own):
            failing.append(framework)
        worst[framework] = max(own, key=lambda r: r["max_rel"], default=None)
    whose = _whose(runs, failing)
    summary = {
        "tensor": "whose difference",
        "passed": True,
        "max_rel": 0.0,
        "failing_releases": [gate_config.RELEASES[f] for f in failing],
        "whose": whose,
    }
    source = source_of(frameworks)
    every = getattr(pair, "drill_pipeline", False)  # `layers` asked for beside it
    drilled = tuple(frameworks) if every else tuple(failing)
    located = located_records(pair, drilled, source) if drilled else []
    where = [r for r in located if r.get("first_parting")]
    summary["parts_at"] = {r["release"]: r["tensor"] for r in where}
    result = verdict("pipeline", records, tol, problems)
    shown = "; ".join(
        f"{release_label(f)} {'fails' if f in failing else 'holds'} "
        f"(worst {w['max_rel']:.3g} at {w['tensor']})"
        for f, w in worst.items()
        if w is not None
    )
    parts = "".join(f"; first parts at {r['tensor']} ({r['max_rel']:.3g})" for r in where)
    note = " (on the CPU: a --topology run compiles for TPU and runs no oracle)"
    asked = [r for r in located if not r["first_parting"]] if every else []
    return dataclasses.replace(
        result,
        details=(summary, *where, *result.details, *asked),
        message=f"{result.message}; {shown}; {whose}{parts}{note if failing else ''}",
    )


def located_records(pair: Any, frameworks: tuple[str, ...], source: str) -> list[dict]:
    """The drill-down (`drill`) of `frameworks`, each release's records marked with it, and
    its first record beyond the tier marked `first_parting` (where its pipelined run first
    parts from its reference, in data-flow order)."""
    out = []
    for framework, records in drill(pair, frameworks, source).items():
        release = gate_config.RELEASES[framework]
        first = next((i for i, r in enumerate(records) if not r["passed"]), None)
        for i, record in enumerate(records):
            out.append(record | {"release": release, "first_parting": i == first})
    return out


def _whose(runs: dict[str, tuple[Run, Run, dict]], failing: list[str]) -> str:
    """Who computes the difference from the reference: one release (the port, or the
    original), both alike (bit-identical pipelined runs: MaxText's pipeline, older than the
    migration), both differently, or nobody."""
    if not failing:
        return "every release holds to its own reference"
    if len(failing) == 1 or len(runs) == 1:
        (framework,) = failing[:1]
        other = [f for f in runs if f != framework]
        if not other:
            return f"{release_label(framework)} parts from its own reference"
        return (
            f"{release_label(framework)} alone parts from its own reference "
            f"({release_label(other[0])} holds)"
        )
    first, second = (runs[f][0] for f in failing[:2])
    alike = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(_leaves(first), _leaves(second), strict=True)
    )
    if alike:
        return (
            "both releases, bit-identically: MaxText's pipeline, not the port "
            "(the difference predates the migration)"
        )
    return "both releases part from their own references, each differently"


def _leaves(run: Run) -> list[Any]:
    flat = protocol.flatten(run.grads)
    return [run.loss, run.outputs, run.grad_norm, *(flat[p] for p in sorted(flat))]


# ------------------------------------------------------------ where the pipeline parts


def drill(pair: Any, frameworks: tuple[str, ...], source: str) -> dict[str, list[dict]]:
    """Per framework, the pipelined decoder's module outputs against its reference's, in the
    order the pipeline ran them (`decoder_factory.MaxTextSide.pipeline_captures`): a capture of
    stage s at iteration t holds microbatch m of repeat r (MaxText's schedule: `t - d*s`
    microbatches processed, d the forwarding delay), which the reference computed as rows
    `m*B/M ...` of layer `(r*S + s)*L + j`'s output; bubble iterations compute nothing and are
    left out. Modules outside the pipeline are compared call by call. Records in data-flow
    order, each with its module, iteration, stage, layer, microbatch and repeat. Both runs
    take `source`'s initial weights."""
    tol = tolerance(pair.keys)
    # One release after the other: module captures are host callbacks inside the pipeline's
    # loop, and two workers capturing at once on this host were seen to hang in XLA:CPU's
    # collective-permute rendezvous (the releases' oracle runs, with no callback, run side by side).
    replies = _in_workers(pair, frameworks, "pipeline_captures", source, side_by_side=False)
    return {
        framework: _capture_records(arrays, facts, tol, release_label(framework))
        for framework, (arrays, facts) in replies.items()
    }


def _calls(arrays: dict, run: str) -> dict[str, dict[tuple[int, int], Any]]:
    """A run's captures as `{module path: {(call, leaf): array}}`."""
    calls: dict[str, dict[tuple[int, int], Any]] = {}
    for key, value in arrays.items():
        if key[0] == run:
            calls.setdefault(key[1], {})[(int(key[2]), int(key[3]))] = value
    return calls


def _capture_records(arrays: dict, facts: dict, tol: compare.Tolerance, label: str) -> list[dict]:
    from parity.engine.result import numeric_records

    layout = pipeline_layout.Layout(**facts["layout"])
    delay, microbatches = int(facts["delay"]), int(facts["microbatches"])
    pipelined, reference = _calls(arrays, "pipelined"), _calls(arrays, "reference")
    order = facts["pipelined_order"]
    prefix = "/".join(pipeline_layout.PIPELINE[1:])
    outside = "/".join(layout.outside[1:])
    stack = "/".join(layout.reference[1:])
    staged = [p for p in pipelined if p == prefix or p.startswith(prefix + "/")]
    iterations = (
        min(
            (max(c for c, _ in calls) + 1) // layout.stages
            for p, calls in pipelined.items()
            if p in staged
        )
        if staged
        else 0
    )
    first_staged = min((order.index(p) for p in staged if p in order), default=len(order))

    def reference_layer(sub: str, layer: int, occurrence: int, leaf: int) -> list[Any]:
        """The reference's captures of module `sub` in layer `layer`, the `occurrence`-th call
        first, then the layer's other calls of it (a module called several times per layer,
        RoPE on the query and the key: `jax.debug.callback`s are unordered, so XLA may run
        the calls' captures in either order, in each run its own)."""
        calls = reference.get(f"{stack}/{sub}".rstrip("/"), {})
        per_layer = max((max((c for c, _ in calls), default=-1) + 1) // layout.layers, 1)
        order = [occurrence, *(o for o in range(per_layer) if o != occurrence)]
        found = [calls.get((layer * per_layer + o, leaf)) for o in order]
        return [x for x in found if x is not None]

    records = []

    def add(rank: tuple, fields: dict, name: str, actual: Any, candidates: list[Any]) -> None:
        """The record of `actual` against the closest of `candidates` (the first on ties)."""
        fits = [x for x in candidates if np.shape(x) == np.shape(actual)]
        if not fits:
            seen = f"shape {np.shape(candidates[0])}" if candidates else "no capture"
            note = f"the reference has {seen} here (pipelined {np.shape(actual)})"
            records.append(
                (rank, {"tensor": name, "passed": True, "max_rel": 0.0, **fields, "note": note})
            )
            return
        diffs = [compare.leaf_diff(name, actual, x, ("pipelined", "reference")) for x in fits]
        diff = min(diffs, key=lambda d: d.max_rel)
        record = numeric_records(name, [dataclasses.replace(diff, path="")], tol)[0]
        records.append((rank, record | fields | {"tier": compare.tier(diff.max_rel)}))

    for path, calls in pipelined.items():
        position = order.index(path) if path in order else len(order)
        if path in staged:
            rest = path[len(prefix) :].strip("/")
            slot, sub = 0, rest
            if layout.per_stage > 1:
                head, _, sub = rest.partition("/")
                if not re.fullmatch(r"layers_\d+", head):
                    continue  # the stage's L layers as one call: no module of the reference
                slot = int(head[len("layers_") :])
            per_iteration = (max(c for c, _ in calls) + 1) // max(iterations, 1)
            for (call, leaf), actual in calls.items():
                iteration, within = divmod(call, per_iteration)
                occurrence, stage = divmod(within, layout.stages)
                processed = iteration - delay * stage
                if not 0 <= processed < microbatches * layout.repeats:
                    continue  # a bubble: this stage holds no microbatch yet, or no more
                microbatch, repeat = processed % microbatches, processed // microbatches
                layer = layout.layer(repeat, stage, slot)
                rows = np.shape(actual)[0] if np.ndim(actual) else 0
                expected = [
                    whole[microbatch * rows : (microbatch + 1) * rows]
                    for whole in reference_layer(sub, layer, occurrence, leaf)
                ]
                fields = {
                    "module": path,
                    "iteration": iteration,
                    "stage": stage,
                    "layer": layer,
                    "microbatch": microbatch,
                    "repeat": repeat,
                }
                name = (
                    f"{label}: {path} iteration {iteration} stage {stage} (layer {layer}, "
                    f"microbatch {microbatch}, repeat {repeat})"
                ) + (f" [{leaf}]" if leaf else "")
                add(
                    (1, iteration, stage, position, occurrence, leaf),
                    fields,
                    name,
                    actual,
                    expected,
                )
            continue
        after = 2 if position > first_staged else 0
        for (call, leaf), actual in calls.items():
            if path == outside or path.startswith(outside + "/"):
                sub = path[len(outside) :].strip("/")
                count = layout.layers - layout.pipelined
                per_layer = (max(c for c, _ in calls) + 1) // max(count, 1)
                first = 0 if layout.moe_first else layout.pipelined
                layer = first + call // max(per_layer, 1)
                expected = reference_layer(sub, layer, call % max(per_layer, 1), leaf)
                fields = {"module": path, "layer": layer}
                name = f"{label}: {path} (layer {layer})"
            else:
                found = reference.get(path, {}).get((call, leaf))
                expected = [] if found is None else [found]
                fields = {"module": path}
                name = f"{label}: {path}" + (f" call {call}" if call else "")
            name += f" [{leaf}]" if leaf else ""
            add((after, position, -1, call, leaf, 0), fields, name, actual, expected)
    return [record for _, record in sorted(records, key=lambda item: item[0])]
