"""Parity of any Linen/NNX module pair: round trip, forward, gradients and sharding, one call.

`compare_modules` is the project's gate (`parity CONFIG`) for a contributor's own pair: the same
converters (`migrate.convert`), leaf comparisons and tolerances (`parity.compare`), resolver
(`migrate.sharding`, Linen's) and `CheckResult` records, on two modules instead of a config.

    >>> with nnx.use_eager_sharding(False):  # the pair of docs/examples/mlp_pair.py
    ...     block = NNXMLP(4, 16, rngs=nnx.Rngs(0))
    >>> results = compare_modules(LinenMLP(16), block, (jnp.ones((8, 4)),))
    >>> [(r.name, r.passed) for r in results]
    [('roundtrip', True), ('forward', True), ('grads', True), ('sharding', True)]

Weights flow both ways: the Linen module's weights are moved into the NNX module's structure
(`linen-init`), and the NNX module's own weights into Linen's (`nnx-init`); each check runs on
both. Forward and gradients use the functional NNX form (`nnx.split`, then `nnx.merge` inside
`jax.jit` and `jax.grad`), so the pair is judged the same way with NNX graph mode on or off.
Neither module nor any input tree is modified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from migrate import convert
from migrate import sharding as sharding_lib
from migrate.config import Rules
from parity import compare, hlo
from parity.checks import (
    CheckResult,
    collective_records,
    compare_runs_parts,
    errored,
    sharding_record,
)

CHECKS = ("roundtrip", "forward", "grads", "sharding")
SOURCES = ("linen", "nnx")  # whose initial weights both sides run on
# Program structure compared by the sharding check: jaxpr primitives counted on each side.
PROGRAM_PRIMITIVES = {
    "remat regions": frozenset({"remat2", "checkpoint", "remat"}),  # jax.checkpoint, nn.remat
    "sharding constraints": frozenset({"sharding_constraint"}),  # with_(logical_)constraint
}
MAX_REPORTED = 10  # failing records listed per check by `format_report`
ROUNDTRIP_NOTE = "weights moved both ways: bit-exact, same dtypes"
SHARDING_NOTE = "names, ranks, specs, placements, compiled shardings, program structure: equal"

Path = tuple[str, ...]
LossFn = Callable[[Any], jax.Array]


def mean_square_loss(outputs: Any) -> jax.Array:
    """The default loss: sum over the floating-point output leaves of `mean(leaf ** 2)`.

    Computed in float32. The mean keeps the scale independent of the batch size; non-float
    leaves (token ids, masks) are skipped.
    """
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree.leaves(outputs):
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
            total = total + jnp.mean(jnp.square(jnp.asarray(leaf, jnp.float32)))
    return total


def _path_str(path: Path) -> str:
    return "/".join(path)


def _to_linen_path(path: Path, renames: Mapping[Path, Path]) -> Path:
    """An NNX path in Linen's naming (the inverse of the `renames` prefix map)."""
    for linen_prefix, nnx_prefix in renames.items():
        if path[: len(nnx_prefix)] == tuple(nnx_prefix):
            return (*linen_prefix, *path[len(nnx_prefix) :])
    return path


def count_primitives(jaxpr: Any, names: frozenset[str]) -> int:
    """Equations whose primitive is in `names`, nested jaxprs (scan, cond, remat) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in names
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    count += count_primitives(inner, names)
    return count


@dataclasses.dataclass(frozen=True)
class _Run:
    """One forward+backward of one side: loss, outputs, and gradients flat by Linen path."""

    loss: jax.Array
    outputs: Any
    grads: dict[str, jax.Array]


class _Pair:
    """The two modules, their weights both ways, and the runs the checks share (computed once)."""

    def __init__(
        self,
        linen_module: nn.Module,
        nnx_module: nnx.Module,
        inputs: tuple[Any, ...],
        linen_variables: Mapping[str, Any] | None,
        renames: Mapping[Path, Path],
        rules: Rules | None,
        mesh: Mesh | None,
        loss_fn: LossFn,
        seed: int,
    ) -> None:
        self.linen_module, self.inputs = linen_module, inputs
        self.renames, self.rules, self.mesh = renames, rules, mesh
        self.loss_fn, self.seed = loss_fn, seed
        self._given_linen_variables = linen_variables
        self.graphdef, self.nnx_params, self.nnx_rest = nnx.split(nnx_module, nnx.Param, ...)
        self._runs: dict[tuple[str, str], _Run] = {}

    def context(self) -> contextlib.AbstractContextManager:
        """The logical axis rules (one context for Linen and NNX) while tracing, when given."""
        return nn.logical_axis_rules(self.rules) if self.rules else contextlib.nullcontext()

    @functools.cached_property
    def linen_variables(self) -> dict[str, Any]:
        """The given Linen variables, or `init`'s (placed by their boxes when a mesh is given)."""
        if self._given_linen_variables is not None:
            return dict(self._given_linen_variables)
        key = jax.random.key(self.seed)
        init = self.linen_module.init
        with self.context():
            if self.mesh is None:
                return dict(jax.jit(init)(key, *self.inputs))
            abstract = jax.eval_shape(init, key, *self.inputs)
            shardings = nn.logical_to_mesh_sharding(
                nn.get_partition_spec(abstract), self.mesh, self.rules
            )
            return dict(jax.jit(init, out_shardings=shardings)(key, *self.inputs))

    def weights(self, framework: str, source: str) -> Any:
        """`framework`'s weights holding `source`'s initial values (moved, not copied)."""
        if framework == source:
            return self.linen_variables if framework == "linen" else self.nnx_params
        if framework == "nnx":
            return convert.linen_to_nnx(self.linen_variables, self.nnx_params, self.renames)
        return convert.nnx_to_linen(
            self.nnx_params, target=self.linen_variables, renames=self.renames
        )

    def args(self, framework: str, source: str) -> tuple[Any, ...]:
        weights = self.weights(framework, source)
        if framework == "linen":
            return (weights, *self.inputs)
        return (weights, self.nnx_rest, *self.inputs)

    @functools.cached_property
    def loss_fns(self) -> dict[str, Callable]:
        """Per framework: `(weights, ..., *inputs) -> (loss, outputs)`, pure."""
        module, graphdef, loss_fn = self.linen_module, self.graphdef, self.loss_fn

        def linen_loss(variables, *inputs):
            outputs = module.apply(variables, *inputs)
            return loss_fn(outputs), outputs

        def nnx_loss(params, rest, *inputs):
            outputs = nnx.merge(graphdef, params, rest)(*inputs)
            return loss_fn(outputs), outputs

        return {"linen": linen_loss, "nnx": nnx_loss}

    @functools.cached_property
    def steps(self) -> dict[str, Callable]:
        """Per framework: jitted `value_and_grad` of the loss with respect to the weights."""
        return {
            framework: jax.jit(jax.value_and_grad(fn, has_aux=True))
            for framework, fn in self.loss_fns.items()
        }

    def run(self, framework: str, source: str) -> _Run:
        if (framework, source) not in self._runs:
            with self.context():
                (loss, outputs), grads = self.steps[framework](*self.args(framework, source))
            self._runs[framework, source] = _Run(loss, outputs, self.flat_grads(framework, grads))
        return self._runs[framework, source]

    def flat_grads(self, framework: str, grads: Any) -> dict[str, jax.Array]:
        """Gradients in Linen's form, flat by Linen path; NNX's mapped through the converter."""
        if framework == "nnx":
            grads = convert.nnx_to_linen(grads, renames=self.renames)
        flat = convert.flatten_dict(nn.meta.unbox(grads["params"]))
        return {_path_str(path): value for path, value in flat.items()}

    def compiled(self, framework: str):
        """The compiled forward+backward program of one side, on its own weights."""
        with self.context():
            return self.steps[framework].lower(*self.args(framework, framework)).compile()

    def own_arrays(self, framework: str) -> dict[Path, Any]:
        """One side's own parameter arrays, flat by Linen path."""
        if framework == "linen":
            return convert.flatten_dict(nn.meta.unbox(self.linen_variables["params"]))
        return {
            _to_linen_path(path, self.renames): variable.get_value()
            for path, variable in convert.nnx_flat_params(self.nnx_params).items()
        }

    def own_names(self, framework: str) -> dict[Path, Any]:
        """One side's logical names per parameter (None: unannotated), flat by Linen path."""
        if framework == "linen":
            return convert.flatten_dict(convert.strip_boxes(self.linen_variables["params"])[1])
        return {
            _to_linen_path(path, self.renames): convert.nnx_names(variable)
            for path, variable in convert.nnx_flat_params(self.nnx_params).items()
        }

    def jaxpr(self, framework: str) -> Any:
        """The traced forward (loss) of one side on its own weights."""
        with self.context():
            return jax.make_jaxpr(self.loss_fns[framework])(*self.args(framework, framework)).jaxpr


# ------------------------------------------------------------------ records


def _with_dtypes(records: list[dict], actual: Any, expected: Any) -> list[dict]:
    """Fail records whose leaves differ in dtype (values can agree across dtypes)."""
    dtypes_a = [str(np.asarray(x).dtype) for x in jax.tree.leaves(actual)]
    dtypes_b = [str(np.asarray(x).dtype) for x in jax.tree.leaves(expected)]
    for record, dtype_a, dtype_b in zip(records, dtypes_a, dtypes_b, strict=True):
        if dtype_a != dtype_b:
            record |= {"passed": False, "dtype": f"NNX {dtype_a} vs Linen {dtype_b}"}
    return records


def _leaf_records(prefix: str, actual: Any, expected: Any, tol: compare.Tolerance) -> list[dict]:
    actual, expected = jax.device_get(actual), jax.device_get(expected)
    return _with_dtypes(compare_runs_parts(prefix, actual, expected, tol), actual, expected)


def _verdict(
    name: str,
    records: list[dict],
    tol: compare.Tolerance,
    problems: Sequence[str] = (),
    note: str | None = None,
) -> CheckResult:
    """Failed when any record fails or any problem is named; `where` is the first failure."""
    failing = [r for r in records if not r["passed"]]
    worst = failing[0] if failing else max(records, key=lambda r: r["max_rel"], default=None)
    return CheckResult(
        name=name,
        passed=not failing and not problems,
        metric="max_rel",
        value=worst["max_rel"] if worst else 0.0,
        tolerance=tol.max_rel,
        where=worst["tensor"] if worst else (problems[0] if problems else "-"),
        details=tuple(records),
        message="; ".join(problems) or note or tol.reason,
    )


# ------------------------------------------------------------------ checks


def _roundtrip(pair: _Pair, tol: compare.Tolerance) -> CheckResult:
    """Linen -> NNX -> Linen and NNX -> Linen -> NNX give back every leaf bit-exactly."""
    del tol  # a round trip moves arrays: always exact
    linen_vars, nnx_params, renames = pair.linen_variables, pair.nnx_params, pair.renames
    there = convert.linen_to_nnx(linen_vars, nnx_params, renames)
    back = convert.nnx_to_linen(there, target=linen_vars, renames=renames)
    records = _leaf_records(
        "linen-init/linen->nnx->linen",
        nn.meta.unbox(back["params"]),
        nn.meta.unbox(linen_vars["params"]),
        compare.EXACT,
    )
    there = convert.nnx_to_linen(nnx_params, target=linen_vars, renames=renames)
    back = convert.linen_to_nnx(there, nnx_params, renames)
    records += _leaf_records(
        "nnx-init/nnx->linen->nnx",
        nnx.to_pure_dict(back),
        nnx.to_pure_dict(nnx_params),
        compare.EXACT,
    )
    records = [r | {"passed": r["passed"] and r["mismatches"] == 0} for r in records]
    return _verdict("roundtrip", records, compare.EXACT, note=ROUNDTRIP_NOTE)


def _forward(pair: _Pair, tol: compare.Tolerance) -> CheckResult:
    """Outputs, NNX against Linen, from Linen's and from NNX's initial weights."""
    records, problems = [], []
    for source in SOURCES:
        linen_run, nnx_run = pair.run("linen", source), pair.run("nnx", source)
        records += _leaf_records(f"{source}-init/outputs", nnx_run.outputs, linen_run.outputs, tol)
        leaves = jax.tree.leaves(jax.device_get(linen_run.outputs))
        if not any(np.any(np.asarray(leaf) != 0) for leaf in leaves):
            problems.append(f"{source}-init: the Linen outputs are all zero (a vacuous pass)")
    return _verdict("forward", records, tol, problems)


def _grads(pair: _Pair, tol: compare.Tolerance) -> CheckResult:
    """Every gradient leaf, NNX (mapped through the converter) against Linen."""
    records, problems = [], []
    for source in SOURCES:
        linen_run, nnx_run = pair.run("linen", source), pair.run("nnx", source)
        records += _leaf_records(f"{source}-init/grads", nnx_run.grads, linen_run.grads, tol)
        squares = (np.sum(np.square(np.asarray(g, np.float64))) for g in linen_run.grads.values())
        norm = math.sqrt(sum(squares, 0.0))
        if not norm > 0:
            problems.append(f"{source}-init: the Linen gradient norm is {norm} (a vacuous pass)")
    return _verdict("grads", records, tol, problems)


def _parameter_records(pair: _Pair) -> list[dict]:
    """Per parameter: names, rank; with rules the resolved spec; with a mesh the placement."""
    arrays = {f: pair.own_arrays(f) for f in SOURCES}
    names = {f: pair.own_names(f) for f in SOURCES}
    records = []
    for path in sorted(set(arrays["linen"]) | set(arrays["nnx"])):
        where = _path_str(path)
        missing = [f for f in SOURCES if path not in arrays[f]]
        if missing:
            side = "Linen" if missing == ["linen"] else "NNX"
            records.append(sharding_record(f"{where}: names", False, f"missing on {side}", ""))
            continue
        linen_names, nnx_names = names["linen"][path], names["nnx"][path]
        records.append(
            sharding_record(f"{where}: names", linen_names == nnx_names, linen_names, nnx_names)
        )
        if linen_names is None or nnx_names is None:
            continue  # unannotated on both sides (passes) or on one (failed above)
        linen_array, nnx_array = arrays["linen"][path], arrays["nnx"][path]
        records.append(
            sharding_record(
                f"{where}: rank",
                len(linen_names) == linen_array.ndim and len(nnx_names) == nnx_array.ndim,
                f"{len(linen_names)} names, ndim {linen_array.ndim}",
                f"{len(nnx_names)} names, ndim {nnx_array.ndim}",
            )
        )
        if pair.rules is None:
            continue
        spec = sharding_lib.logical_to_spec(linen_names, pair.rules)
        nnx_spec = sharding_lib.logical_to_spec(nnx_names, pair.rules)
        records.append(sharding_record(f"{where}: spec", spec == nnx_spec, spec, nnx_spec))
        if pair.mesh is None:
            continue
        expected = NamedSharding(pair.mesh, spec)
        placed = [getattr(a, "sharding", None) for a in (linen_array, nnx_array)]
        records.append(
            sharding_record(
                f"{where}: placed",
                all(_equivalent(expected, s, linen_array.ndim) for s in placed),
                *(_shown(s) for s in placed),
            )
        )
    return records


def _equivalent(a: Any, b: Any, ndim: int) -> bool:
    return a is not None and b is not None and a.is_equivalent_to(b, ndim)


def _shown(s: Any) -> Any:
    return getattr(s, "spec", s)


def _compiled_input_records(pair: _Pair, compiled: dict[str, Any]) -> list[dict]:
    """Each parameter's and input's sharding in the two compiled programs, matched by path."""
    shardings = {}
    for framework in SOURCES:
        labels = {id(a): f"params {_path_str(p)}" for p, a in pair.own_arrays(framework).items()}
        for i, leaf in enumerate(jax.tree.leaves(pair.inputs)):
            labels.setdefault(id(leaf), f"input {i}")
        args = jax.tree.leaves(pair.args(framework, framework))
        in_shardings = jax.tree.leaves(compiled[framework].input_shardings[0])
        shardings[framework] = {
            labels[id(leaf)]: (s, np.ndim(leaf))
            for leaf, s in zip(args, in_shardings, strict=True)
            if id(leaf) in labels
        }
    records = []
    for tensor in sorted(set(shardings["linen"]) | set(shardings["nnx"])):
        a, ndim = shardings["linen"].get(tensor, (None, 0))
        b, _ = shardings["nnx"].get(tensor, (None, 0))
        records.append(
            sharding_record(
                f"compiled input {tensor}", _equivalent(a, b, ndim), _shown(a), _shown(b)
            )
        )
    return records


def _compiled_records(pair: _Pair) -> list[dict]:
    """Each side's own weights on the mesh: the compiled forward+backward's input shardings,
    output and gradient shardings, and collective counts, Linen against NNX."""
    linen_run, nnx_run = pair.run("linen", "linen"), pair.run("nnx", "nnx")
    compiled = {framework: pair.compiled(framework) for framework in SOURCES}
    records = _compiled_input_records(pair, compiled)
    outputs = zip(
        jax.tree.leaves(linen_run.outputs), jax.tree.leaves(nnx_run.outputs), strict=False
    )
    for i, (a, b) in enumerate(outputs):
        records.append(
            sharding_record(
                f"compiled output {i}",
                _equivalent(a.sharding, b.sharding, a.ndim),
                *(_shown(x.sharding) for x in (a, b)),
            )
        )
    for path in sorted(set(linen_run.grads) & set(nnx_run.grads)):
        a, b = linen_run.grads[path], nnx_run.grads[path]
        records.append(
            sharding_record(
                f"compiled grad {path}",
                _equivalent(a.sharding, b.sharding, a.ndim),
                _shown(a.sharding),
                _shown(b.sharding),
            )
        )
    records += collective_records(
        hlo.collective_counts(compiled["linen"].as_text()),
        hlo.collective_counts(compiled["nnx"].as_text()),
    )
    return records


def _program_records(pair: _Pair) -> list[dict]:
    """Remat regions and sharding constraints in the two traced forwards, counted."""
    linen_jaxpr, nnx_jaxpr = pair.jaxpr("linen"), pair.jaxpr("nnx")
    records = []
    for what, primitives in PROGRAM_PRIMITIVES.items():
        linen_count = count_primitives(linen_jaxpr, primitives)
        nnx_count = count_primitives(nnx_jaxpr, primitives)
        records.append(
            sharding_record(f"program: {what}", linen_count == nnx_count, linen_count, nnx_count)
        )
    return records


def _sharding(pair: _Pair, tol: compare.Tolerance) -> CheckResult:
    """Per parameter: Linen box names vs NNX `out_sharding`, one name per dimension, with
    `rules` the resolved PartitionSpec, with a `mesh` the placement of each side's own arrays
    and the compiled programs' shardings and collectives; the programs' remat regions and
    sharding constraints. A side that fails to trace or compile fails one record, after the
    per-parameter records (which need neither)."""
    del tol  # sharding is compared for equality
    records = _parameter_records(pair)
    try:
        if pair.mesh is not None:
            records += _compiled_records(pair)
        records += _program_records(pair)
    except Exception as error:  # a module that does not trace: reported, not raised
        message = f"{type(error).__name__}: {error}"
        records.append(sharding_record("program: trace and compile", False, "-", message))
    return _verdict("sharding", records, compare.EXACT, note=SHARDING_NOTE)


_CHECK_FNS: dict[str, Callable[[_Pair, compare.Tolerance], CheckResult]] = {
    "roundtrip": _roundtrip,
    "forward": _forward,
    "grads": _grads,
    "sharding": _sharding,
}


# ------------------------------------------------------------------ public API


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
      tolerance: for forward and grads (`parity.compare.EXACT`: bit-exact, float32).
      checks: a subset of `CHECKS`, run in the order given.
      seed: the key of the default Linen `init`.

    A check that raises (a `ConversionError` for names, shapes or paths that do not match, an
    error in either module) fails with the error as its message; `compare_modules` itself
    raises only ValueError, for options that do not fit.
    """
    selected = tuple(checks)
    unknown = [c for c in selected if c not in _CHECK_FNS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    if mesh is not None and rules is None:
        raise ValueError("a mesh needs rules: logical names reach mesh axes only through rules")
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    pair = _Pair(
        linen_module,
        nnx_module,
        tuple(inputs),
        linen_variables,
        dict(renames or {}),
        rules,
        mesh,
        loss_fn,
        seed,
    )
    results = []
    for name in selected:
        try:
            results.append(_CHECK_FNS[name](pair, tolerance))
        except Exception as error:  # a failing check, reported
            results.append(errored(name, error))
    return results


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def _describe(record: dict) -> str:
    if "linen" in record:
        return f"Linen {record['linen']} vs NNX {record['nnx']}"
    text = (
        f"max_rel={_fmt(record['max_rel'])} max_abs={_fmt(record['max_abs'])} "
        f"mismatches={record['mismatches']}"
    )
    if record.get("nonfinite"):
        text += f" nonfinite={record['nonfinite']}"
    return text + (f" dtype {record['dtype']}" if "dtype" in record else "")


def format_report(results: Sequence[CheckResult], title: str = "parity") -> str:
    """Plain-text report: one line per check, each note, then the failing records."""
    failed = [r for r in results if not r.passed]
    verdict = f"FAIL ({len(failed)} of {len(results)} checks)" if failed else "PASS"
    rows = [("check", "verdict", "worst", "tolerance", "where")] + [
        (
            r.name,
            "PASS" if r.passed else "FAIL",
            f"{r.metric}={_fmt(r.value)}",
            _fmt(r.tolerance),
            r.where,
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{title}: {verdict}"]
    for row in rows:
        lines.append(
            "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4]
        )
    for r in results:
        if r.message:
            lines.append(f"  {r.name}: {r.message}")
    for r in failed:
        failing = [d for d in r.details if not d.get("passed", True)]
        for record in failing[:MAX_REPORTED]:
            lines.append(f"  {r.name} FAIL {record['tensor']}: {_describe(record)}")
        if len(failing) > MAX_REPORTED:
            lines.append(f"  {r.name}: ... and {len(failing) - MAX_REPORTED} more failing")
    return "\n".join(lines)
