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
from parity.engine.result import exact_records, skipped
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
        self.train_batch = synthetic_batch(cfg, self.mesh)
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
        initialisations were never made."""
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
