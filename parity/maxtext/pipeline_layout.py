"""MaxText's pipelined decoder against its own decoder without pipelining: the reference
config, and the weights between the two layouts (numpy only: the harness builds the config, a
release's worker moves the arrays).

The reference is the same config with the pipeline axes folded into data parallelism (the
same devices, the same global batch; `reference_overrides`) and every pipeline key dropped:
MaxText then scans all N decoder layers as one stack, `decoder/layers/...`, the layer axis at
`param_scan_axis`. The pipelined decoder holds `P = pipeline_parallel_layers` of them in
`decoder/pipeline_module/layers[/layers_<j>]/...`, stacked `[R?, S, ...]` (the repeats' axis
only with R > 1): repeat r, stage s, slot j is layer `(r*S + s)*L + j`; the N - P layers after
the pipeline (`decoder/layers_outside_pipeline`, stacked at `param_scan_axis`) are layers P to
N - 1. DeepSeek keeps its dense layers apart in both (`dense_layers`, unchanged) and runs the
MoE layers outside the pipeline *before* it: the reference's `moe_layers` are those, then the
pipeline's. Strict both ways (`WeightMapError`): every leaf mapped, every stack of the counts
the config says.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from migrate.checkpoints.weight_map import WeightMapError

PIPELINE = ("params", "decoder", "pipeline_module", "layers")
# Keys of a pipelined config that the reference drops (MaxText's defaults: no pipeline).
PIPELINE_KEYS = re.compile(
    r"^(num_pipeline_\w+|pipeline_\w+|num_layers_per_pipeline_stage|scan_layers_per_stage"
    r"|scan_pipeline_iterations|(ici|dcn)_pipeline_parallelism)$"
)


def stages(keys: dict[str, Any]) -> int:
    """A config's pipeline stages (its `ici_` times its `dcn_pipeline_parallelism`)."""
    dcn = keys.get("dcn_pipeline_parallelism", 1)
    return int(keys.get("ici_pipeline_parallelism", 1)) * max(int(dcn), 1)


# Decoder blocks whose scanned stack holds a block of layers per scan step (gemma3: its
# attention pattern's six layers, and a `layers_remainder`; llama4: its dense/MoE interleave),
# which the layer map here (one layer per scan step, `layers_<j>` slots per stage) does not carry.
BLOCK_SCANNED = {
    "gemma3": "gemma3 scans its layers in blocks of its attention pattern (and a layers_remainder)",
    "llama4": "llama4 scans its layers in blocks of its dense and MoE interleave",
}


def unmapped(keys: dict[str, Any]) -> str | None:
    """Why the layer map cannot carry `keys`' decoder between its layouts, or None."""
    return BLOCK_SCANNED.get(str(keys.get("decoder_block", "llama2")).lower())


def reference_overrides(keys: dict[str, Any]) -> dict[str, Any]:
    """The MaxText keys of `keys`' decoder without pipelining: the stage axes folded into data
    parallelism (ici and dcn alike; into nothing where another axis of that kind is -1 and
    takes the devices left), every pipeline key dropped, the layers scanned."""
    out = {k: v for k, v in keys.items() if not PIPELINE_KEYS.match(k)}
    for kind in ("ici", "dcn"):
        folded = int(keys.get(f"{kind}_pipeline_parallelism", 1))
        if folded <= 1:
            continue
        if any(v == -1 for k, v in out.items() if re.match(rf"^{kind}_\w+_parallelism$", k)):
            continue  # an axis of -1 absorbs the stage axis's devices
        data = f"{kind}_data_parallelism"
        out[data] = int(out.get(data, 1)) * folded
    out["scan_layers"] = True
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """A pipelined decoder's layer placement, as its release derived it from the config."""

    stages: int  # S
    repeats: int  # R
    per_stage: int  # L
    pipelined: int  # P = R*S*L
    layers: int  # N (the MoE layers for DeepSeek: the stack the pipeline takes from)
    scan_axis: int  # param_scan_axis of the scanned stacks
    moe_first: bool = False  # DeepSeek: the layers outside the pipeline run before it

    def __post_init__(self) -> None:
        if self.stages * self.repeats * self.per_stage != self.pipelined:
            raise WeightMapError(
                "maxtext pipeline layout",
                [f"R*S*L = {self.repeats}*{self.stages}*{self.per_stage} != P {self.pipelined}"],
            )

    @property
    def outside(self) -> tuple[str, ...]:
        """The path of the stack outside the pipeline, in the pipelined decoder."""
        return ("params", "decoder", "moe_layers" if self.moe_first else "layers_outside_pipeline")

    @property
    def reference(self) -> tuple[str, ...]:
        """The path of the same layers' stack in the reference decoder."""
        return ("params", "decoder", "moe_layers" if self.moe_first else "layers")

    @property
    def offset(self) -> int:
        """The reference index of the pipeline's first layer."""
        return self.layers - self.pipelined if self.moe_first else 0

    def layer(self, repeat: int, stage: int, slot: int) -> int:
        """The reference index of repeat `repeat`'s stage `stage`, slot `slot`."""
        return self.offset + (repeat * self.stages + stage) * self.per_stage + slot


def _lead(layout: Layout) -> tuple[int, ...]:
    return ((layout.repeats,) if layout.repeats > 1 else ()) + (layout.stages,)


def _slot(rest: tuple[str, ...], per_stage: int) -> tuple[int, tuple[str, ...]] | None:
    """(slot j, the leaf's path within a layer) of a path under the pipeline's layers."""
    if per_stage == 1:
        return (0, rest) if rest and not rest[0].startswith("layers_") else None
    if rest and (m := re.fullmatch(r"layers_(\d+)", rest[0])) and int(m[1]) < per_stage:
        return int(m[1]), rest[1:]
    return None


def to_reference(flat: dict[tuple[str, ...], Any], layout: Layout) -> dict[tuple[str, ...], Any]:
    """The pipelined decoder's weights (flat by path, under `params`) as the reference's."""
    lead, problems = _lead(layout), []
    stacks: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
    out: dict[tuple[str, ...], Any] = {}
    outside_count = layout.layers - layout.pipelined
    for path, array in flat.items():
        array = np.asarray(array)
        if path[: len(PIPELINE)] == PIPELINE:
            slot = _slot(path[len(PIPELINE) :], layout.per_stage)
            if slot is None:
                problems.append(f"{'/'.join(path)}: not a slot of {layout.per_stage} per stage")
            elif array.shape[: len(lead)] != lead:
                problems.append(f"{'/'.join(path)}: shape {array.shape} lacks the axes {lead}")
            else:
                j, rest = slot
                per_stack = stacks.setdefault(rest, {})
                staged = array.reshape(layout.repeats, layout.stages, *array.shape[len(lead) :])
                for r in range(layout.repeats):
                    for s in range(layout.stages):
                        per_stack[layout.layer(r, s, j)] = staged[r, s]
        elif path[: len(layout.outside)] == layout.outside:
            rest = path[len(layout.outside) :]
            if array.ndim <= layout.scan_axis or array.shape[layout.scan_axis] != outside_count:
                problems.append(
                    f"{'/'.join(path)}: shape {array.shape}, not {outside_count} layers at axis "
                    f"{layout.scan_axis}"
                )
                continue
            first = 0 if layout.moe_first else layout.pipelined
            per_stack = stacks.setdefault(rest, {})
            for i in range(outside_count):
                per_stack[first + i] = np.take(array, i, axis=layout.scan_axis)
        else:
            out[path] = array
    for rest, layers in stacks.items():
        if sorted(layers) != list(range(layout.layers)):
            missing = sorted(set(range(layout.layers)) - set(layers))
            problems.append(f"{'/'.join(rest)}: layers {missing} missing of {layout.layers}")
            continue
        stacked = np.stack([layers[i] for i in range(layout.layers)], axis=layout.scan_axis)
        out[(*layout.reference, *rest)] = stacked
    if problems:
        raise WeightMapError("maxtext pipeline -> its reference", sorted(problems))
    return out


def from_reference(
    flat: dict[tuple[str, ...], Any], layout: Layout, pipelined: dict[tuple[str, ...], Any]
) -> dict[tuple[str, ...], Any]:
    """The reference decoder's tree (weights or gradients) back on the paths of the pipelined
    decoder's tree `pipelined`: the inverse of `to_reference`. A leaf of zero elements the
    reference lacks (0.2.3 builds DeepSeek's `dense_layers` with no layer: there is nothing in
    it) comes back as the empty array it is."""
    problems, out = [], {}
    lead = _lead(layout)
    reference = {p: np.asarray(a) for p, a in flat.items()}
    used: set[tuple[str, ...]] = set()

    def stack_of(rest: tuple[str, ...], path: tuple[str, ...]) -> np.ndarray | None:
        key = (*layout.reference, *rest)
        if key not in reference:
            problems.append(f"{'/'.join(path)}: no {'/'.join(key)} in the reference")
            return None
        used.add(key)
        return reference[key]

    for path, like in pipelined.items():
        if path not in reference and not np.size(like):
            out[path] = np.zeros(np.shape(like), np.asarray(like).dtype)
        elif path[: len(PIPELINE)] == PIPELINE:
            slot = _slot(path[len(PIPELINE) :], layout.per_stage)
            stack = None if slot is None else stack_of(slot[1], path)
            if stack is None:
                continue
            layers = [
                np.take(stack, layout.layer(r, s, slot[0]), axis=layout.scan_axis)
                for r in range(layout.repeats)
                for s in range(layout.stages)
            ]
            out[path] = np.stack(layers).reshape(*lead, *layers[0].shape)
        elif path[: len(layout.outside)] == layout.outside:
            stack = stack_of(path[len(layout.outside) :], path)
            if stack is None:
                continue
            first = 0 if layout.moe_first else layout.pipelined
            count = layout.layers - layout.pipelined
            index = np.arange(first, first + count)
            out[path] = np.take(stack, index, axis=layout.scan_axis)
        elif path in reference:
            out[path], _ = reference[path], used.add(path)
        else:
            problems.append(f"{'/'.join(path)}: not in the reference")
    problems += [f"{'/'.join(p)}: of the reference only" for p in reference if p not in used]
    if problems:
        raise WeightMapError("maxtext reference -> its pipeline", sorted(problems))
    return out
