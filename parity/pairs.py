"""`compare_modules`: the parity gate for any Linen module and its NNX port, in one call.

The second front end of the engine (`parity CONFIG` is the first): the same checks
(`parity.engine`), converters (`migrate.checkpoints.convert`), leaf comparisons and tolerances
(`parity.analysis.compare`), resolver (`migrate.common.sharding`, Linen's), `CheckResult`s and
reports (`parity.reports.report`: table, JSON, JUnit, text), on two modules instead of a config.

    >>> with nnx.use_eager_sharding(False):  # the pair of docs/examples/mlp_pair.py
    ...     block = NNXMLP(4, 16, rngs=nnx.Rngs(0))
    >>> results = compare_modules(LinenMLP(16), block, (jnp.ones((8, 4)),))
    >>> [(r.name, r.passed) for r in results]
    [('roundtrip', True), ('forward', True), ('grads', True), ('sharding', True)]

Weights flow both ways: the Linen module's weights are moved into the NNX module's structure
(`linen-init`), and the NNX module's own weights into Linen's (`nnx-init`); each check runs on
both. Neither module nor any input tree is modified.

Modules are called as `Call`s say (keyword arguments, arguments for one side only, NNX mode
attributes, randomness), in order, the state each call updates carried into the next; every
collection (`batch_stats`, `cache`, your own through `collections=`) is moved with the weights
and compared after each call, and so is every sown value:

    >>> train = Call((x,), linen={"train": True}, nnx_attributes={"deterministic": False})
    >>> compare_modules(LinenBlock(), NNXBlock(rngs=nnx.Rngs(0)), [train, evaluate])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import optax
from flax import nnx
from jax.sharding import Mesh

from migrate.checkpoints.convert import ConversionError
from migrate.config.contract import Rules
from migrate.errors import EXIT_PASS
from parity.analysis import compare
from parity.engine import registry, run_loop
from parity.engine.pair import Pair, vacuity_problems
from parity.engine.programs import PROGRAM_PRIMITIVES, count_primitives
from parity.engine.registry import Check, Front, Need
from parity.engine.result import EXIT_STATUS, CheckResult, errored, skipped, with_note
from parity.engine.side import Run
from parity.module_pair import diagnosis, order, pair_args
from parity.module_pair.calls import DEFAULT_COLLECTIONS, Call, Randomness, is_float, named
from parity.module_pair.conversion import Conversion
from parity.module_pair.modules import LinenModuleSide, LossFn, NNXModuleSide, mean_square_loss
from parity.module_pair.pair_args import PairArgumentError
from parity.module_pair.renames import nnx_leaves
from parity.module_pair.renames import suggest as suggest_renames
from parity.reports import report

CHECKS = registry.defaults(Front.MODULES)  # the default set
AVAILABLE = registry.names(Front.MODULES)  # every check a module pair can run (`checks=`)
MAX_REPORTED = report.MAX_LISTED  # failing records listed per check by `format_report`
ROUNDTRIP_NOTE = "weights moved both ways: bit-exact, same dtypes"
TRAIN_STEPS = 3  # optimizer steps of the `train` check

Path = tuple[str, ...]


class ModulePair(Pair):
    """A contributor's Linen module and NNX port, called the same way on both sides."""

    front = Front.MODULES
    roundtrip_note = ROUNDTRIP_NOTE
    program_name = "forward+backward"
    # Outputs, state and sown values flow forward: the first that differs is the place (the
    # larger errors downstream are its consequence). Gradients flow both ways: named where
    # the backward pass parts ways (`checks._where_backward_parts`).
    earliest = frozenset({"forward"})

    def __init__(
        self,
        linen: LinenModuleSide,
        nnx_side: NNXModuleSide,
        tolerance: compare.Tolerance,
        rules: Rules | None,
        mesh: Mesh | None,
    ) -> None:
        super().__init__(linen, nnx_side, tolerance)
        self.rules, self.mesh = rules, mesh
        self.calls = linen.calls

    @functools.cached_property
    def _rank(self) -> order.ExecutionRank:
        return order.ExecutionRank(self.linen.execution_order)

    def rank(self, tensor: str) -> int:
        """A record's place in the Linen module's execution order."""
        return self._rank(tensor)

    def module_of(self, tensor: str) -> tuple[str, ...] | None:
        """The Linen module path a record's tensor names (`block_1/attn/key`), or None."""
        return self._rank.module_of(tensor)

    @functools.cached_property
    def _weight_modules(self) -> tuple[frozenset[Path], frozenset[Path]]:
        """Every module path holding a variable, on each side (Linen's naming)."""

        def modules(leaves: Mapping[Path, Any]) -> frozenset[Path]:
            return frozenset(path[1:n] for path in leaves for n in range(2, len(path)))

        return modules(self.linen.leaf_shapes()), modules(self.nnx.leaf_shapes())

    def called_by_linen_only(self, site: str) -> bool:
        module = tuple(site.split("/"))
        linen, nnx = self._weight_modules
        return module in linen and module in nnx

    def batch(self, step: int = 0, split: str = "train") -> Any:
        """Each side trains and evaluates on its own calls (their arguments can differ)."""
        del step, split

    def vacuity(self, run: Run) -> list[str]:
        """A module without parameters (dropout) is compared on its outputs alone."""
        problems = vacuity_problems(run, self.output_name)
        if not run.grads:
            problems = [p for p in problems if not p.startswith("gradient norm")]
        return problems

    def prepared(self, check: Check, function: Callable[..., Any]) -> Callable[..., Any]:
        """`check` skipped where it has nothing to compare on these calls; its verdict notes
        the calls it left out and the inputs' gradients not compared; a converter mismatch
        suggests the renames that fit."""
        return functools.partial(_run_check, check, function)


def compare_modules(
    linen_module: nn.Module,
    nnx_module: nnx.Module,
    inputs: Any,
    *,
    linen_variables: Mapping[str, Any] | None = None,
    renames: Mapping[Path, Path] | None = None,
    collections: Mapping[str, type] | None = None,
    rules: Rules | None = None,
    mesh: Mesh | None = None,
    loss_fn: LossFn = mean_square_loss,
    tolerance: compare.Tolerance | float | tuple[float, float] = compare.EXACT,
    checks: Iterable[str] | None = None,
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
    conversion: Conversion | None = None,
    drill_down: bool = True,
) -> list[CheckResult]:
    """Run the parity checks on a Linen module and its NNX port; one `CheckResult` per check.

    Args:
      linen_module: the Linen module, unbound.
      nnx_module: the NNX module, constructed (its own weights are the `nnx-init` source).
      inputs: how both are called: an array (one positional argument), a tuple of positional
        arguments, a `Call` (keyword arguments, arguments for one side only, NNX mode
        attributes, randomness) or a list of `Call`s, run in order with the state each
        updates carried into the next (train mode, then eval mode).
      linen_variables: Linen variables to start from; default `linen_module.init` on the
        first call, jitted, placed on `mesh` by the boxes' logical names when a mesh is given.
      renames: Linen path prefix -> NNX path prefix, for variables named differently, e.g.
        `{('Dense_0',): ('up',)}`; serves both directions and every collection.
      collections: Linen collection -> NNX Variable type, added to or overriding
        `DEFAULT_COLLECTIONS` (params, batch_stats, cache, intermediates).
      rules: logical axis rules (priority order). Enables the resolved-spec comparison and is
        entered as `nn.logical_axis_rules` (one context for both frameworks) while tracing.
      mesh: enables the placement and compiled-program comparisons; needs `rules`.
      loss_fn: `outputs -> scalar` for the gradients (summed over the calls); default
        `mean_square_loss`.
      tolerance: for forward, grads, train and layers: a `parity.analysis.compare.Tolerance`,
        a number (the largest relative error against each leaf's scale) or a
        `(max_rel, max_abs)` pair (a leaf passes within either); default `EXACT`, bit-exact.
      checks: names from `AVAILABLE`, run in the order given (default `CHECKS`, and `random`
        when a call is stochastic).
      drill_down: when forward or grads fails, run `layers` too (as the `parity` command
        does): its first divergence is named on their verdicts.
      seed: the key of the default Linen `init` and of the calls' random keys.
      optimizer: the `train` check's optax optimizer (default SGD, learning rate 0.1).
      conversion: a `Conversion(to_nnx, to_linen)` of your own where paths alone do not
        carry the weights (fused or reshaped kernels, transposed layouts): functions between
        Linen's variables and the NNX state as plain nested dicts, checked strictly both ways
        (`parity.module_pair.conversion`); `renames` still name state, sown values and captures.

    Every argument is checked before anything is traced: a mistake raises
    `PairArgumentError` (a ValueError and the project's `BadInput`, exit status 2) saying what
    was passed and what is expected. A check that raises fails with the error as its message
    (`status` `failed` for a parity failure: converter mismatches, the NNX module raising
    where Linen runs; `bad_input` when the Linen module itself cannot run the call;
    `errored` for a bug of the harness); `exit_status(results)` gives the exit code.
    """
    pair_args.modules(linen_module, nnx_module)
    calls = named(pair_args.calls(inputs))
    renames = pair_args.renames(renames)
    mapped = pair_args.collections(collections, DEFAULT_COLLECTIONS)
    tolerance = pair_args.tolerance(tolerance)
    stochastic = any(c.randomness is not None for c in calls)
    if checks is None:
        checks = (*CHECKS, "random") if stochastic else CHECKS
    selected = pair_args.checks(checks, AVAILABLE)
    pair_args.options(linen_variables, rules, mesh, loss_fn, seed, optimizer)
    if not isinstance(drill_down, bool):
        raise PairArgumentError(f"drill_down is {drill_down!r}; expected True or False")
    pair_args.unmapped_state(nnx_module, mapped)
    pair_args.boxed_values(nnx_module)
    pair_args.on_mesh(nnx_module, mesh)
    pair_args.fit(linen_module, nnx_module, calls)
    common = {
        "calls": calls,
        "loss_fn": loss_fn,
        "rules": rules,
        "mesh": mesh,
        "optimizer": optimizer or optax.sgd(0.1),
        "seed": seed,
    }
    linen_side = LinenModuleSide(linen_module, linen_variables, mapped, **common)
    pair = ModulePair(
        linen_side,
        NNXModuleSide(
            nnx_module,
            renames,
            mapped,
            pair_args.conversion(conversion),
            linen_target=lambda: linen_side._target,
            **common,
        ),
        tolerance,
        rules,
        mesh,
    )
    _inputs_fit(pair)
    quiet = lambda _line: None  # a library call prints nothing
    results = run_loop.run_checks(pair, selected, TRAIN_STEPS, drill_down, say=quiet)[0]
    return diagnosis.explained(pair, results)


def _inputs_fit(pair: ModulePair) -> None:
    """`pair_args.sized_for_inputs` on both modules' variable shapes (abstract: nothing is
    allocated); a Linen module that does not trace is left to the checks to report."""
    try:
        linen, nnx_shapes = pair.linen.leaf_shapes(), pair.nnx.leaf_shapes()
    except Exception:
        return
    arrays = pair.linen.call_inputs[0].arrays().values()
    pair_args.sized_for_inputs(linen, nnx_shapes, list(arrays))


def _run_check(
    check: Check, function: Callable[..., CheckResult], pair: ModulePair, *args: Any
) -> CheckResult:
    name, runs_calls = check.name, Need.CALLS in check.needs
    if runs_calls and not any(c.compared_exactly for c in pair.calls):
        return skipped(
            name,
            "max_rel",
            0.0,
            "every call is stochastic without aligned keys: see `random` (their outputs, in "
            "distribution; their state and sown values are not compared)",
        )
    if name == "train" and not _has_params(pair):
        return skipped(name, "max_rel", 0.0, "no parameters: the module is compared on outputs")
    if name == "grads" and not (_has_params(pair) or _has_float_inputs(pair)):
        reason = "no parameters and no floating-point inputs: the module is compared on outputs"
        return skipped(name, "max_rel", 0.0, reason)
    try:
        result = function(pair, *args)
    except ConversionError as error:  # paths that differ: suggest the renames that fit
        return _with_renames(errored(name, error), pair)
    errors = {s.input_grads_error for s in pair.sides() if s.input_grads_error}
    if name == "grads" and errors:  # the parameters' gradients were still compared
        note = f"the inputs' gradients not compared ({'; '.join(sorted(errors))})"
        result = dataclasses.replace(result, message=f"{result.message}; {note}")
    return _with_calls_not_run(result, pair) if runs_calls else result


def _with_calls_not_run(result: CheckResult, pair: ModulePair) -> CheckResult:
    """A check that ran the calls says which it left out: a stochastic call whose keys are
    not aligned is compared in distribution only (`random`); nothing it updates or sows is
    compared, and the calls after it start from the state before it."""
    left_out = [c.name for c in pair.calls if not c.compared_exactly]
    if not left_out:
        return result
    note = (
        f"not run: {', '.join(left_out)} (own keys, see `random`; what it updates or sows is "
        "not compared, the calls after it start from the state before it)"
    )
    return with_note(result, note)


def _with_renames(result: CheckResult, pair: ModulePair) -> CheckResult:
    """The renames that carry every path, from both modules' own paths: the given renames
    may be the mistake, so the suggestion replaces them rather than adding to them."""
    try:
        nnx_own = nnx_leaves(pair.nnx.template, pair.nnx.collections)
        suggested = suggest_renames(pair.linen.leaf_shapes(), nnx_own)
    except Exception:  # no suggestion where the shapes cannot be read; the error stands
        return result
    if not suggested or suggested == pair.nnx.renames:
        return result
    return dataclasses.replace(
        result,
        message=f"paths differ; matched by shape and position, try renames={suggested!r}\n"
        + result.message,
    )


def _has_params(pair: ModulePair) -> bool:
    try:
        return bool(pair.linen.to_common(pair.weights("linen", "linen"))["params"])
    except Exception:  # the checks themselves report what does not initialise
        return True


def _has_float_inputs(pair: ModulePair) -> bool:
    """A compared call passes both sides a floating-point array (its gradient is compared)."""
    side = pair.linen
    return any(
        is_float(array)
        for i in side.compared
        for label, array in side.call_inputs[i].arrays().items()
        if label in side.call_inputs[i].shared
    )


def exit_status(results: Sequence[CheckResult]) -> int:
    """The exit code of a comparison: 0 all passed, 1 a parity failure, 2 bad input, 4 a
    harness error (the largest wins, as for the `parity` command)."""
    return max((EXIT_STATUS[r.status] for r in results), default=EXIT_PASS)


def format_report(
    results: Sequence[CheckResult], title: str = "parity", verbose: bool = False
) -> str:
    """Plain-text report: one line per check, the failing records, then the notes
    (`parity.reports.report.text_report`, the report every front end shares); `verbose` adds each
    error's whole text (tracebacks of module errors)."""
    return report.text_report(results, title, verbose)


__all__ = [
    "AVAILABLE",
    "CHECKS",
    "DEFAULT_COLLECTIONS",
    "MAX_REPORTED",
    "PROGRAM_PRIMITIVES",
    "Call",
    "Conversion",
    "PairArgumentError",
    "Randomness",
    "compare_modules",
    "count_primitives",
    "exit_status",
    "format_report",
    "mean_square_loss",
]
