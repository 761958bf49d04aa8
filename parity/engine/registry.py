"""Every check, declared once: its name, its one line, what it needs, and the function each
front end runs it with. Front ends select from this table; none lists checks of its own.

One enum of front ends, one table of checks (chex's variants: `Front` says where a check
runs, `Check.forms` says with what). A form is `"module:function"`, imported when the check
runs: this module imports no JAX, so that a command validates `--checks` and prints `--help`
before JAX starts. Adding a check: its function (`(pair) -> CheckResult`) in the module of
its job, and one `Check` here.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


class Front(enum.Enum):
    """A front end: the kind of pair its checks run on."""

    TWINS = "parity CONFIG: the project's Linen and NNX decoder twins"
    MODULES = "compare_modules: a Linen module and its NNX port"
    MAXTEXT = "parity maxtext CONFIG: MaxText 0.2.3's Linen decoder against 0.2.5's NNX one"
    MAXTEXT_TWIN = "parity maxtext CONFIG --against=twin: MaxText 0.2.5 against the NNX twin"
    MAXTEXT_SLICE = "parity maxtext CONFIG --topology=NAME: each release compiled for a slice"


class Need(enum.Enum):
    """What a check needs beyond a pair."""

    STEPS = "trains: called with the run's steps and a per-step progress callback"
    ABSTRACT = "compiles from shapes: allocates no weights (no memory check before it)"
    IN_PROCESS = "calls the twins' functions in this process: not with sides in workers"
    CALLS = "runs the compared calls: skipped where every call is stochastic without keys"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: `forms` maps each front end that runs it to its function; `default` are the
    front ends that run it without `--checks` (elsewhere: on request); `compares` and
    `passes` say at length what it compares and when it passes."""

    name: str
    help: str
    forms: Mapping[Front, str]
    default: frozenset[Front] = frozenset()
    needs: frozenset[Need] = frozenset()
    # The README's table for `parity CONFIG` (Markdown; `markdown_table` renders it).
    compares: str = ""
    passes: str = ""

    def runs_on(self, front: Front) -> bool:
        return front in self.forms

    def function(self, front: Front) -> Callable[..., Any]:
        """The function `front` runs this check with (imported now)."""
        if front not in self.forms:
            raise KeyError(f"check {self.name!r} does not run on {front.name}")
        module, _, attribute = self.forms[front].partition(":")
        return getattr(importlib.import_module(module), attribute)


def _on(forms: Mapping[str, Iterable[Front]]) -> dict[Front, str]:
    """`{form: front ends}` turned around: each front end's form."""
    return {front: form for form, fronts in forms.items() for front in fronts}


_NUMERIC = "parity.engine.numeric"
_PROGRAMS = "parity.engine.programs"
_DECODER = "parity.decoder.checks"
ENGINE_FRONTS = (Front.TWINS, Front.MODULES, Front.MAXTEXT, Front.MAXTEXT_TWIN)
DECODERS = (Front.TWINS, Front.MAXTEXT, Front.MAXTEXT_TWIN)
MAXTEXT_GATES = (Front.MAXTEXT, Front.MAXTEXT_TWIN)

# The checks in the order they run and are reported where `--checks` does not order them.
REGISTRY: tuple[Check, ...] = (
    Check(
        "roundtrip",
        "Linen -> NNX -> Linen, NNX -> Linen -> NNX and pipeline <-> reference layouts: "
        "bit-exact, same dtypes",
        _on({f"{_NUMERIC}:roundtrip": ENGINE_FRONTS}),
        frozenset(ENGINE_FRONTS),
        compares=(
            "Linen -> NNX -> Linen, NNX -> Linen -> NNX, pipeline -> reference -> pipeline, for"
            " Linen- and NNX-initialised weights"
        ),
        passes=("bit-exact, same dtypes"),
    ),
    Check(
        "init",
        "each twin's own initialisation: names, shapes, dtypes, and each parameter's "
        "distribution within 6 standard errors",
        _on({f"{_NUMERIC}:init": ENGINE_FRONTS}),
        frozenset(DECODERS),
        compares=(
            "Linen's and NNX's own initialisations of the same config, per parameter: logical "
            "names, shape, dtype; distribution (mean, std, kurtosis, fraction beyond 2.5 sigma,"
            " zeros, distinct slices along stacked axes)"
        ),
        passes=(
            "names, shapes, dtypes equal; each statistic within 6 standard errors of its "
            "difference, derived from the element counts "
            "([parity/analysis/initstats.py](parity/analysis/initstats.py))"
        ),
    ),
    Check(
        "forward",
        "logits and loss, NNX against Linen, from either twin's initial weights: bit-exact",
        _on({f"{_NUMERIC}:forward": ENGINE_FRONTS}),
        frozenset(ENGINE_FRONTS),
        frozenset({Need.CALLS}),
        compares=(
            "logits and loss (and, with experts, the load-balancing loss inside it: `aux_loss`,"
            " also recorded by `pipeline`, `bubbles`, `train`), NNX against Linen, from "
            "Linen-initialised and from NNX-initialised weights"
        ),
        passes=("bit-exact, in every dtype and matmul precision"),
    ),
    Check(
        "grads",
        "every gradient leaf and the global gradient norm, NNX against Linen: bit-exact",
        _on({f"{_NUMERIC}:grads": ENGINE_FRONTS}),
        frozenset(ENGINE_FRONTS),
        frozenset({Need.CALLS}),
        compares=(
            "every gradient leaf and the global gradient norm, NNX against Linen, mapped "
            "through the converter"
        ),
        passes=("bit-exact"),
    ),
    Check(
        "sharding",
        "per parameter: logical names, resolved PartitionSpec, placement; the compiled "
        "train steps' input and output shardings",
        _on({f"{_PROGRAMS}:sharding": ENGINE_FRONTS}),
        frozenset(ENGINE_FRONTS),
        frozenset({Need.CALLS}),
        compares=(
            "per parameter: names, rank, resolved PartitionSpec, placement of the initialised "
            "arrays; per input and output array of both compiled train steps, the sharding "
            "against the declared one (parameters and optimizer moments as their logical names "
            "say, counts and metrics replicated); counts of all-gather, reduce-scatter, "
            "all-reduce, collective-permute, all-to-all"
        ),
        passes=("equal"),
    ),
    Check(
        "program",
        "both train steps compared instruction by instruction, before and after XLA's optimisation",
        _on(
            {
                f"{_DECODER}:program": (Front.TWINS,),  # --topology: the TPU programs
                f"{_PROGRAMS}:program": (Front.MODULES, *MAXTEXT_GATES),
            }
        ),
        frozenset({Front.TWINS}),
        frozenset({Need.CALLS}),
        compares=(
            "both twins' train steps, each lowered for its own weights, compared instruction by"
            " instruction before and after XLA's optimisation (names canonical, metadata "
            "dropped); a difference is named by op, shape, dtype, attributes (precision, "
            "sharding) and the source line on each side"
        ),
        passes=("identical"),
    ),
    Check(
        "pipeline",
        "pipelined against the non-pipelined reference, in each twin (with --maxtext: in each "
        "release): loss, logits, every gradient (calibrated float32 tier)",
        _on(
            {
                f"{_DECODER}:pipeline": (Front.TWINS,),
                "parity.maxtext.oracle:pipeline": MAXTEXT_GATES,
            }
        ),
        frozenset(DECODERS),
        frozenset({Need.IN_PROCESS}),
        compares=(
            "pipelined against the non-pipelined reference, within each framework: loss, "
            "logits, every gradient, and the global gradient norm that clipping uses (computed "
            "on device from the sharded gradients)"
        ),
        passes=(
            "calibrated: 64 float32 ulp at scale; 40 bfloat16 ulp at scale with bfloat16 "
            "activations or weights ([docs/configs.md](docs/configs.md))"
        ),
    ),
    Check(
        "bubbles",
        "NaN in every pipeline slot no stage has written yet: no NaN reaches an output "
        "or gradient, results bit-identical",
        _on({f"{_DECODER}:bubbles": (Front.TWINS,)}),
        frozenset({Front.TWINS}),
        frozenset({Need.IN_PROCESS}),
        compares=(
            "both twins with NaN in every pipeline buffer slot no stage has written yet, "
            "against the zero-filled run: logits, loss, every gradient"
        ),
        passes=("bit-identical, no NaN"),
    ),
    Check(
        "train",
        "--steps AdamW steps of the jitted train steps: loss, grad norm, every parameter "
        "and optimizer leaf at every step",
        _on({f"{_NUMERIC}:train": ENGINE_FRONTS}),
        frozenset(DECODERS),
        frozenset({Need.STEPS, Need.CALLS}),
        compares=(
            "`--steps` AdamW steps (global-norm clipping) of the jitted train steps, shardings "
            "pinned and the train state donated (each twin steps its own copy of the weights): "
            "loss, grad norm, every parameter and optimizer-state leaf per step; eval passes "
            "before and after, which must leave the parameters untouched; with "
            "`gradient_accumulation_steps` k > 1, also Linen's first step over k accumulated "
            "batches against one step on all of them at once (loss, grad norm, AdamW's first "
            "moments; "
            "[docs/pipeline.md](docs/pipeline.md#11-gradient-accumulation))"
        ),
        passes=("bit-exact; accumulation against one step: the pipeline's reshaped tier"),
    ),
    Check(
        "layers",
        "drill-down in data-flow order (embedding, every layer's submodules, pipeline "
        "iterations, head): the first divergence",
        _on(
            {
                f"{_NUMERIC}:layers": (Front.TWINS, Front.MODULES, Front.MAXTEXT_TWIN),
                "parity.maxtext.release_pair:layers": (Front.MAXTEXT,),
            }
        ),
        needs=frozenset({Need.IN_PROCESS, Need.CALLS}),
        compares=(
            "drill-down over the whole decoder in data-flow order, each part fed Linen's input "
            "to it: embedding, every submodule output of every layer, final norm, logits head, "
            "loss; and each pipeline iteration's stage outputs; runs by itself when `forward` "
            "or `grads` fails"
        ),
        passes=("bit-exact"),
    ),
    Check(
        "compile",
        "the train steps compiled from abstract inputs (no weights): per-device memory, "
        "FLOPs, collectives per loop body",
        _on(
            {
                f"{_DECODER}:compile_cost": (Front.TWINS,),
                "parity.maxtext.compile_check:compile_check": MAXTEXT_GATES,
                "parity.maxtext.tpu_gate:compile_on_slice": (Front.MAXTEXT_SLICE,),
            }
        ),
        frozenset(MAXTEXT_GATES),
        frozenset({Need.ABSTRACT, Need.IN_PROCESS}),
        compares=(
            "whole train step of both twins lowered and compiled from abstract, sharded inputs "
            "(no weights allocated): per-device argument/output/temp memory, the bytes the "
            "outputs alias (`alias_bytes`: the donated parameters and optimizer state) and the "
            "peak they add up to (`peak_bytes` = arguments + temp + outputs - aliased), FLOPs, "
            "bytes accessed, collectives, compile time (the compiler's, or said plainly to be a"
            " persistent-cache read); every reshard the SPMD partitioner could not express and "
            "replicated instead (its warnings captured during the compile: tensor, both "
            "shardings, bytes; on the terminal only with `--verbose`); collectives per "
            "pipeline-loop body (forward, backward), across and within stages; collectives "
            "across stages outside the loop (the reshards into and out of the pipeline among "
            "them); on a multi-slice mesh, the slice of each stage's devices, the rotation's "
            "hops across slices and the collectives across slices"
        ),
        passes=(
            "NNX <= Linen x 1.01 (`alias_bytes` within 1% both ways); with `--topology` "
            "([docs/tpu.md](docs/tpu.md)) XLA:TPU's programs for that slice, each side within "
            "one device's HBM; collectives equal; no involuntary rematerialisation; loop bodies"
            " at the schedule's minimum across stages (one collective-permute each way; "
            "[docs/performance.md](docs/performance.md)); stages in the slices of the hybrid "
            "layout, hops across slices exactly at the stage-block boundaries"
        ),
    ),
    Check(
        "efficiency",
        "the compiled pipeline's matmul work against the useful work and the schedule's "
        "theory (M*R + d*(S-1)) / (M*R)",
        _on({f"{_DECODER}:efficiency": (Front.TWINS,)}),
        needs=frozenset({Need.ABSTRACT, Need.IN_PROCESS}),
        compares=(
            "the matmul work the compiled pipeline performs (dot FLOPs read off the per-device "
            "HLO of the pipeline the config runs, each loop body times its trip count, times "
            "the devices) against the useful work (every layer once on the full batch) and "
            "`(M*R + d*(S-1)) / (M*R)`; the loop's elementwise work reported beside it"
        ),
        passes=("within 0.1% (measured: exact)"),
    ),
    Check(
        "checkpoint",
        "MaxText 0.2.3's train.py writes a checkpoint; each release restores it and trains "
        "one more step: parameters, optimizer state, loss",
        _on({"parity.maxtext.release_pair:checkpoint": (Front.MAXTEXT,)}),
    ),
    Check(
        "random",
        "stochastic calls (dropout, your own RNG streams) compared in distribution where "
        "their keys are not aligned",
        _on({"parity.engine.randomness:random": (Front.MODULES, Front.TWINS)}),
        frozenset({Front.TWINS}),
        compares=(
            "with dropout on (`dropout_rate` > 0, `enable_dropout`), the decoder's forward run "
            "4 times, each with a new key's per-row keys (the same on both twins: "
            '[docs/pipeline.md](docs/pipeline.md), "Dropout"): logits per draw, and whether '
            "the draws differ from each other alike on both sides; without dropout, nothing"
        ),
        passes="bit-exact per draw; every draw differs from the one before on both sides",
    ),
)
BY_NAME: dict[str, Check] = {check.name: check for check in REGISTRY}


def get(name: str) -> Check:
    return BY_NAME[name]


def names(front: Front) -> tuple[str, ...]:
    """Every check `front` runs, in run order."""
    return tuple(c.name for c in REGISTRY if c.runs_on(front))


def defaults(front: Front) -> tuple[str, ...]:
    """The checks `front` runs when none are selected."""
    return tuple(c.name for c in REGISTRY if front in c.default)


def on_request(front: Front) -> tuple[str, ...]:
    """The checks `front` runs only when they are selected."""
    return tuple(c.name for c in REGISTRY if c.runs_on(front) and front not in c.default)


def needing(need: Need, selected: Iterable[str] | None = None) -> tuple[str, ...]:
    """The checks (of `selected`, default all) that have `need`."""
    chosen = [get(n) for n in selected] if selected is not None else REGISTRY
    return tuple(c.name for c in chosen if need in c.needs)


def help_lines(front: Front) -> list[tuple[str, str]]:
    """(name, one line) of every check `front` runs: the command's `--help`."""
    return [(c.name, c.help) for c in REGISTRY if c.runs_on(front)]


def markdown_table(front: Front) -> str:
    """The README's table of `front`'s checks: what each compares, and when it passes."""
    rows = ["| check | compares | tolerance |", "| --- | --- | --- |"]
    rows += [f"| `{c.name}` | {c.compares} | {c.passes} |" for c in REGISTRY if c.runs_on(front)]
    return "\n".join(rows)
