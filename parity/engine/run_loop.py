"""The one check loop every front end runs: each selected check's function for the pair's
front end (`registry`), prepared by the pair (`Pair.prepared`), its progress lines, its
errors classified (a lost worker ends the run: exit 3), what each check cost (compilations,
compile, run and compare seconds: `parity.engine.compiles`), and the drill-down after a failed
forward or grads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from migrate import errors
from migrate.runtime import cli_support
from parity.engine import compiles, registry
from parity.engine.registry import Need
from parity.engine.result import CheckResult, errored
from parity.reports.progress import StepProgress, progress

DRILLED_AFTER = ("forward", "grads")  # a failure of these runs `layers` when drill_down


def run_checks(
    pair: Any,
    selected: Sequence[str],
    steps: int = 0,
    drill_down: bool = False,
    after: Sequence[tuple[str, Callable[[], Any]]] = (),
    say: Callable[[str], None] = progress,
) -> tuple[list[CheckResult], list[dict]]:
    """Each selected check on `pair`, then each `(name, check)` of `after`: (results, what
    each check cost: `compiles.Cost.as_json()`). A check that trains (`Need.STEPS`) takes
    `steps`; `drill_down`: run `layers` by itself when forward or grads fails; `say`: where
    the progress lines go."""
    results: list[CheckResult] = []
    costs = []

    def run_check(name: str, check: Callable[[], CheckResult]) -> None:
        cli_support.raise_if_interrupted()
        say(f"{name} ...")
        with compiles.measure() as cost:
            try:
                result = check()
            except errors.WorkerLost:
                raise  # exit 3 now: every later call would fail the same way
            except Exception as e:  # failed (parity), bad_input or errored: `errored`
                result = errored(name, e)
        costs.append(cost)
        say(
            f"{name}: {result.status.upper()} ({cost.wall_seconds:.1f}s, "
            f"{cost.compilations} compilations {cost.compile_seconds:.1f}s)"
        )
        if result.status in ("bad_input", "errored"):
            say(f"{name}: {result.message}")
        results.append(result)

    for name in selected:
        run_check(name, lambda name=name: call(pair, name, steps, say))
    # A failure with compared values (not weights that do not convert: the drill-down would
    # fail the same way).
    failed = any(r.name in DRILLED_AFTER and r.status == "failed" and r.details for r in results)
    if drill_down and failed and "layers" not in selected:
        say("forward or grads failed: drilling down per layer")
        run_check("layers", lambda: call(pair, "layers", steps, say))
    for name, check in after:
        run_check(name, check)
    return results, [cost.as_json() for cost in costs]


def call(pair: Any, name: str, steps: int = 0, say: Callable[[str], None] = progress) -> Any:
    """One check on `pair`: the registry's function for the pair's front end, as the pair
    prepares it; a check that trains gets `steps` and a per-step progress line."""
    check = registry.get(name)
    function = pair.prepared(check, check.function(pair.front))
    if Need.STEPS in check.needs:
        return function(pair, steps, StepProgress(steps, say=say))
    return function(pair)
