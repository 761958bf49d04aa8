"""`compare_modules`: the parity gate for any Linen module and its NNX port, in one call.

The second front end of the engine (`parity CONFIG` is the first): the same checks
(`parity.engine`), converters (`migrate.convert`), leaf comparisons and tolerances
(`parity.compare`), resolver (`migrate.sharding`, Linen's), `CheckResult`s and reports
(`parity.report`: table, JSON, JUnit, text), on two modules instead of a config.

    >>> with nnx.use_eager_sharding(False):  # the pair of docs/examples/mlp_pair.py
    ...     block = NNXMLP(4, 16, rngs=nnx.Rngs(0))
    >>> results = compare_modules(LinenMLP(16), block, (jnp.ones((8, 4)),))
    >>> [(r.name, r.passed) for r in results]
    [('roundtrip', True), ('forward', True), ('grads', True), ('sharding', True)]

Weights flow both ways: the Linen module's weights are moved into the NNX module's structure
(`linen-init`), and the NNX module's own weights into Linen's (`nnx-init`); each check runs on
both. Neither module nor any input tree is modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import optax
from flax import nnx
from jax.sharding import Mesh

from migrate.config import Rules
from parity import compare, report
from parity.engine import checks as engine_checks
from parity.engine import programs
from parity.engine.modules import LinenModuleSide, LossFn, NNXModuleSide, mean_square_loss
from parity.engine.pair import Pair
from parity.engine.programs import PROGRAM_PRIMITIVES, count_primitives
from parity.engine.result import CheckResult, errored

CHECKS = ("roundtrip", "forward", "grads", "sharding")  # the default set
# Every check a module pair can run (`checks=`), in the order they are given.
AVAILABLE = {
    "roundtrip": engine_checks.roundtrip,
    "init": engine_checks.init,
    "forward": engine_checks.forward,
    "grads": engine_checks.grads,
    "sharding": programs.sharding,
    "program": programs.program,
    "train": engine_checks.train,
    "layers": engine_checks.layers,
}
MAX_REPORTED = report.MAX_LISTED  # failing records listed per check by `format_report`
ROUNDTRIP_NOTE = "weights moved both ways: bit-exact, same dtypes"
TRAIN_STEPS = 3  # optimizer steps of the `train` check

Path = tuple[str, ...]


class ModulePair(Pair):
    """A contributor's Linen module and NNX port, on the same inputs."""

    roundtrip_note = ROUNDTRIP_NOTE
    program_name = "forward+backward"

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

    def batch(self, step: int = 0, split: str = "train") -> Any:
        del step, split
        return self.linen.inputs


def compare_modules(
    linen_module: nn.Module,
    nnx_module: nnx.Module,
    inputs: Any,
    *,
    linen_variables: Mapping[str, Any] | None = None,
    renames: Mapping[Path, Path] | None = None,
    rules: Rules | None = None,
    mesh: Mesh | None = None,
    loss_fn: LossFn = mean_square_loss,
    tolerance: compare.Tolerance = compare.EXACT,
    checks: Iterable[str] = CHECKS,
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
) -> list[CheckResult]:
    """Run the parity checks on a Linen module and its NNX port; one `CheckResult` per check.

    Args:
      linen_module: the Linen module, unbound.
      nnx_module: the NNX module, constructed (its own weights are the `nnx-init` source).
      inputs: example positional inputs, a tuple (a single array is taken as `(array,)`).
      linen_variables: Linen variables to start from; default `linen_module.init(key(seed),
        *inputs)`, jitted, placed on `mesh` by the boxes' logical names when a mesh is given.
      renames: Linen path prefix -> NNX path prefix, for parameters named differently, e.g.
        `{('Dense_0',): ('up',)}`; serves both directions.
      rules: logical axis rules (priority order). Enables the resolved-spec comparison and is
        entered as `nn.logical_axis_rules` (one context for both frameworks) while tracing.
      mesh: enables the placement and compiled-program comparisons; needs `rules`.
      loss_fn: `outputs -> scalar` for the gradients; default `mean_square_loss`.
      tolerance: for forward, grads, train and layers (`parity.compare.EXACT`: bit-exact).
      checks: names from `AVAILABLE`, run in the order given (default `CHECKS`).
      seed: the key of the default Linen `init`.
      optimizer: the `train` check's optax optimizer (default SGD, learning rate 0.1).

    A check that raises (a `ConversionError` for names, shapes or paths that do not match, an
    error in either module) fails with the error as its message; `compare_modules` itself
    raises only ValueError, for options that do not fit.
    """
    selected = tuple(checks)
    unknown = [c for c in selected if c not in AVAILABLE]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(AVAILABLE)}")
    if mesh is not None and rules is None:
        raise ValueError("a mesh needs rules: logical names reach mesh axes only through rules")
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    common = {
        "inputs": tuple(inputs),
        "loss_fn": loss_fn,
        "rules": rules,
        "mesh": mesh,
        "optimizer": optimizer or optax.sgd(0.1),
    }
    pair = ModulePair(
        LinenModuleSide(linen_module, linen_variables, seed, **common),
        NNXModuleSide(nnx_module, renames or {}, **common),
        tolerance,
        rules,
        mesh,
    )
    results = []
    for name in selected:
        try:
            check = AVAILABLE[name]
            result = check(pair, TRAIN_STEPS) if name == "train" else check(pair)
        except Exception as error:  # a failing check, reported
            result = errored(name, error)
        results.append(result)
    return results


def format_report(results: Sequence[CheckResult], title: str = "parity") -> str:
    """Plain-text report: one line per check, each note, then the failing records
    (`parity.report.text_report`, the report every front end shares)."""
    return report.text_report(results, title)


__all__ = [
    "AVAILABLE",
    "CHECKS",
    "MAX_REPORTED",
    "PROGRAM_PRIMITIVES",
    "compare_modules",
    "count_primitives",
    "format_report",
    "mean_square_loss",
]
