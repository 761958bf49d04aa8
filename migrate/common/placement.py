"""Where every decoder layer runs: the one place the placement is derived.

The first P = `num_pipelined_layers` of N layers run in the pipeline: global layer
`(r*S + s)*L + j` on stage s during repeat r, in-stage slot j (docs/pipeline.md, "Layer
placement"). The other N - P = `num_layers_after_pipeline` run after it, outside the pipeline
(scanned, on the batch the embedding and logits use): layer P + k is row k of the
`layers_after_pipeline` stack. Converters (`migrate.common.layout`), checkpoints, the drill-down
and the cost accounting all read it from here.
"""

from __future__ import annotations

import dataclasses

from migrate.common import schedule
from migrate.config.contract import Config


@dataclasses.dataclass(frozen=True)
class Placement:
    """One decoder layer's place: (repeat, stage, slot) in the pipeline, or a row after it."""

    layer: int
    repeat: int | None = None
    stage: int | None = None
    slot: int | None = None
    row_after_pipeline: int | None = None

    @property
    def in_pipeline(self) -> bool:
        return self.row_after_pipeline is None

    def describe(self) -> str:
        """`stage 1, repeat 0, slot 0` or `after the pipeline, row 1`."""
        if self.in_pipeline:
            return f"stage {self.stage}, repeat {self.repeat}, slot {self.slot}"
        return f"after the pipeline, row {self.row_after_pipeline}"


def place(cfg: Config, layer: int) -> Placement:
    """The place of global decoder layer `layer` (0-based) under `cfg`."""
    n = cfg.base_num_decoder_layers
    if not 0 <= layer < n:
        raise IndexError(f"layer {layer}: the decoder has layers 0..{n - 1}")
    if not cfg.using_pipeline:
        return Placement(layer)
    pipelined = cfg.num_pipelined_layers
    if layer >= pipelined:
        return Placement(layer, row_after_pipeline=layer - pipelined)
    repeat, stage, slot = schedule.placement(cfg)[layer]  # docs/pipeline.md's formula, for 0..P-1
    return Placement(layer, repeat=repeat, stage=stage, slot=slot)


def placements(cfg: Config) -> list[Placement]:
    """Every layer's place, in data-flow order (global layer order)."""
    if not cfg.using_pipeline:
        return [Placement(i) for i in range(cfg.base_num_decoder_layers)]
    pipelined, p = schedule.placement(cfg), cfg.num_pipelined_layers
    return [
        Placement(i, *pipelined[i]) if i < p else Placement(i, row_after_pipeline=i - p)
        for i in range(cfg.base_num_decoder_layers)
    ]


def pipelined_rows(cfg: Config) -> slice:
    """The reference rows (global layers) that run in the pipeline: `0..P-1`. The pipeline's
    `[R, S, L]` leading axes are these rows reshaped row-major, which is `place`'s formula."""
    return slice(0, cfg.num_pipelined_layers if cfg.using_pipeline else 0)


def rows_after_pipeline(cfg: Config) -> slice:
    """The reference rows that run after the pipeline: `P..N-1` (empty when all are pipelined)."""
    n = cfg.base_num_decoder_layers
    return slice(cfg.num_pipelined_layers if cfg.using_pipeline else n, n)


def has_layers_after_pipeline(cfg: Config) -> bool:
    """Whether the pipelined decoder has a `layers_after_pipeline` stack."""
    return cfg.using_pipeline and cfg.num_layers_after_pipeline > 0


def work_overhead(cfg: Config) -> float:
    """Compiled layer visits over useful ones for the whole layer stack: the pipelined layers at
    `(M*R + d*(S-1)) / (M*R)`, the ones after the pipeline once each (no bubbles)."""
    n = cfg.base_num_decoder_layers
    pipelined = cfg.num_pipelined_layers
    return (pipelined * cfg.pipeline_flop_overhead + (n - pipelined)) / n
