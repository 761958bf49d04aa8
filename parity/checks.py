"""Checks: each a function from a Config to a CheckResult (data only; `report` prints)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from migrate import convert, sharding
from migrate.config import Config
from migrate.linen import decoder as linen_decoder
from parity import compare
from parity.data import synthetic_batch


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


def _records(prefix: str, diffs: list[compare.LeafDiff], tol: compare.Tolerance) -> list[dict]:
    return [
        {
            "tensor": f"{prefix}{d.path}" if d.path else prefix.rstrip("/"),
            "max_abs": d.max_abs,
            "max_rel": d.max_rel,
            "ulp_at_scale": d.ulp_at_scale,
            "mismatches": d.mismatches,
            "nonfinite": d.nonfinite_actual + d.nonfinite_expected,
            "passed": d.passes(tol),
        }
        for d in diffs
    ]


def vacuity_problems(loss: float, logits: jax.Array, grads: Any, vocab_size: int) -> list[str]:
    """Reasons a run proves nothing: two dead models agree perfectly."""
    problems = []
    grad_norm = float(
        np.sqrt(
            sum(
                np.sum(np.square(np.asarray(g, np.float64)))
                for g in jax.tree.leaves(jax.device_get(grads))
            )
        )
    )
    if not grad_norm > 0:
        problems.append(f"gradient norm is {grad_norm}")
    if not np.any(np.asarray(jax.device_get(logits)) != 0):
        problems.append("logits are all zero")
    if abs(loss - math.log(vocab_size)) < 1e-4:
        problems.append(f"loss {loss:.6f} sits at ln(vocab)={math.log(vocab_size):.6f}")
    return problems


def schedule_free(cfg: Config) -> Config:
    """`cfg` with the pipeline-schedule keys at their defaults.

    Initial weights and the reference decoder's arithmetic do not depend on these keys, so
    configs that differ only in them share one initialisation and one compiled reference.
    """
    return cfg.replace(
        model_name="schedule-free",
        num_pipeline_microbatches=-1,
        pipeline_delay_activation_forwarding=False,
        pipeline_fsdp_ag_once=False,
        scan_pipeline_iterations=True,
        set_remat_policy_on_pipeline_iterations=True,
        remat_policy="save_iteration_and_layer_inputs",
    )


@functools.cache
def linen_loss_and_grads(
    cfg: Config, mesh: Mesh, use_pipeline: bool | None = None, bubble_fill: float = 0.0
) -> Callable:
    """Jitted `(variables, batch) -> ((loss, logits), grads)` for a Linen decoder (cached)."""
    model = linen_decoder.Decoder(cfg, mesh, use_pipeline=use_pipeline, bubble_fill=bubble_fill)

    def loss_fn(variables, batch):
        logits = model.apply(variables, batch["inputs"])
        return linen_decoder.cross_entropy_loss(logits, batch["targets"]), logits

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


@functools.cache
def linen_initial_variables(cfg: Config, mesh: Mesh):
    """Boxed, sharded pipelined-decoder variables (cached per schedule-free config)."""
    cfg = schedule_free(cfg)
    tokens = jnp.zeros((cfg.global_batch_size, cfg.max_target_length), jnp.int32)
    return linen_decoder.init_variables(linen_decoder.Decoder(cfg, mesh), tokens)


@dataclasses.dataclass(frozen=True)
class Run:
    """One forward+backward: loss, logits, and gradients in the reference layout (unboxed)."""

    loss: jax.Array
    logits: jax.Array
    grads: Any


def linen_pipeline_runs(cfg: Config, bubble_fill: float = 0.0) -> tuple[Run, Run]:
    """(pipelined, reference) Linen runs from the same weights on the same batch."""
    mesh = sharding.make_mesh(cfg)
    batch = synthetic_batch(cfg, mesh)
    variables = linen_initial_variables(schedule_free(cfg), mesh)
    reference_cfg = schedule_free(cfg)
    ref_abstract = jax.eval_shape(
        linen_decoder.Decoder(reference_cfg, mesh, use_pipeline=False).init,
        jax.random.key(0),
        batch["inputs"],
    )
    # Layouts move on the host: eager reshapes of sharded arrays would each compile.
    ref_variables = jax.device_put(
        convert.linen_pipeline_to_reference(jax.device_get(variables), cfg),
        linen_decoder.param_shardings(ref_abstract, mesh, cfg),
    )

    (loss, logits), grads = linen_loss_and_grads(cfg, mesh, None, bubble_fill)(variables, batch)
    (ref_loss, ref_logits), ref_grads = linen_loss_and_grads(reference_cfg, mesh, False)(
        ref_variables, batch
    )
    grads_as_ref = convert.linen_pipeline_to_reference(jax.device_get(grads), cfg)
    return (
        Run(*jax.device_get((loss, logits)), nn.meta.unbox(grads_as_ref)),
        Run(*jax.device_get((ref_loss, ref_logits)), nn.meta.unbox(jax.device_get(ref_grads))),
    )


def compare_runs(
    name: str, cfg: Config, actual: Run, expected: Run, tol: compare.Tolerance
) -> CheckResult:
    """Loss, logits and every gradient leaf of `actual` against `expected`, plus vacuity."""
    diffs = {
        "loss": compare.compare_trees(actual.loss, expected.loss),
        "logits": compare.compare_trees(actual.logits, expected.logits),
        "grads/": compare.compare_trees(actual.grads, expected.grads),
    }
    details = [r for prefix, d in diffs.items() for r in _records(prefix, d, tol)]
    worst_record = max(details, key=lambda r: (r["nonfinite"] > 0, r["max_rel"]))
    problems = []
    for side, run in (("actual", actual), ("expected", expected)):
        problems += [
            f"{side}: {p}"
            for p in vacuity_problems(float(run.loss), run.logits, run.grads, cfg.vocab_size)
        ]
    passed = all(r["passed"] for r in details) and not problems
    return CheckResult(
        name=name,
        passed=passed,
        metric="max_rel",
        value=worst_record["max_rel"],
        tolerance=tol.max_rel,
        where=worst_record["tensor"],
        details=tuple(details),
        message="; ".join(problems) or tol.reason,
    )


def linen_pipeline_vs_reference(cfg: Config, bubble_fill: float = 0.0) -> CheckResult:
    """The pipelined Linen decoder equals the non-pipelined one with the same weights."""
    pipelined, reference = linen_pipeline_runs(cfg, bubble_fill)
    return compare_runs("pipeline", cfg, pipelined, reference, compare.reshaped_tolerance(cfg))
