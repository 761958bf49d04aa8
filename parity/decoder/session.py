"""The decoder twins of one config as a pair: the `parity CONFIG` front end's model.

`DecoderPair` holds the mesh, the batch and the two `parity.decoder.sides`; everything the
engine's checks share (weights both ways, runs, compiled programs) is computed once. It adds
what only a pipelined decoder has: runs of the non-pipelined reference (weights moved by the
placement formula) and runs with poisoned pipeline buffers, the layout round trip, the
decoder's data-flow order and a loss that must not sit at ln(vocab).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from migrate.checkpoints import convert
from migrate.common import sharding as sharding_lib
from migrate.config.contract import Config
from parity.analysis import compare
from parity.decoder import cost, drilldown, twins
from parity.decoder.data import synthetic_batch
from parity.decoder.sides import LinenDecoderSide, NNXDecoderSide
from parity.engine.pair import SOURCES, Pair, lm_vacuity_problems
from parity.engine.registry import Check, Front
from parity.engine.result import (
    CheckResult,
    exact_records,
    keyed_records,
    skipped,
    with_note,
)
from parity.engine.side import Run
from parity.multiprocess import distributed

# The value the `bubbles` check fills every pipeline buffer slot with before any stage wrote it.
# One object, so that cached runs and compiled steps keyed on it are found again (NaN != NaN).
BUBBLE_POISON = float("nan")


class DecoderPair(Pair):
    """The Linen and NNX decoders of `cfg` on its mesh, held to the twin tolerance (exact)."""

    front = Front.TWINS
    output_name = "logits"
    program_name = "train step"
    # `--topology`: the slice the `compile` and `program` checks compile for
    # (`parity.tpu.topologies.Target`)
    topology = None
    _on_slice = None

    def on_slice(self) -> Any:
        """`--topology`: both twins' train steps compiled by XLA:TPU for the slice, once per
        run (`parity.tpu.check.OnSlice`)."""
        if self._on_slice is None:
            from parity.tpu import check as tpu_check

            lower = functools.partial(cost.lower_train_step, self.cfg)
            self._on_slice = tpu_check.compile_on_slice(self.cfg, self.topology, lower)
        return self._on_slice

    def __init__(self, cfg: Config, bubble_fill: float = 0.0, topology: Any = None) -> None:
        self.cfg, self.topology = cfg, topology
        self.bubble_fill = bubble_fill
        self.mesh = sharding_lib.make_mesh(cfg)
        self.rules = cfg.logical_axis_rules
        # what the model sees in one call (forward, grads): the first step's, unaccumulated
        self.train_batch = synthetic_batch(cfg, self.mesh, rows=cfg.global_batch_size)
        super().__init__(self._side("linen"), self._side("nnx"), compare.twin_tolerance(cfg))

    def _side(self, framework: str, cfg: Config | None = None, **variant: Any):
        """One twin's side on this mesh and batch; `variant` sets `use_pipeline` (False: the
        non-pipelined reference) or `bubble_fill`."""
        cls = LinenDecoderSide if framework == "linen" else NNXDecoderSide
        options = {"bubble_fill": self.bubble_fill, **variant}
        return cls(cfg or self.cfg, self.mesh, self.train_batch, **options)

    def use_weights(self, framework: str, weights: Any, label: str = "given") -> None:
        """Run every check on `weights` (a checkpoint's, in `framework`'s form) instead of the
        twins' own initialisations: both sources become those weights, run once, and records
        name them `label` (`checkpoint/logits`), not an initialisation."""
        common = self.side(framework).to_common(weights)
        for target in SOURCES:
            native = weights if target == framework else self.side(target).from_common(common)
            for source in SOURCES:
                self._weights[target, source] = native
        self.sources, self._weights_label = ("linen",), label

    _weights_label: str | None = None  # `use_weights`: what records call the weights

    def source_label(self, source: str) -> str:
        return self._weights_label or super().source_label(source)

    def prepared(self, check: Check, function: Callable[..., Any]) -> Callable[..., Any]:
        """`init` skipped on given weights: both twins hold the same ones, and their own
        initialisations were never made. `train` with accumulated gradients also holds a step
        to one step on the whole batch (`accumulation_records`)."""
        if check.name == "train" and self.cfg.gradient_accumulation_steps > 1:
            if self.cfg.num_experts > 1:
                return lambda pair, *args, **kwargs: with_note(
                    function(pair, *args, **kwargs), MOE_ACCUMULATION_NOTE
                )
            return lambda pair, *args, **kwargs: with_accumulation(
                function(pair, *args, **kwargs),
                self.accumulation_records(),
                compare.reshaped_tolerance(self.cfg),
            )
        if check.name != "init" or self._weights_label is None:
            return function
        reason = (
            f"not compared: the checks run on given weights ({self._weights_label}), the same "
            "in both twins; their own initialisations are compared without --checkpoint"
        )
        return lambda pair, *args: skipped("init", "stat/bound", 1.0, reason)

    # ------------------------------------------------------------ what the engine asks

    @property
    def forward_parts(self) -> tuple[str, ...]:
        """Logits and loss; with experts also the load-balancing loss inside the loss."""
        return ("logits", "loss", *self.aux_parts)

    @property
    def aux_parts(self) -> tuple[str, ...]:
        return ("aux_loss",) if self.cfg.num_experts > 1 else ()

    def batch(self, step: int = 0, split: str = "train") -> dict:
        return synthetic_batch(self.cfg, self.mesh, step=step, split=split)

    def rank(self, tensor: str) -> Any:
        return drilldown.data_flow_rank(tensor)

    def vacuity(self, run: Run) -> list[str]:
        return lm_vacuity_problems(run, self.cfg.vocab_size)

    @property
    def linen_variables(self) -> Any:
        """The Linen twin's own initialisation (or the checkpoint's weights, as Linen's)."""
        return self.weights("linen", "linen")

    @property
    def nnx_params(self) -> Any:
        """The NNX twin's own initialisation (or the checkpoint's weights, as NNX's)."""
        return self.weights("nnx", "nnx")

    def extra_roundtrip_records(self, source: str) -> list[dict]:
        """pipeline -> reference -> pipeline is bit-exact too."""
        if not self.cfg.using_pipeline:
            return []
        host = distributed.to_host(self.linen.to_common(self.weights("linen", source)))
        there_and_back = convert.linen_reference_to_pipeline(
            convert.linen_pipeline_to_reference(host, self.cfg), self.cfg
        )
        return exact_records(
            f"{self.source_label(source)}/pipeline->reference->pipeline",
            self.linen.plain(there_and_back),
            self.linen.plain(host),
        )

    def accumulation_records(self) -> list[dict]:
        """Linen's first train step, accumulating over k batches, against one Linen step on
        all k at once (a config of k times the batch), from the same weights and on the same
        rows: the same math summed in another order (the reshaped tier). Loss, gradient norm
        and the optimizer state after the step but AdamW's second moments: its first moments
        are the clipped gradients, scaled, and the second their squares, which adds no fact and
        doubles the relative error (measured worst over the shipped tiny configs, seeds 0-2,
        k = 2 and 4: 2.27e-6 for the first, 3.55e-6 for the second; bench/accumulation_errors.py).
        Not the updated parameters: AdamW's first update g / (|g| + eps) turns a rounding
        difference of a gradient element near eps into an update difference of up to the
        learning rate (2.4e-5 relative on llama2-tiny). Not with experts: the load-balancing
        loss is one batch's routing statistics, averaged over the k batches (as MaxText does),
        not the whole batch's."""
        cfg, k = self.cfg, self.cfg.gradient_accumulation_steps
        whole = cfg.replace(
            per_device_batch_size=cfg.per_device_batch_size * k, gradient_accumulation_steps=1
        )
        batch = self.batch(0)
        weights = self.weights("linen", "linen")
        accumulated = self.linen.trainer(weights)
        at_once = LinenDecoderSide(whole, self.mesh, batch, bubble_fill=self.bubble_fill)
        at_once = at_once.trainer(weights)
        steps = [t.step(t.params, t.opt_state, batch) for t in (accumulated, at_once)]
        (_, opt_state, metrics), (_, whole_opt_state, whole_metrics) = (
            distributed.to_host(step) for step in steps
        )
        tol, plain = compare.reshaped_tolerance(cfg), self.linen.plain
        prefix = f"accumulation: {k} batches vs one of {cfg.train_batch_size} rows, step 0"
        return [
            *keyed_records(f"{prefix}/loss", metrics["loss"], whole_metrics["loss"], tol),
            *keyed_records(
                f"{prefix}/grad_norm", metrics["grad_norm"], whole_metrics["grad_norm"], tol
            ),
            *(
                record
                for record in keyed_records(
                    f"{prefix}/opt_state", plain(opt_state), plain(whole_opt_state), tol
                )
                if "/nu/" not in record["tensor"]
            ),
        ]

    def train_step_lowered(self, framework: str) -> Any:
        """The train step as the other checks lowered it for real weights, where they did (the
        compile check then traces nothing again); None: lower it from shapes."""
        return self.side(framework).any_lowered()

    # ------------------------------------------------------------ the decoder's own runs

    @functools.cache  # noqa: B019 (one pair per config; lives as long as its runs)
    def reference_run(self, framework: str) -> Run:
        """The non-pipelined reference of one twin on Linen's initial weights, moved to the
        reference layout by the placement formula."""
        cfg, mesh = self.cfg, self.mesh
        host = convert.linen_pipeline_to_reference(
            distributed.to_host(self.weights("linen", "linen")), cfg
        )
        reference_cfg = twins.schedule_free(cfg)
        variables = twins.place_linen(host, reference_cfg, mesh, use_pipeline=False)
        side = self._side(framework, cfg=reference_cfg, use_pipeline=False, bubble_fill=0.0)
        return side.run(side.from_common(variables) if framework == "nnx" else variables)

    def pipelined_run(self, framework: str) -> Run:
        """One twin's pipelined run on Linen's initial weights, gradients moved to the
        reference layout."""
        run = self.run(framework, "linen")
        return dataclasses.replace(
            run, grads=convert.linen_pipeline_to_reference(run.grads, self.cfg)
        )

    @functools.cache  # noqa: B019
    def filled_run(self, framework: str, bubble_fill: float) -> Run:
        """One twin on Linen's initial weights with every pipeline buffer slot that no stage
        has written yet filled with `bubble_fill`."""
        if bubble_fill is self.bubble_fill:
            return self.run(framework, "linen")
        side = self._side(framework, bubble_fill=bubble_fill)
        return side.run(self.weights(framework, "linen"))


MOE_ACCUMULATION_NOTE = (
    "accumulated gradients not compared with one step on the whole batch: with experts the "
    "load-balancing loss is each batch's routing statistics, averaged over the batches"
)


def with_accumulation(
    result: CheckResult, records: list[dict], tol: compare.Tolerance
) -> CheckResult:
    """The `train` verdict with the accumulation records added, held to their own tier `tol`:
    a failing one fails the check and, where the twins' steps all passed, is where it fails.
    The check's value stays the twins' worst (against the twins' tolerance); the message says
    how close accumulating came to one step on the whole batch."""
    if not records:
        return result
    failing = [r for r in records if not r["passed"]]
    worst = max(r["max_rel"] for r in records)
    verdict = "differ from" if failing else "match"
    summary = (
        f"accumulated gradients {verdict} one step on the whole batch "
        f"(max_rel {worst:.3g}; {tol.reason})"
    )
    merged = dataclasses.replace(
        result,
        details=(*result.details, *records),
        passed=result.passed and not failing,
        where=failing[0]["tensor"] if failing and result.passed else result.where,
        status="",
    )
    return with_note(merged, summary)
