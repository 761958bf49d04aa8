"""Checks: each a function from a Config to a CheckResult (data only; `report` prints).

A `Session` per config holds the mesh, the batch and the runs already computed, so that checks
sharing a run (forward and grads use the same forward+backward) compute it once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from migrate import convert, sharding
from migrate.config import Config
from parity import compare, runs
from parity.data import synthetic_batch
from parity.runs import Run


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """A check's verdict, its worst error against its tolerance, where, and per-leaf details."""

    name: str
    passed: bool
    metric: str
    value: float
    tolerance: float
    where: str
    details: tuple[dict[str, Any], ...] = ()
    message: str = ""


class Session:
    """Everything the checks of one config share: mesh, batch, weights, runs."""

    def __init__(self, cfg: Config, bubble_fill: float = 0.0) -> None:
        self.cfg = cfg
        self.bubble_fill = bubble_fill
        self.mesh = sharding.make_mesh(cfg)
        self.batch = synthetic_batch(cfg, self.mesh)

    @functools.cached_property
    def linen_variables(self):
        """Linen-initialised weights (pipelined layout when the config pipelines)."""
        return runs.linen_initial_variables(self.cfg, self.mesh)

    @functools.cached_property
    def nnx_params(self) -> nnx.State:
        """NNX-initialised weights."""
        return runs.nnx_initial_state(self.cfg, self.mesh)

    def weights(self, source: str) -> tuple[Any, nnx.State]:
        """(Linen variables, NNX params) holding the same arrays, initialised by `source`."""
        if source == "linen":
            return self.linen_variables, runs.linen_to_nnx_params(
                self.cfg, self.mesh, self.linen_variables
            )
        return convert.nnx_to_linen(self.nnx_params), self.nnx_params

    @functools.cache  # noqa: B019 (one Session per config; lives as long as its runs)
    def run(self, framework: str, source: str, use_pipeline: bool | None = None) -> Run:
        """Forward+backward of one twin from `source` weights; reference runs get the weights
        moved by the placement formula."""
        linen_vars, nnx_params = self.weights(source)
        cfg, mesh = self.cfg, self.mesh
        reference = use_pipeline is False and cfg.using_pipeline
        if reference:
            host = convert.linen_pipeline_to_reference(jax.device_get(linen_vars), cfg)
            ref_cfg = runs.schedule_free(cfg)
            linen_vars = runs.place_linen(host, ref_cfg, mesh, use_pipeline=False)
            cfg = ref_cfg
            if framework == "nnx":
                nnx_params = runs.linen_to_nnx_params(cfg, mesh, linen_vars, use_pipeline=False)
        fill = 0.0 if reference else self.bubble_fill
        if framework == "linen":
            return runs.run_linen(cfg, mesh, linen_vars, self.batch, use_pipeline, fill)
        return runs.run_nnx(cfg, mesh, nnx_params, self.batch, use_pipeline, fill)


# ------------------------------------------------------------------ helpers


def _records(prefix: str, diffs: list[compare.LeafDiff], tol: compare.Tolerance) -> list[dict]:
    return [
        {
            "tensor": f"{prefix}/{d.path}" if d.path else prefix,
            "max_abs": d.max_abs,
            "max_rel": d.max_rel,
            "ulp_at_scale": d.ulp_at_scale,
            "mismatches": d.mismatches,
            "nonfinite": d.nonfinite_actual + d.nonfinite_expected,
            "passed": d.passes(tol),
        }
        for d in diffs
    ]


def vacuity_problems(run: Run, vocab_size: int) -> list[str]:
    """Reasons a run proves nothing: two dead models agree perfectly."""
    problems = []
    grad_norm = math.sqrt(
        sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in jax.tree.leaves(run.grads))
    )
    if not grad_norm > 0:
        problems.append(f"gradient norm is {grad_norm}")
    if not np.any(np.asarray(run.logits) != 0):
        problems.append("logits are all zero")
    if abs(float(run.loss) - math.log(vocab_size)) < 1e-4:
        problems.append(f"loss {float(run.loss):.6f} sits at ln(vocab)={math.log(vocab_size):.6f}")
    return problems


def _result(
    name: str, records: list[dict], tol: compare.Tolerance, problems: list[str] = ()
) -> CheckResult:
    failing = [r for r in records if not r["passed"]]
    # Name the first divergence in check order; if none, the worst leaf.
    worst = failing[0] if failing else max(records, key=lambda r: r["max_rel"])
    passed = not failing and not problems
    return CheckResult(
        name=name,
        passed=passed,
        metric="max_rel",
        value=worst["max_rel"],
        tolerance=tol.max_rel,
        where=worst["tensor"],
        details=tuple(records),
        message="; ".join(problems) or tol.reason,
    )


def compare_runs(
    prefix: str,
    actual: Run,
    expected: Run,
    tol: compare.Tolerance,
    parts: tuple[str, ...] = ("loss", "logits", "grads"),
) -> list[dict]:
    """Records for loss, logits and every gradient leaf of `actual` against `expected`."""
    records = []
    for part in parts:
        diffs = compare.compare_trees(getattr(actual, part), getattr(expected, part))
        records += _records(f"{prefix}{part}", diffs, tol)
    return records


def _vacuity(cfg: Config, named_runs: dict[str, Run]) -> list[str]:
    return [
        f"{label}: {p}"
        for label, run in named_runs.items()
        for p in vacuity_problems(run, cfg.vocab_size)
    ]


# ------------------------------------------------------------------ checks


def roundtrip(session: Session) -> CheckResult:
    """Linen -> NNX -> Linen and NNX -> Linen -> NNX are bit-exact, and so are the layout
    round trips pipeline -> reference -> pipeline, for both weight sources."""
    cfg, mesh = session.cfg, session.mesh
    records = []
    for source in ("linen", "nnx"):
        linen_vars, nnx_params = session.weights(source)
        _, abstract = runs.nnx_abstract(cfg, mesh)
        back_to_linen = convert.nnx_to_linen(
            convert.linen_to_nnx(linen_vars, abstract), target=linen_vars
        )
        records += _tree_records(f"{source}-init/linen->nnx->linen", back_to_linen, linen_vars)
        back_to_nnx = convert.linen_to_nnx(convert.nnx_to_linen(nnx_params), abstract)
        records += _tree_records(
            f"{source}-init/nnx->linen->nnx",
            nnx.to_pure_dict(back_to_nnx),
            nnx.to_pure_dict(nnx_params),
        )
        if cfg.using_pipeline:
            host = jax.device_get(linen_vars)
            there_and_back = convert.linen_reference_to_pipeline(
                convert.linen_pipeline_to_reference(host, cfg), cfg
            )
            records += _tree_records(
                f"{source}-init/pipeline->reference->pipeline", there_and_back, host
            )
    return _result("roundtrip", records, compare.EXACT)


def _tree_records(prefix: str, actual, expected) -> list[dict]:
    actual, expected = nn.meta.unbox(actual), nn.meta.unbox(expected)
    records = _records(prefix, compare.compare_trees(actual, expected), compare.EXACT)
    dtypes_a = [str(np.asarray(x).dtype) for x in jax.tree.leaves(jax.device_get(actual))]
    dtypes_b = [str(np.asarray(x).dtype) for x in jax.tree.leaves(jax.device_get(expected))]
    for record, dtype_a, dtype_b in zip(records, dtypes_a, dtypes_b, strict=True):
        if dtype_a != dtype_b:
            record["passed"] = False
            record["dtype"] = f"{dtype_a} vs {dtype_b}"
    return records


def _framework_pair(session: Session, parts: tuple[str, ...], name: str) -> CheckResult:
    cfg = session.cfg
    tol = compare.twin_tolerance(cfg)
    records, named = [], {}
    for source in ("linen", "nnx"):
        linen_run, nnx_run = session.run("linen", source), session.run("nnx", source)
        named |= {f"linen ({source}-init)": linen_run, f"nnx ({source}-init)": nnx_run}
        records += compare_runs(f"{source}-init/", nnx_run, linen_run, tol, parts)
    return _result(name, records, tol, _vacuity(cfg, named))


def forward(session: Session) -> CheckResult:
    """Logits and loss, NNX against Linen, from Linen-initialised and NNX-initialised weights."""
    return _framework_pair(session, ("loss", "logits"), "forward")


def grads(session: Session) -> CheckResult:
    """Every gradient leaf, NNX against Linen (mapped through the converter)."""
    return _framework_pair(session, ("grads",), "grads")


def pipeline(session: Session) -> CheckResult:
    """Pipelined against reference decoder, within each framework, same weights."""
    cfg = session.cfg
    tol = compare.reshaped_tolerance(cfg)
    if not cfg.using_pipeline:
        return CheckResult(
            "pipeline",
            True,
            "max_rel",
            0.0,
            tol.max_rel,
            "-",
            message="config does not pipeline (S=1): nothing to compare",
        )
    records, named = [], {}
    for framework in ("linen", "nnx"):
        pipelined = session.run(framework, "linen").to_reference_layout(cfg)
        reference = session.run(framework, "linen", use_pipeline=False)
        named |= {f"{framework} pipelined": pipelined, f"{framework} reference": reference}
        records += compare_runs(f"{framework}/", pipelined, reference, tol)
    return _result("pipeline", records, tol, _vacuity(cfg, named))


CHECKS: dict[str, Callable[[Session], CheckResult]] = {
    "roundtrip": roundtrip,
    "forward": forward,
    "grads": grads,
    "pipeline": pipeline,
}
