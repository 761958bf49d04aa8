"""What a check returns, and the records and verdicts every check builds it from.

A `CheckResult` is data only (`parity.reports.report` renders it); its `status` says which exit
code it gives the run. Records are dicts, one per compared leaf or fact; a check's verdict names the
first failing record in check order, or with a data-flow rank the failing record with the
largest error relative to its scale (the earliest in the data flow among equals).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from migrate import errors
from migrate.checkpoints import convert
from migrate.common.layout import LayoutError
from migrate.errors import EXIT_FAIL, EXIT_INTERNAL, EXIT_PASS, EXIT_USAGE
from parity.analysis import compare
from parity.engine.compiles import compare_timed
from parity.engine.side import SideError
from parity.multiprocess import distributed

# A check's status and the exit status it gives the run (the largest over all checks wins):
# `skipped` a check that does not apply (passes, measured nothing); `failed` is a real parity
# failure; `bad_input` a check that could not run on this input or machine (out of memory, a
# config error found late); `errored` one that crashed (a bug).
EXIT_STATUS = {
    "passed": EXIT_PASS,
    "skipped": EXIT_PASS,
    "failed": EXIT_FAIL,
    "bad_input": EXIT_USAGE,
    "errored": EXIT_INTERNAL,
}
PASSING = frozenset({"passed", "skipped"})  # the statuses of a check that passes
# Exceptions that mean the twins differ (a check that raises one of these failed, it did not
# crash): mismatching paths or names in the converter, layouts, trees of different shapes.
PARITY_ERRORS = (convert.ConversionError, LayoutError, compare.TreeMismatch)

Rank = Callable[[str], Any]  # record tensor -> sort key of its place in the data flow


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """A check's verdict, its worst error against its tolerance, where, and per-leaf details."""

    name: str
    passed: bool
    metric: str
    value: float
    tolerance: float
    where: str
    details: tuple[dict[str, Any], ...] = ()
    message: str = ""
    steps: tuple[dict[str, Any], ...] = ()  # per-step series (train), for the plot
    status: str = ""  # a key of EXIT_STATUS; default: passed or failed, from `passed`

    def __post_init__(self) -> None:
        if not self.status:
            object.__setattr__(self, "status", "passed" if self.passed else "failed")
        if self.status not in EXIT_STATUS or (self.status in PASSING) != self.passed:
            raise ValueError(f"check {self.name}: status {self.status!r}, passed={self.passed}")


def with_note(result: CheckResult, note: str) -> CheckResult:
    """`result` with `note` appended to its message."""
    return dataclasses.replace(result, message=f"{result.message}; {note}".lstrip("; "))


def skipped(name: str, metric: str, tolerance: float, reason: str) -> CheckResult:
    """A check that does not apply to this pair (a config that does not pipeline): status
    `skipped`, which passes (exit 0) and is shown as skipped, never as a measured 0."""
    return CheckResult(name, True, metric, 0.0, tolerance, "-", message=reason, status="skipped")


def whole_lines(text: str, limit: int) -> str:
    """`text` cut to whole lines within `limit` characters, and a last line counting the
    lines left out (never a path cut in the middle, never a wrong count)."""
    lines, kept, size = text.splitlines(), [], 0
    for line in lines:
        if kept and size + len(line) + 1 > limit:
            break
        kept.append(line)
        size += len(line) + 1
    left = len(lines) - len(kept)
    return "\n".join(kept + ([f"  ... and {left} more lines"] if left else []))


def human_bytes(count: float) -> str:
    """A byte count for a check's message: `1.50 GiB`, `12.00 KiB`, `512 B`."""
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


def errored(name: str, error: Exception) -> CheckResult:
    """A check that raised. A `PARITY_ERRORS` exception (converter errors list every path) is a
    failed check; so is a `SideError` of the NNX side (the port raises where its original
    runs), while one of the Linen side is bad input (the call does not fit the original);
    bad input or a resource (out of memory) is `bad_input`; anything else is a crash of the
    harness, `errored`, never reported as a parity failure."""
    text = str(error)[:20_000]
    first_line = text.splitlines()[0] if text else ""
    where = text.splitlines()[1].strip(" -") if len(text.splitlines()) > 1 else first_line
    details: tuple[dict[str, Any], ...] = ()
    if isinstance(error, SideError):
        status = "failed" if error.framework == "nnx" and not error.hint else "bad_input"
        message, where = first_line, f"{error.framework}: {error.where}"
        # The first line says what went wrong; the whole error is there on request.
        details = (
            {
                "tensor": where,
                "passed": False,
                "max_rel": float("inf"),
                "summary": f"{type(error.error).__name__}: {message.split(': ', 1)[-1]}",
                "error": errors.shorten(error.detail, 20_000),
            },
        )
    elif isinstance(error, PARITY_ERRORS):
        status, message = "failed", f"{type(error).__name__}: {whole_lines(text, 4000)}"
    else:
        exit_status, _, message = errors.classify(error)
        status = "bad_input" if exit_status == EXIT_USAGE else "errored"
    return CheckResult(
        name=name,
        passed=False,
        metric="error",
        value=float("inf"),
        tolerance=0.0,
        where=where[:300],
        details=details,
        message=message,
        status=status,
    )


# ------------------------------------------------------------------ records


def numeric_records(
    prefix: str, diffs: Sequence[compare.LeafDiff], tol: compare.Tolerance
) -> list[dict]:
    """One record per compared leaf: its errors, and whether they are within `tol`."""
    return [
        {
            "tensor": f"{prefix}/{d.path}" if d.path else prefix,
            "max_abs": d.max_abs,
            "max_rel": d.max_rel,
            "ulp_at_scale": d.ulp_at_scale,
            "mismatches": d.mismatches,
            "nonfinite": d.nonfinite_actual + d.nonfinite_expected,
            "passed": d.passes(tol),
        }
        for d in diffs
    ]


@compare_timed
def tree_records(
    prefix: str,
    actual: Any,
    expected: Any,
    tol: compare.Tolerance,
    labels: tuple[str, str] | None = ("NNX", "Linen"),
) -> list[dict]:
    """Records for two trees (or arrays) of the same structure (`labels`: the sides, for a
    mismatch's message)."""
    return numeric_records(prefix, compare.compare_trees(actual, expected, labels), tol)


def one_sided_record(tensor: str, note: str) -> dict:
    """A leaf the two sides do not both have, or not in the same shape or dtype: failed."""
    inf = float("inf")
    return {
        "tensor": tensor,
        "max_abs": inf,
        "max_rel": inf,
        "ulp_at_scale": inf,
        "mismatches": -1,
        "nonfinite": 0,
        "passed": False,
        "note": note,
    }


def empty_record(tensor: str, note: str) -> dict:
    """A zero-element leaf on one side only: passed, with the note that says so."""
    return {
        "tensor": tensor,
        "max_abs": 0.0,
        "max_rel": 0.0,
        "ulp_at_scale": 0.0,
        "mismatches": 0,
        "nonfinite": 0,
        "passed": True,
        "note": note,
    }


@compare_timed
def keyed_records(prefix: str, nnx: Any, linen: Any, tol: compare.Tolerance) -> list[dict]:
    """Records for two trees matched leaf by leaf on their paths (NNX against Linen), in
    Linen's order: a leaf on one side only, or of another shape or dtype, is a failed record
    that says which (a zero-element leaf on one side only: a passed one with a note); two
    trees of the same structure and dtypes give exactly `tree_records`'."""
    flat_nnx = {compare.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx)[0]}
    flat_linen = {compare.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(linen)[0]}
    records = []
    for path in [*flat_linen, *(p for p in flat_nnx if p not in flat_linen)]:
        tensor = f"{prefix}/{path}" if path else prefix
        if path not in flat_nnx or path not in flat_linen:
            side = "Linen" if path in flat_linen else "NNX"
            leaf = (flat_linen if path in flat_linen else flat_nnx)[path]
            if compare.empty(leaf):
                records.append(empty_record(tensor, compare.one_sided_empty_note(side)))
            else:
                records.append(one_sided_record(tensor, f"on the {side} side only"))
            continue
        nnx_host, linen_host = (
            np.asarray(distributed.to_host(flat[path])) for flat in (flat_nnx, flat_linen)
        )
        if nnx_host.shape != linen_host.shape:
            note = f"shape: Linen {linen_host.shape} vs NNX {nnx_host.shape}"
            records.append(one_sided_record(tensor, note))
            continue
        if nnx_host.dtype != linen_host.dtype:  # the same values in another dtype still differ
            note = f"dtype: Linen {linen_host.dtype} vs NNX {nnx_host.dtype}"
            records.append(one_sided_record(tensor, note))
            continue
        diff = compare.leaf_diff(path, nnx_host, linen_host)
        records += numeric_records(prefix, [diff], tol)
    return records


def exact_records(prefix: str, actual: Any, expected: Any) -> list[dict]:
    """Records of two trees that must be bit-identical, dtypes included (a round trip)."""
    records = tree_records(prefix, actual, expected, compare.EXACT, ("after", "before"))
    dtypes_a = [str(np.asarray(x).dtype) for x in _host_leaves(actual)]
    dtypes_b = [str(np.asarray(x).dtype) for x in _host_leaves(expected)]
    for record, dtype_a, dtype_b in zip(records, dtypes_a, dtypes_b, strict=True):
        record["passed"] = record["passed"] and record["mismatches"] == 0
        if dtype_a != dtype_b:
            record["passed"] = False
            record["dtype"] = f"{dtype_a} vs {dtype_b}"
    return records


def _host_leaves(tree: Any) -> list[Any]:
    return jax.tree.leaves(distributed.to_host(tree))


def fact_record(tensor: str, passed: bool, linen: Any, nnx: Any) -> dict:
    """One fact of a structural comparison: Linen's value, NNX's, and whether they agree."""
    return {
        "tensor": tensor,
        "passed": bool(passed),
        "linen": str(linen),
        "nnx": str(nnx),
        "max_rel": 0.0 if passed else 1.0,
    }


# ------------------------------------------------------------------ verdicts


# A leaf whose largest magnitude is below this fraction of the largest leaf's is rounding
# noise (the gradient of a key projection's bias, zero in exact arithmetic, comes out as
# 1e-8..1e-7 against gradients of order 1): it is ranked by its error against that floor, so
# that a 2x error in noise never outranks a 0.7x error in a real gradient. sqrt(float32 eps).
NOISE_FLOOR = float(np.sqrt(np.finfo(np.float32).eps))
SOURCE_PREFIX = re.compile(r"^\w+-init/")  # whose initial weights a record ran on


def ranked_errors(records: Sequence[dict]) -> Callable[[dict], float]:
    """A record's error for ranking: its max abs error against its own scale, or against
    `NOISE_FLOOR` times the largest scale among `records` when that is larger (records
    without `max_abs`, or with infinite errors, rank by their `max_rel`); the same place
    from both weight sources ranks by the larger of the two."""

    def scale(r: dict) -> float:
        finite = r.get("max_abs") is not None and 0 < r["max_rel"] < float("inf")
        return r["max_abs"] / r["max_rel"] if finite else 0.0

    floor = NOISE_FLOOR * max((scale(r) for r in records), default=0.0)

    def own_error(r: dict) -> float:
        own = scale(r)
        return r["max_abs"] / max(own, floor) if own > 0 else r["max_rel"]

    # One place, run from both sides' weights (`linen-init/x`, `nnx-init/x`): the largest of
    # its errors, so that the source never decides which place is named.
    by_place: dict[str, float] = {}
    for r in records:
        place = SOURCE_PREFIX.sub("", r["tensor"])
        by_place[place] = max(by_place.get(place, 0.0), own_error(r))
    return lambda r: by_place[SOURCE_PREFIX.sub("", r["tensor"])]


def verdict(
    name: str,
    records: list[dict],
    tol: compare.Tolerance,
    problems: Sequence[str] = (),
    rank: Rank | None = None,
    note: str | None = None,
    earliest: bool = False,
    pick: Callable[[list[dict]], dict] | None = None,
) -> CheckResult:
    """The verdict over numeric `records`. `where` names the first failing record in check
    order (the step order of `train`, the data flow of `layers`) or, given a data-flow `rank`,
    the failing record with the largest error relative to its scale (`ranked_errors`: noise
    leaves against a floor), the earliest in the data flow among equals (with `earliest`:
    the earliest failing record in the data flow, where a value that flows forward first
    parts ways; with `pick`, the failing record it picks); when nothing fails,
    the worst record; a vacuous run (`problems` and no failing record), its first problem."""
    failing = [r for r in records if not r["passed"]]
    if failing and pick is not None:
        worst = pick(failing)
    elif failing and rank is not None and earliest:
        worst = min(failing, key=lambda r: rank(r["tensor"]))  # stable: record order on ties
    elif failing and rank is not None:
        error = ranked_errors(failing)
        worst = min(failing, key=lambda r: (-error(r), rank(r["tensor"])))
    else:
        worst = failing[0] if failing else max(records, key=lambda r: r["max_rel"], default=None)
    where = problems[0] if problems and not failing else (worst["tensor"] if worst else "-")
    # A failed check's note says what was required, never reads as what was found.
    required = f"required: {note or tol.reason}" if failing else note or tol.reason
    return CheckResult(
        name=name,
        passed=not failing and not problems,
        metric="max_rel",
        value=worst["max_rel"] if worst else 0.0,
        tolerance=tol.max_rel,
        where=where,
        details=tuple(records),
        message="; ".join(problems) or required,
    )


def facts_verdict(name: str, records: list[dict], passing_note: str) -> CheckResult:
    """The verdict over structural facts: failed by the first fact that disagrees."""
    failing = [r for r in records if not r["passed"]]
    worst = failing[0] if failing else None
    return CheckResult(
        name=name,
        passed=not failing,
        metric="mismatches",
        value=float(len(failing)),
        tolerance=0.0,
        where=worst["tensor"] if worst else f"{len(records)} facts agree",
        details=tuple(records),
        message=(
            f"linen {worst['linen']} vs nnx {worst['nnx']}"
            + (f" (declared {worst['declared']})" if "declared" in worst else "")
            if worst
            else passing_note
        ),
    )
