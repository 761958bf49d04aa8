"""The check loop of a `parity` run: each selected check on a pair, its progress lines, its
errors classified (a lost worker ends the run: exit 3), what each check cost (compilations,
compile, run and compare seconds: `parity.engine.compiles`), and the drill-down after a failed
forward or grads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from migrate import errors
from migrate.runtime import cli_support
from parity.decoder.checks import CHECKS
from parity.engine import compiles
from parity.engine.result import errored
from parity.reports.progress import StepProgress, progress


def run_checks(
    pair: Any,
    selected: Sequence[str],
    steps: int,
    drill_down: bool,
    after: Sequence[tuple[str, Callable[[], Any]]] = (),
) -> tuple[list, list]:
    """Each selected check on `pair`, then each `(name, check)` of `after`, with progress
    lines: (results, what each check cost: `compiles.Cost.as_json()`). `drill_down`: run
    `layers` by itself when forward or grads fails."""
    results, costs = [], []
    table = {**CHECKS, **getattr(pair, "own_checks", {})}  # a pair's own form of a check

    def run_check(name: str, check: Callable[[], Any]) -> None:
        cli_support.raise_if_interrupted()
        progress(f"{name} ...")
        with compiles.measure() as cost:
            try:
                result = check()
            except errors.WorkerLost:
                raise  # exit 3 now: every later call would fail the same way
            except Exception as e:  # failed (parity), bad_input or errored: `errored`
                result = errored(name, e)
        costs.append(cost)
        progress(
            f"{name}: {result.status.upper()} ({cost.wall_seconds:.1f}s, "
            f"{cost.compilations} compilations {cost.compile_seconds:.1f}s)"
        )
        if result.status in ("bad_input", "errored"):
            progress(f"{name}: {result.message}")
        results.append(result)

    for name in selected:
        if name == "train":
            on_step = StepProgress(steps)
            run_check(name, lambda on_step=on_step: table["train"](pair, steps, on_step))
        else:
            run_check(name, lambda name=name: table[name](pair))
    failed = any(r.name in ("forward", "grads") and r.status == "failed" for r in results)
    if drill_down and failed and "layers" not in selected:
        progress("forward or grads failed: drilling down per layer")
        run_check("layers", lambda: table["layers"](pair))
    for name, check in after:
        run_check(name, check)
    return results, [cost.as_json() for cost in costs]
