"""One framework's half of a parity pair: the `Side` protocol the checks are written against.

A check takes two Sides (`parity.engine.pair.Pair`) and never asks which framework a side is:
everything framework-specific (building weights, converting them, calling the module, taking
gradients, capturing intermediates, lowering the program) lives behind these methods. Weights
move between the sides through one common form, Linen's variables (`{'params': tree of
LogicallyPartitioned boxes, other collections...}`), by the strict converters of
`migrate.checkpoints.convert`; every comparison is made in that form, so that the two sides' leaves
line up path by path.

Implementations: `parity.module_pair.modules` (any Linen module and its NNX port) and
`parity.decoder.sides` (the pipelined decoder twins of a config). A new framework adapter is a
new pair of implementations; the checks do not change.
"""

from __future__ import annotations

import abc
import dataclasses
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax

# An array of a program, as `Side.program_shardings` reports it: (sharding, ndim, declared).
ProgramArray = tuple[Any, int, Any]


class SideError(Exception):
    """An exception raised by one side's own model code (not by the harness): the message is
    its first line, `detail` the whole error with its traceback. Raised by the NNX side while
    the Linen side runs, the port parts ways with its original: a parity failure; raised by
    the Linen side, the input does not fit the original: bad input; with a `hint` (a Flax
    error that says the call does not fit the module: `parity.module_pair.hints`), bad input."""

    LABELS: ClassVar[dict[str, str]] = {"linen": "Linen", "nnx": "NNX"}

    def __init__(
        self, framework: str, where: str, error: BaseException, hint: str | None = None
    ) -> None:
        self.framework, self.where, self.error, self.hint = framework, where, error, hint
        lines = str(error).strip().splitlines()
        first = lines[0] if lines else ""
        self.detail = "".join(traceback.format_exception(error)).strip()
        super().__init__(
            f"the {self.LABELS.get(framework, framework)} module raised "
            f"{type(error).__name__} in {where}"
            + (f": {first}" if first else "")
            + (f"; {hint}" if hint else "")
        )


class ByCall(dict):
    """Per-call results (outputs, state, sown values) keyed by call name, flattened in call
    order (a plain dict would sort them): a report names the first call that differs."""


jax.tree_util.register_pytree_with_keys(
    ByCall,
    lambda d: (tuple((jax.tree_util.DictKey(k), v) for k, v in d.items()), tuple(d)),
    lambda keys, children: ByCall(zip(keys, children, strict=True)),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One forward+backward of one side, on the host, in the common form.

    `grads` is keyed like the common form's parameters (unboxed); `grad_norm` the global norm
    computed on device from the (sharded) gradients, as gradient clipping computes it; `state`
    the non-parameter collections the call updated (batch statistics, caches); `sown` the
    intermediates the module sowed, by name; `aux_loss` an auxiliary loss inside `loss` (the
    decoder's MoE load-balancing loss), compared as its own record; `input_grads` the loss's
    gradients with respect to the floating-point inputs both sides get, by input label (a
    module pair's: a parameter-free module, a detached residual)."""

    loss: Any
    outputs: Any
    grads: Any
    grad_norm: Any = None
    state: Any = None
    sown: Any = None
    aux_loss: Any = None
    input_grads: Any = None


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A side's optimizer steps: `step(params, opt_state, batch) -> (params, opt_state,
    metrics)` with metrics `loss` and `grad_norm`, `evaluate(params, batch) -> loss`, both
    compiled; `params` and `opt_state` are where both sides start (the same weights)."""

    params: Any
    opt_state: Any
    step: Any
    evaluate: Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class DrillStage:
    """One part of the model for the drill-down, run on the input it is given:
    `apply(x) -> (output, {capture name: value})`. Both sides feed each stage Linen's output
    of the stage before, so a difference shows in its own stage and nowhere after."""

    name: str
    apply: Callable[[Any], tuple[Any, dict[str, Any]]]
    order: Sequence[str] = ()  # capture names in execution order (others sort last)
    input_from: str | None = None  # the stage whose output feeds this one (default: the last)
    fields: Callable[[str], dict[str, Any]] = lambda name: {}  # extra record fields per capture


class Side(abc.ABC):
    """The Linen or the NNX half of a pair, as the checks use it."""

    framework: str  # "linen" or "nnx": a label in reports, never branched on by a check

    # ------------------------------------------------------------ weights

    @abc.abstractmethod
    def own_weights(self) -> Any:
        """This side's own initialisation, in its native form, placed on the mesh if any."""

    @abc.abstractmethod
    def to_common(self, weights: Any) -> dict[str, Any]:
        """Native weights -> the common form (Linen variables, boxed), arrays moved."""

    @abc.abstractmethod
    def from_common(self, variables: dict[str, Any]) -> Any:
        """The common form -> native weights, checked strictly against this side's model
        (paths, shapes, dtypes, logical names); raises
        `migrate.checkpoints.convert.ConversionError`."""

    @abc.abstractmethod
    def plain(self, tree: Any) -> Any:
        """Any tree holding this side's weights (the weights themselves, an optimizer state
        over them) as plain nested dicts of host arrays, keyed as the common form keys them."""

    # ------------------------------------------------------------ running

    @abc.abstractmethod
    def run(self, weights: Any) -> Run:
        """Forward and backward on the pair's inputs, gradients with respect to the weights."""

    @abc.abstractmethod
    def lowered(self, weights: Any) -> jax.stages.Lowered:
        """The program the sharding and program checks read (the train step, or the
        forward+backward), lowered for these weights."""

    def compiled(self, weights: Any) -> jax.stages.Compiled:
        """`lowered(weights)`, compiled (sides cache it where a check reuses it)."""
        return self.lowered(weights).compile()

    @abc.abstractmethod
    def program_shardings(self, compiled: jax.stages.Compiled) -> dict[str, ProgramArray]:
        """The compiled program's input and output arrays, labelled the same way on both
        sides (`train step input: params/decoder_norm/scale`): label -> (sharding, ndim, the
        sharding this side declares the array pinned to, or None). Arrays with no counterpart
        on the other side (NNX's RNG state) are left out."""

    def jaxpr(self, weights: Any) -> Any:
        """The traced forward, for program-structure counts; None when the side's program is
        compared only as HLO (`program` check)."""
        del weights
        return None

    def trainer(self, weights: Any) -> Trainer | None:
        """Optimizer steps starting from `weights`; None when the side cannot train."""
        return None

    def drill_stages(self, weights: Any) -> list[DrillStage]:
        """The model cut into parts for the drill-down (default: none)."""
        return []

    def opaque(self, capture: str) -> bool:
        """Whether this side cannot see the capture `capture` (inside a layer of the other
        framework, held through `nnx.bridge`): missing here, it is not compared."""
        del capture
        return False

    # ------------------------------------------------------------ randomness

    def stochastic_calls(self) -> dict[int, tuple[str, Any]]:
        """The calls that draw random numbers: index -> (name, `Randomness`) (default: none)."""
        return {}

    def draws(self, weights: Any, index: int) -> Any:
        """Stochastic call `index` run `draws` times from `weights`, the RNG state carried:
        its outputs stacked on a leading draw axis, on the host."""
        raise NotImplementedError(f"{type(self).__name__} has no stochastic calls")


def returned_sharding_mismatches(step: Any, params: Any, opt_state: Any) -> list[dict[str, str]]:
    """Each parameter and optimizer-state array a compiled train `step` returned whose
    sharding is not the one the step takes it with: `{'path', 'returned', 'expected'}`. A
    step whose outputs are not valid inputs of the next cannot be stepped again."""
    from parity.analysis.compare import path_str

    expected = jax.tree.leaves(step.input_shardings[0][:2])
    returned = [
        (f"{part}/{path_str(path)}", array)
        for part, tree in (("params", params), ("opt_state", opt_state))
        for path, array in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    out = []
    for (path, array), want in zip(returned, expected, strict=True):
        have = getattr(array, "sharding", None)
        if have is None or have.is_equivalent_to(want, array.ndim):
            continue
        shown = {"returned": getattr(have, "spec", have), "expected": getattr(want, "spec", want)}
        out.append({"path": path, **{k: str(v) for k, v in shown.items()}})
    return out
