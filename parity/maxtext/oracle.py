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
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from parity.analysis import compare
from parity.engine.numeric import run_records
from parity.engine.result import CheckResult, skipped, verdict
from parity.engine.side import Run
from parity.maxtext import gate_config, pipeline_layout
from parity.remote import protocol

PARTS = ("loss", "logits", "grads", "grad_norm")


def tolerance(keys: dict[str, Any]) -> compare.Tolerance:
    """The twins' pipeline tier for the config's dtypes (MaxText's defaults: activations in
    bfloat16, weights in float32). Measured on MaxText (docs/maxtext.md, the sweep): float32
    pipelined against reference on both releases, worst 2.1e-6 (`bench/maxtext_pipeline_sweep.py`)."""
    float32 = keys.get("dtype", "bfloat16") == "float32"
    float32 = float32 and keys.get("weight_dtype", "float32") == "float32"
    return compare.F32_RESHAPED if float32 else compare.BF16_RESHAPED


def release_label(framework: str) -> str:
    return f"maxtext {gate_config.RELEASES[framework]}"


def reference_runs(pair: Any, frameworks: tuple[str, ...]) -> dict[str, tuple[Run, Run, dict]]:
    """Per framework (a MaxText release's side of `pair`): (its pipelined run, its reference
    run, the worker's facts), both on the Linen release's initial weights (the MaxText pair's
    own `linen` side; the twin pair's MaxText side's own)."""
    source = "linen" if "linen" in frameworks else frameworks[0]
    plain = protocol.flatten(pair.side(source).plain(pair.weights(source, source)))
    overrides = pipeline_layout.reference_overrides(pair.keys)
    out = {}
    with tempfile.TemporaryDirectory(prefix="parity-maxtext-pipeline-") as directory:
        weights_file = Path(directory) / "weights.npz"
        np.savez(weights_file, **{"/".join(path): value for path, value in plain.items()})
        for framework in frameworks:
            worker = pair.side(framework).worker
            reply = worker.call(
                "call",
                method="pipeline_reference",
                kwargs={"weights_file": str(weights_file), "overrides": overrides},
            )
            arrays = worker.receive_tree(reply["tree"])[0]
            runs = {}
            for name in ("pipelined", "reference"):
                grads = {p[2:]: a for p, a in arrays.items() if p[:2] == (name, "grads")}
                runs[name] = Run(
                    loss=arrays[(name, "loss")],
                    outputs=arrays[(name, "logits")],
                    grads=protocol.nest(grads),
                    grad_norm=arrays[(name, "grad_norm")],
                )
            out[framework] = (runs["pipelined"], runs["reference"], reply["facts"])
    return out


def pipeline(pair: Any, frameworks: tuple[str, ...] = ("linen", "nnx")) -> CheckResult:
    """The check (module docstring) on `frameworks`, the MaxText releases among the pair's
    sides."""
    tol = tolerance(pair.keys)
    if pipeline_layout.stages(pair.keys) <= 1:
        return skipped(
            "pipeline", "max_rel", tol.max_rel, "config does not pipeline (S=1): nothing to compare"
        )
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
    result = verdict("pipeline", records, tol, problems)
    shown = "; ".join(
        f"{release_label(f)} {'fails' if f in failing else 'holds'} "
        f"(worst {w['max_rel']:.3g} at {w['tensor']})"
        for f, w in worst.items()
        if w is not None
    )
    note = " (on the CPU: a --topology run compiles for TPU and runs no oracle)"
    return dataclasses.replace(
        result,
        details=(summary, *result.details),
        message=f"{result.message}; {shown}; {whose}{note if failing else ''}",
    )


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
