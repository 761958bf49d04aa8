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

from migrate import convert, errors, optim
from migrate import sharding as sharding_lib
from migrate.config import Config
from migrate.errors import EXIT_FAIL, EXIT_INTERNAL, EXIT_PASS, EXIT_USAGE
from migrate.layout import LayoutError
from parity import compare, distributed, drilldown, hlo, hlo_diff, init_check, runs
from parity.data import synthetic_batch
from parity.runs import Run

# A check's status and the exit status it gives the run (the largest over all checks wins):
# `failed` is a real parity failure; `bad_input` a check that could not run on this input or
# machine (out of memory, a config error found late); `errored` one that crashed (a bug).
EXIT_STATUS = {
    "passed": EXIT_PASS,
    "failed": EXIT_FAIL,
    "bad_input": EXIT_USAGE,
    "errored": EXIT_INTERNAL,
}
# Exceptions that mean the twins differ (a check that raises one of these failed, it did not
# crash): mismatching paths or names in the converter, layouts, trees of different shapes.
PARITY_ERRORS = (convert.ConversionError, LayoutError, compare.TreeMismatch)


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
    steps: tuple[dict[str, Any], ...] = ()  # per-step series (train), for the plot
    status: str = ""  # a key of EXIT_STATUS; default: passed or failed, from `passed`

    def __post_init__(self) -> None:
        if not self.status:
            object.__setattr__(self, "status", "passed" if self.passed else "failed")
        if self.status not in EXIT_STATUS or (self.status == "passed") != self.passed:
            raise ValueError(f"check {self.name}: status {self.status!r}, passed={self.passed}")


class Session:
    """Everything the checks of one config share: mesh, batch, weights, runs."""

    def __init__(self, cfg: Config, bubble_fill: float = 0.0) -> None:
        self.cfg = cfg
        self.bubble_fill = bubble_fill
        self.mesh = sharding_lib.make_mesh(cfg)
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

    def train_start(self, framework: str):
        """(params, opt_state, compiled train step, eval step) from the Linen-initialised
        weights. The step donates the train state, so every call returns a fresh copy of the
        weights and a new optimizer state; the step is compiled once and shared by the train
        and sharding checks."""
        params, step, evaluate = self._train_parts(framework)
        params = runs.fresh_copy(params)
        return params, optim.make_optimizer(self.cfg).init(params), step, evaluate

    @functools.cache  # noqa: B019 (one Session per config; lives as long as its runs)
    def _train_parts(self, framework: str):
        """(the session's Linen-initialised weights in `framework`'s form, never donated;
        compiled train step; eval step)."""
        if framework == "linen":
            params = self.linen_variables["params"]
            _, evaluate = runs.linen_train_fns(self.cfg, self.mesh)
            # The same arguments as the sharding check's own step: share its compilation.
            return params, self.own_train_step("linen"), evaluate
        params = runs.linen_to_nnx_params(self.cfg, self.mesh, self.linen_variables)
        step, evaluate = runs.nnx_train_fns(self.cfg, self.mesh)
        # A real optimizer state, not `jax.eval_shape`'s (which carries no shardings): a step
        # jitted without pinned shardings (tests/test_injected_bugs.py) must be compiled for
        # the arguments the train check will pass it.
        opt_state = optim.make_optimizer(self.cfg).init(params)
        return params, step.lower(params, opt_state, self.batch).compile(), evaluate

    @functools.cache  # noqa: B019
    def own_lowered(self, framework: str):
        """The train step lowered for each twin's own initial weights (their own placement):
        the sharding and program checks must not depend on the converter working."""
        tx = optim.make_optimizer(self.cfg)
        if framework == "linen":
            params = self.linen_variables["params"]
            step, _ = runs.linen_train_fns(self.cfg, self.mesh)
        else:
            params = self.nnx_params
            step, _ = runs.nnx_train_fns(self.cfg, self.mesh)
        return step.lower(params, tx.init(params), self.batch)

    @functools.cache  # noqa: B019
    def own_train_step(self, framework: str):
        """`own_lowered(framework)`, compiled."""
        return self.own_lowered(framework).compile()

    @functools.cache  # noqa: B019
    def run(
        self,
        framework: str,
        source: str,
        use_pipeline: bool | None = None,
        bubble_fill: float | None = None,
    ) -> Run:
        """Forward+backward of one twin from `source` weights; reference runs get the weights
        moved by the placement formula. `bubble_fill` overrides the session's fill of the
        pipeline buffers (the `bubbles` check poisons them with `BUBBLE_POISON`)."""
        linen_vars, nnx_params = self.weights(source)
        cfg, mesh = self.cfg, self.mesh
        reference = use_pipeline is False and cfg.using_pipeline
        if reference:
            host = convert.linen_pipeline_to_reference(distributed.to_host(linen_vars), cfg)
            ref_cfg = runs.schedule_free(cfg)
            linen_vars = runs.place_linen(host, ref_cfg, mesh, use_pipeline=False)
            cfg = ref_cfg
            if framework == "nnx":
                nnx_params = runs.linen_to_nnx_params(cfg, mesh, linen_vars, use_pipeline=False)
        fill = self.bubble_fill if bubble_fill is None else bubble_fill
        fill = 0.0 if reference else fill
        if framework == "linen":
            return runs.run_linen(cfg, mesh, linen_vars, self.batch, use_pipeline, fill)
        return runs.run_nnx(cfg, mesh, nnx_params, self.batch, use_pipeline, fill)


# The value the `bubbles` check fills every pipeline buffer slot with before any stage wrote it.
# One object, so that cached runs and compiled steps keyed on it are found again (NaN != NaN).
BUBBLE_POISON = float("nan")


# ------------------------------------------------------------------ helpers


def errored(name: str, error: Exception) -> CheckResult:
    """A check that raised. A `PARITY_ERRORS` exception (converter errors list every path) is a
    failed check; bad input or a resource (out of memory) is `bad_input`; anything else is a
    crash of the harness, `errored`, never reported as a parity failure."""
    text = str(error)[:20_000]
    first_line = text.splitlines()[0] if text else ""
    where = text.splitlines()[1].strip(" -") if len(text.splitlines()) > 1 else first_line
    if isinstance(error, PARITY_ERRORS):
        status, message = "failed", f"{type(error).__name__}: {text[:4000]}"
    else:
        exit_status, _, message = errors.classify(error)
        status = "bad_input" if exit_status == EXIT_USAGE else "errored"
    return CheckResult(
        name=name,
        passed=False,
        metric="error",
        value=float("inf"),
        tolerance=0.0,
        where=where[:300],
        message=message,
        status=status,
    )


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
    name: str,
    records: list[dict],
    tol: compare.Tolerance,
    problems: list[str] = (),
    worst_first: bool = False,
) -> CheckResult:
    """The verdict over `records`. `where` names the first failing record in check order (the
    step order of `train`, the data flow of `layers`) or, with `worst_first`, the failing
    record with the largest error relative to its scale, the earliest in the decoder's data
    flow among equals; when nothing fails, the worst record."""
    failing = [r for r in records if not r["passed"]]
    if failing and worst_first:
        worst = min(failing, key=lambda r: (-r["max_rel"], drilldown.data_flow_rank(r["tensor"])))
    else:
        worst = failing[0] if failing else max(records, key=lambda r: r["max_rel"])
    passed = not failing and not problems
    # A vacuous run (no failing record) is named by its first problem.
    where = problems[0] if problems and not failing else worst["tensor"]
    return CheckResult(
        name=name,
        passed=passed,
        metric="max_rel",
        value=worst["max_rel"],
        tolerance=tol.max_rel,
        where=where,
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
            host = distributed.to_host(linen_vars)
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
    dtypes_a = [str(np.asarray(x).dtype) for x in jax.tree.leaves(distributed.to_host(actual))]
    dtypes_b = [str(np.asarray(x).dtype) for x in jax.tree.leaves(distributed.to_host(expected))]
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
    return _result(name, records, tol, _vacuity(cfg, named), worst_first=True)


def forward(session: Session) -> CheckResult:
    """Logits and loss, NNX against Linen, from Linen-initialised and NNX-initialised weights."""
    return _framework_pair(session, ("logits", "loss"), "forward")


def grads(session: Session) -> CheckResult:
    """Every gradient leaf, NNX against Linen (mapped through the converter)."""
    return _framework_pair(session, ("grads", "grad_norm"), "grads")


PIPELINE_PARTS = ("loss", "logits", "grads", "grad_norm")


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
        # grad_norm: the global norm clipping uses, computed on device from the gradients as
        # sharded over stage, fsdp and tensor, must equal the unpipelined reference's.
        records += compare_runs(f"{framework}/", pipelined, reference, tol, PIPELINE_PARTS)
    return _result("pipeline", records, tol, _vacuity(cfg, named), worst_first=True)


def init(session: Session) -> CheckResult:
    """Linen's and NNX's own initialisations of the same config: per parameter the logical
    names, shape and dtype exactly, and the distribution (mean, std, kurtosis, tail, zeros,
    distinct stacked slices) within bounds derived from the element counts."""
    records = init_check.init_records(session.linen_variables["params"], session.nnx_params)
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


def bubbles(session: Session) -> CheckResult:
    """Both twins with NaN in every pipeline buffer slot that no stage has written yet:
    logits, loss and every gradient bit-identical to the zero-filled run. Idle slots that
    compute on unmasked buffers pass the forward (their outputs are discarded) but put NaN into
    the weight gradients (NaN x 0 is NaN)."""
    cfg = session.cfg
    if not cfg.using_pipeline:
        return CheckResult(
            "bubbles",
            True,
            "max_rel",
            0.0,
            0.0,
            "-",
            message="config does not pipeline (S=1): no bubbles",
        )
    records = []
    for framework in ("linen", "nnx"):
        poisoned = session.run(framework, "linen", bubble_fill=BUBBLE_POISON)
        clean = session.run(framework, "linen", bubble_fill=0.0)
        for record in compare_runs(
            f"{framework}/", poisoned, clean, compare.EXACT, ("logits", "loss", "grads")
        ):
            records.append(record | {"passed": record["passed"] and record["mismatches"] == 0})
    result = _result("bubbles", records, compare.EXACT, worst_first=True)
    note = (
        "NaN-filled buffers: bit-identical to zero-filled"
        if result.passed
        else (
            "NaN or a difference reached an output or gradient from an idle pipeline slot: "
            "mask the stage input of idle slots, not only the discarded output"
        )
    )
    return dataclasses.replace(result, message=note)


def program(session: Session) -> CheckResult:
    """The two twins' train steps, each lowered for its own weights, compared instruction by
    instruction before and after XLA's optimisation: identical programs are the strongest
    parity evidence; otherwise the first differing instruction is named on each side."""
    records, summaries = [], []
    for stage in ("pre-optimisation", "optimised"):
        texts = []
        for framework in ("linen", "nnx"):
            if stage == "optimised":
                texts.append(session.own_train_step(framework).as_text())
            else:
                texts.append(session.own_lowered(framework).as_text(dialect="hlo", debug_info=True))
        found = hlo_diff.diff(hlo_diff.parse(texts[0]), hlo_diff.parse(texts[1]))
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


def _linen_form(tree) -> Any:
    """Any tree holding NNX States or Linen boxes -> plain nested dicts of host arrays."""
    tree = jax.tree.map(
        lambda x: nnx.to_pure_dict(x) if isinstance(x, nnx.State) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.State),
    )
    return distributed.to_host(nn.meta.unbox(tree))


def _params_unchanged(prefix: str, before, after) -> list[dict]:
    consumed = [
        f"{prefix}/{compare.path_str(path)}"
        for path, x in jax.tree_util.tree_flatten_with_path(after)[0]
        if isinstance(x, jax.Array) and x.is_deleted()
    ]
    if consumed:  # a donating evaluation: the state after it cannot even be read
        note = "deleted: the evaluation consumed (donated) the parameters"
        return [{"tensor": t, "passed": False, "max_rel": math.inf, "note": note} for t in consumed]
    records = _records(
        prefix, compare.compare_trees(_linen_form(after), _linen_form(before)), compare.EXACT
    )
    return [r | {"passed": r["passed"] and r["mismatches"] == 0} for r in records]


def train(
    session: Session, steps: int = 5, on_step: Callable[[int, bool], None] | None = None
) -> CheckResult:
    """`steps` AdamW steps on both twins from the same weights and optimizer state, with a
    forward-only evaluation before the first step and after the last. Per step: loss, gradient
    norm, every updated parameter and every optimizer-state leaf; the first diverging step is
    named. `on_step(step, passed)` is called after each step."""
    cfg, mesh = session.cfg, session.mesh
    tol = compare.twin_tolerance(cfg)
    linen_params, linen_opt, linen_step, linen_eval = session.train_start("linen")
    nnx_params, nnx_opt, nnx_step, nnx_eval = session.train_start("nnx")
    eval_batch = synthetic_batch(cfg, mesh, split="eval")

    records: list[dict] = []
    per_step: list[dict] = []

    def evaluate(label: str) -> None:
        # Host copies: evaluation must leave no state behind on either side, and may not
        # consume it (the train step donates its state; evaluation must not).
        before = (_linen_form(linen_params), _linen_form(nnx_params))
        linen_loss, nnx_loss = (
            linen_eval(linen_params, eval_batch),
            nnx_eval(nnx_params, eval_batch),
        )
        records.extend(compare_runs_parts(f"eval-{label}/loss", nnx_loss, linen_loss, tol))
        records.extend(_params_unchanged(f"eval-{label}/linen-params", before[0], linen_params))
        records.extend(_params_unchanged(f"eval-{label}/nnx-params", before[1], nnx_params))

    records.extend(
        compare_runs_parts("init/opt_state", _linen_form(nnx_opt), _linen_form(linen_opt), tol)
    )
    evaluate("before")
    losses = []
    for step in range(steps):
        batch = synthetic_batch(cfg, mesh, step=step)
        linen_params, linen_opt, linen_metrics = linen_step(linen_params, linen_opt, batch)
        nnx_params, nnx_opt, nnx_metrics = nnx_step(nnx_params, nnx_opt, batch)
        linen_metrics, nnx_metrics = distributed.to_host((linen_metrics, nnx_metrics))
        # A step whose outputs are not valid inputs of the next cannot be stepped again: say
        # where, as a parity failure of that step, instead of letting the next call raise.
        step_records = _returned_state_records(
            f"step {step}/linen returned", linen_step, linen_params, linen_opt
        ) + _returned_state_records(f"step {step}/nnx returned", nnx_step, nnx_params, nnx_opt)
        resumable = all(r["passed"] for r in step_records)
        for key in ("loss", "grad_norm"):
            step_records += compare_runs_parts(
                f"step {step}/{key}", nnx_metrics[key], linen_metrics[key], tol
            )
        step_records += compare_runs_parts(
            f"step {step}/params", _linen_form(nnx_params), _linen_form(linen_params), tol
        )
        step_records += compare_runs_parts(
            f"step {step}/opt_state", _linen_form(nnx_opt), _linen_form(linen_opt), tol
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
        evaluate("after")
    problems = []
    if steps and not losses[-1] < losses[0] + 1.0:
        problems.append(f"training diverged: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    result = _result("train", records, tol, problems)
    return dataclasses.replace(result, steps=tuple(per_step))


def _returned_state_records(prefix: str, compiled_step, params, opt_state) -> list[dict]:
    """Each returned parameter and optimizer-state array against the sharding the compiled
    step takes it with; only the mismatches are recorded."""
    expected = jax.tree.leaves(compiled_step.input_shardings[0][:2])
    returned = [
        (f"{part}/{compare.path_str(path)}", array)
        for part, tree in (("params", params), ("opt_state", opt_state))
        for path, array in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    records = []
    for (path, array), want in zip(returned, expected, strict=True):
        have = getattr(array, "sharding", None)
        if have is None or have.is_equivalent_to(want, array.ndim):
            continue
        records.append(
            {
                "tensor": f"{prefix}: {path}",
                "passed": False,
                "max_rel": math.inf,
                "returned": str(getattr(have, "spec", have)),
                "expected": str(getattr(want, "spec", want)),
            }
        )
    return records


def compare_runs_parts(prefix: str, actual, expected, tol: compare.Tolerance) -> list[dict]:
    """Records for two trees (or arrays) of the same structure."""
    return _records(prefix, compare.compare_trees(actual, expected), tol)


def sharding_record(tensor: str, passed: bool, linen: Any, nnx_side: Any) -> dict:
    """One fact of a sharding comparison: Linen's value, NNX's, and whether they agree."""
    return {
        "tensor": tensor,
        "passed": bool(passed),
        "linen": str(linen),
        "nnx": str(nnx_side),
        "max_rel": 0.0 if passed else 1.0,
    }


def collective_records(linen_counts: dict[str, int], nnx_counts: dict[str, int]) -> list[dict]:
    """One record per collective kind (`hlo.collective_counts` of each compiled program):
    the counts must be equal."""
    return [
        sharding_record(
            f"collectives: {kind}",
            linen_counts[kind] == nnx_counts[kind],
            linen_counts[kind],
            nnx_counts[kind],
        )
        for kind in hlo.COLLECTIVES
    ]


def loop_collective_records(linen_counts: dict[str, int], nnx_counts: dict[str, int]) -> list:
    """One record per loop-body collective kind (`hlo.loop_collective_counts`): the twins'
    loops, remat recomputation included, must issue the same collectives."""
    return [
        sharding_record(
            f"collectives: loop body {key}",
            linen_counts.get(key, 0) == nnx_counts.get(key, 0),
            linen_counts.get(key, 0),
            nnx_counts.get(key, 0),
        )
        for key in sorted(set(linen_counts) | set(nnx_counts))
    ]


def sharding(session: Session) -> CheckResult:
    """Per parameter: Linen box names vs NNX `out_sharding`, the rank check, the resolved
    PartitionSpec, the NamedSharding of the initialised arrays; the compiled train steps'
    input and output shardings; the count of each collective in both compiled train steps, and
    per pipeline-loop body (remat recomputation apart)."""
    cfg, mesh, rules = session.cfg, session.mesh, session.cfg.logical_axis_rules
    records = []
    linen_abstract = runs.linen_abstract_variables(cfg, mesh)["params"]
    _, nnx_abstract = runs.nnx_abstract(cfg, mesh)
    linen_flat = convert.flatten_dict(convert.strip_boxes(linen_abstract)[1])
    nnx_flat = convert.nnx_flat_params(nnx_abstract)
    linen_arrays = convert.flatten_dict(nn.meta.unbox(session.linen_variables["params"]))
    nnx_arrays = convert.flatten_dict(nnx.to_pure_dict(session.nnx_params))
    for path in sorted(set(linen_flat) | set(nnx_flat)):
        where = "/".join(path)
        linen_names = linen_flat.get(path)
        nnx_names = convert.nnx_names(nnx_flat[path]) if path in nnx_flat else None
        records.append(
            sharding_record(
                f"{where}: names",
                linen_names == nnx_names and linen_names is not None,
                linen_names,
                nnx_names,
            )
        )
        if linen_names is None or nnx_names is None:
            continue
        ndim = len(linen_arrays[path].shape)
        records.append(
            sharding_record(
                f"{where}: rank",
                len(linen_names) == ndim and len(nnx_names) == ndim,
                f"{len(linen_names)} names, ndim {ndim}",
                f"{len(nnx_names)} names, ndim {ndim}",
            )
        )
        linen_spec = sharding_lib.logical_to_spec(linen_names, rules)
        nnx_spec = sharding_lib.logical_to_spec(nnx_names, rules)
        records.append(
            sharding_record(f"{where}: spec", linen_spec == nnx_spec, linen_spec, nnx_spec)
        )
        expected = jax.sharding.NamedSharding(mesh, linen_spec)
        linen_placed, nnx_placed = linen_arrays[path].sharding, nnx_arrays[path].sharding
        records.append(
            sharding_record(
                f"{where}: placed",
                expected.is_equivalent_to(linen_placed, ndim)
                and expected.is_equivalent_to(nnx_placed, ndim),
                linen_placed.spec,
                nnx_placed.spec,
            )
        )

    linen_compiled, nnx_compiled = session.own_train_step("linen"), session.own_train_step("nnx")
    records += train_step_sharding_records(session, linen_compiled, nnx_compiled)
    linen_text, nnx_text = linen_compiled.as_text(), nnx_compiled.as_text()
    linen_counts = hlo.collective_counts(linen_text)
    records += collective_records(linen_counts, hlo.collective_counts(nnx_text))
    records += loop_collective_records(
        hlo.loop_collective_counts(linen_text), hlo.loop_collective_counts(nnx_text)
    )
    failing = [r for r in records if not r["passed"]]
    worst = failing[0] if failing else records[-1]
    return CheckResult(
        name="sharding",
        passed=not failing,
        metric="mismatches",
        value=float(len(failing)),
        tolerance=0.0,
        where=worst["tensor"] if failing else f"{len(records)} facts agree",
        details=tuple(records),
        message=(
            f"linen {worst['linen']} vs nnx {worst['nnx']}"
            + (f" (declared {worst['declared']})" if "declared" in worst else "")
            if failing
            else "collectives per train step: "
            + ", ".join(f"{k}={v}" for k, v in linen_counts.items())
        ),
    )


def declared_step_shardings(session: Session, framework: str) -> dict[str, Any]:
    """The shardings each twin's train step is pinned to, per side, as prefix trees of its
    (params, opt_state, batch) inputs and (params, opt_state, metrics) outputs."""
    cfg, mesh = session.cfg, session.mesh
    train_shardings = (
        runs.linen_train_shardings if framework == "linen" else runs.nnx_train_shardings
    )
    params, opt_state = train_shardings(cfg, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    batch = sharding_lib.batch_sharding(cfg, mesh)
    return {"input": (params, opt_state, batch), "output": (params, opt_state, replicated)}


_STEP_PARTS = {
    "input": ("params", "opt_state", "batch"),
    "output": ("params", "opt_state", "metrics"),
}


def _step_leaves(compiled, side: str, declared) -> list[tuple[str, Any, Any, int]]:
    """(path, compiled sharding, declared sharding, ndim) per array of one side of the step."""
    if side == "input":
        actual, avals = compiled.input_shardings[0], compiled.args_info[0]
    else:
        actual, avals = compiled.output_shardings, compiled.out_info
    # The declared tree is a prefix (one sharding per box, Variable or batch): broadcast it.
    expected = jax.tree.map(lambda d, sub: jax.tree.map(lambda _: d, sub), declared, actual)
    flat_actual, _ = jax.tree_util.tree_flatten_with_path(actual)
    leaves = []
    for (path, a), d, aval in zip(
        flat_actual, jax.tree.leaves(expected), jax.tree.leaves(avals), strict=True
    ):
        part, rest = _STEP_PARTS[side][path[0].idx], compare.path_str(path[1:])
        name = "/".join(p for p in (part, rest) if p).removesuffix("/value")
        leaves.append((name, a, d, len(aval.shape)))
    return leaves


def train_step_sharding_records(session: Session, linen_compiled, nnx_compiled) -> list[dict]:
    """Per input and output array of the compiled train steps: Linen's and NNX's shardings must
    both be the declared ones (parameters and moments as their logical names say, counts and
    metrics replicated), so that the outputs of one step are valid inputs of the next."""
    records = []
    declared = {fw: declared_step_shardings(session, fw) for fw in ("linen", "nnx")}
    for side in ("input", "output"):
        linen = _step_leaves(linen_compiled, side, declared["linen"][side])
        nnx_side = _step_leaves(nnx_compiled, side, declared["nnx"][side])
        if len(linen) != len(nnx_side):
            records.append(
                sharding_record(f"train step {side}s: count", False, len(linen), len(nnx_side))
            )
            continue
        for (path, linen_sh, linen_decl, ndim), (_, nnx_sh, nnx_decl, _) in zip(
            linen, nnx_side, strict=True
        ):
            record = sharding_record(
                f"train step {side}: {path}",
                linen_sh.is_equivalent_to(linen_decl, ndim)
                and nnx_sh.is_equivalent_to(nnx_decl, ndim)
                and linen_decl.is_equivalent_to(nnx_decl, ndim),
                getattr(linen_sh, "spec", linen_sh),
                getattr(nnx_sh, "spec", nnx_sh),
            )
            records.append(record | {"declared": str(linen_decl.spec)})
    return records


def layers(session: Session) -> CheckResult:
    """Drill-down: the first layer and tensor, and for pipelines the first iteration and
    stage, where NNX departs from Linen."""
    cfg = session.cfg
    tol = compare.twin_tolerance(cfg)
    records = drilldown.layer_records(session, tol)
    if cfg.using_pipeline:
        records += drilldown.iteration_records(session, tol)
    return _result("layers", records, tol)


# NNX may not cost more than Linen: temp memory, FLOPs and argument/output bytes of the compiled
# train step within 1% (the twins compile to the same program today, so the measured ratios are
# exactly 1.00; the margin only absorbs benign differences in XLA's bookkeeping).
COST_TOLERANCE = 0.01
# Pipeline matmul work against `(M*R + d*(S-1)) / (M*R)`. Both are exact counts (dot FLOPs read
# off the compiled HLO), measured equal on every shipped config, mesh and dtype (docs/configs.md);
# the margin only allows for XLA rewriting a tiny dot into elementwise code.
EFFICIENCY_TOLERANCE = 0.001


def compile_cost(session: Session) -> CheckResult:
    """Both twins' whole train steps compiled from abstract inputs (no weights allocated):
    per-device memory (arguments, temp, outputs, the bytes aliased by donation, and the peak
    they add up to), FLOPs, bytes accessed, collectives, compile time; NNX must not cost more
    than Linen beyond COST_TOLERANCE, must alias as much, and must issue the same
    collectives."""
    from parity import cost

    cfg, mesh = session.cfg, session.mesh
    linen_cost = cost.compile_train_step(cfg, mesh, "linen")
    nnx_cost = cost.compile_train_step(cfg, mesh, "nnx")
    records, loop_summary = loop_body_records(cfg, dict(mesh.shape), linen_cost, nnx_cost)
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
    ):
        linen_value, nnx_value = getattr(linen_cost, field), getattr(nnx_cost, field)
        ratio = nnx_value / linen_value if linen_value else (1.0 if not nnx_value else math.inf)
        gated = field not in ("compile_seconds", "bytes_accessed", "generated_code_bytes")
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
    outside, outside_summary = outside_loop_records(dict(mesh.shape), linen_cost, nnx_cost)
    records += outside
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
        f"{name} args {_bytes(c.argument_bytes)} + temp {_bytes(c.temp_bytes)} + "
        f"out {_bytes(c.output_bytes)} - aliased {_bytes(c.alias_bytes)} = peak "
        f"{_bytes(c.peak_bytes)}, {c.flops:.3g} flops, compiled in "
        f"{c.compile_seconds:.1f}s"
        for name, c in (("linen", linen_cost), ("nnx", nnx_cost))
    )
    per_device += "; same optimised program" if same_program else "; programs differ"
    per_device += f"; {loop_summary}; {outside_summary}"
    return CheckResult(
        name="compile",
        passed=not failing,
        metric="nnx/linen-1",
        value=worst["max_rel"],
        tolerance=COST_TOLERANCE,
        where=worst["tensor"],
        details=tuple(records),
        message=f"per device: {per_device}",
    )


def loop_body_records(
    cfg: Config, mesh_shape: dict[str, int], linen_cost, nnx_cost
) -> tuple[list[dict], str]:
    """Records of the collectives in both twins' pipeline-loop bodies against
    `cost.loop_body_minimum` (across stages), the ag-once rule (no all-gather over fsdp in
    the loop), and the loops' presence; plus a one-line summary."""
    from parity import cost

    minimum = cost.loop_body_minimum(cfg)
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
        if cfg.pipeline_fsdp_ag_once:
            seen = {fw: c.fsdp_all_gathers[direction] for fw, c in counts.items()}
            records.append(
                {
                    "tensor": f"loop body {direction}: all-gather over fsdp (ag-once)",
                    **seen,
                    "minimum": 0,
                    "max_rel": float(max(seen.values())),
                    "passed": not any(seen.values()),
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
    from parity import cost

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


def _bytes(count: float) -> str:
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


def efficiency(session: Session) -> CheckResult:
    """The matmul work the compiled pipeline performs (per-device dot FLOPs x devices) against
    the useful work (every layer once on the full batch) and the schedule's theory; the loop's
    elementwise overhead is reported beside it."""
    from parity import cost

    cfg = session.cfg
    if not cfg.using_pipeline:
        return CheckResult(
            "efficiency",
            True,
            "overhead_error",
            0.0,
            EFFICIENCY_TOLERANCE,
            "-",
            message="config does not pipeline (S=1)",
        )
    measured = cost.pipeline_efficiency(cfg, session.mesh)
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
        f"(M*R + d*(S-1))/(M*R) = {measured.theoretical_overhead:.4f}; the loop's elementwise "
        f"work adds {measured.loop_elementwise_overhead:.2%} of the matmul work",
    )


CHECKS: dict[str, Callable[[Session], CheckResult]] = {
    "roundtrip": roundtrip,
    "init": init,
    "forward": forward,
    "grads": grads,
    "pipeline": pipeline,
    "bubbles": bubbles,
    "sharding": sharding,
    "program": program,
    "train": train,
    "layers": layers,
    "compile": compile_cost,
    "efficiency": efficiency,
}
