"""A pair of Sides and what the checks share about them: weights both ways, runs, programs.

Weights flow both ways: each side's own initialisation is moved into the other side's form
through the common form (`source` = whose initial values), and the numeric checks run on both
sources. Everything a check asks twice (a side's weights for a source, a forward+backward, a
compiled program) is computed once per pair.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from parity.analysis import compare
from parity.engine.registry import Check, Front
from parity.engine.side import Run, Side

SOURCES = ("linen", "nnx")  # whose initial weights both sides run on


class Pair:
    """The Linen and NNX sides of one model, held to `tolerance` against each other.

    Subclasses (the decoder's, a contributor's module pair) add what only they know: the
    batches to train on, data-flow order, extra vacuity rules, extra round trips."""

    front: Front  # the front end whose form of each check runs on this pair (`registry`)
    output_name = "outputs"  # how records name the forward's output ("logits" for decoders)
    # What `forward` compares: the outputs, and the loss where each side computes its own.
    forward_parts: tuple[str, ...] = ("outputs",)
    roundtrip_note: str | None = None  # the round-trip check's note (default: its tolerance's)
    program_name = "program"  # what `Side.lowered` is, in messages ("train step")
    rules = None  # logical axis rules: enable the resolved-spec comparisons
    mesh = None  # enables placements and the compiled programs' shardings and collectives

    @property
    def programs_on_mesh(self) -> bool:
        """The sides' programs run on a mesh: compare their shardings and collectives (a pair
        whose sides each build their own mesh, in workers, says so without one here)."""
        return self.mesh is not None

    # Where a record's tensor sits in the model's data flow (a sort key, earlier lower): a
    # failing check then names its largest error, the earliest among equals; None names the
    # first failure in check order.
    rank: Callable[[str], Any] | None = None
    # The module path a record's tensor names (None: none), in a pair that knows its modules:
    # `grads` then names the place the backward pass first parts ways.
    module_of: Callable[[str], tuple[str, ...] | None] | None = None
    # Checks that name the earliest failing record in the data flow instead (a module pair's
    # forward: its sown values and outputs differ from the first place that differs on).
    earliest: frozenset[str] = frozenset()
    # Whose weights the numeric checks run on (`weights(framework, source)`), each once.
    sources: tuple[str, ...] = SOURCES

    def source_label(self, source: str) -> str:
        """How records name the weights of `source`: `linen-init/logits` ran on the Linen
        side's own initial values."""
        return f"{source}-init"

    def __init__(self, linen: Side, nnx: Side, tolerance: compare.Tolerance) -> None:
        self.linen, self.nnx = linen, nnx
        self.tolerance = tolerance
        self._weights: dict[tuple[str, str], Any] = {}
        self._runs: dict[tuple[str, str], Run] = {}

    def side(self, framework: str) -> Side:
        return self.linen if framework == "linen" else self.nnx

    def sides(self) -> Iterator[Side]:
        yield self.linen
        yield self.nnx

    # ------------------------------------------------------------ weights and runs

    def weights(self, framework: str, source: str) -> Any:
        """`framework`'s native weights holding `source`'s initial values (moved, not copied)."""
        key = (framework, source)
        if key not in self._weights:
            if framework == source:
                self._weights[key] = self.side(framework).own_weights()
            else:
                common = self.side(source).to_common(self.weights(source, source))
                self._weights[key] = self.side(framework).from_common(common)
        return self._weights[key]

    def run(self, framework: str, source: str) -> Run:
        """Forward and backward of one side on `source`'s weights (computed once)."""
        key = (framework, source)
        if key not in self._runs:
            self._runs[key] = self.side(framework).run(self.weights(framework, source))
        return self._runs[key]

    @functools.cache  # noqa: B019 (one pair per model; lives as long as its programs)
    def lowered(self, framework: str) -> jax.stages.Lowered:
        """One side's program lowered for its own weights: the sharding and program checks
        must not depend on the converter working."""
        return self.side(framework).lowered(self.weights(framework, framework))

    @functools.cache  # noqa: B019
    def compiled(self, framework: str) -> jax.stages.Compiled:
        return self.side(framework).compiled(self.weights(framework, framework))

    # ------------------------------------------------------------ what subclasses refine

    def prepared(self, check: Check, function: Callable[..., Any]) -> Callable[..., Any]:
        """`check`'s function as this pair runs it (a pair may skip it, or add to its
        verdict); the run loop calls the result with the pair."""
        del check
        return function

    def vacuity(self, run: Run) -> list[str]:
        """Reasons a run proves nothing: two dead models agree perfectly."""
        return vacuity_problems(run, self.output_name)

    def called_by_linen_only(self, site: str) -> bool:
        """`site` (a submodule Linen's call captured and NNX's did not) holds weights on both
        sides: the port has the layer but never calls it, a difference at that very site."""
        del site
        return False

    def extra_roundtrip_records(self, source: str) -> list[dict]:
        """Round trips only this pair has (the decoder's pipeline <-> reference layout), on
        `source`'s initial weights."""
        del source
        return []

    def batch(self, step: int = 0, split: str = "train") -> Any:
        """The batch of training step `step` (`split` 'eval': the evaluation batch)."""
        raise NotImplementedError(f"{type(self).__name__} has no training batches")


def vacuity_problems(run: Run, output_name: str = "outputs") -> list[str]:
    """Reasons a run proves nothing: a zero gradient norm, outputs that are all zero."""
    problems = []
    squares = (np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(run.grads))
    norm = math.sqrt(sum(squares, 0.0))
    if not norm > 0:
        problems.append(f"gradient norm is {norm}")
    leaves = [np.asarray(x) for x in jax.tree.leaves(run.outputs)]
    if leaves and not any(np.any(leaf != 0) for leaf in leaves):
        problems.append(f"{output_name} are all zero")
    return problems


def lm_vacuity_problems(run: Run, vocab_size: int) -> list[str]:
    """Reasons a language model's run proves nothing: those of `vacuity_problems` (its outputs
    are logits) and a loss sitting at ln(vocab) (uniform predictions)."""
    problems = vacuity_problems(run, "logits")
    if abs(float(run.loss) - math.log(vocab_size)) < 1e-4:
        problems.append(f"loss {float(run.loss):.6f} sits at ln(vocab)={math.log(vocab_size):.6f}")
    return problems
