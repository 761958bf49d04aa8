"""What a `parity` run prints while it runs (stderr, `[parity] ...`): one line per stage, and
the train check's steps without flooding a long run. No JAX here."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def progress(message: str) -> None:
    print(f"[parity] {message}", file=sys.stderr, flush=True)


class StepProgress:
    """`on_step` of the train check: prints the first steps, then at most every `every_s`
    seconds, the last step, and every diverged step."""

    def __init__(
        self,
        steps: int,
        first: int = 3,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = progress,
    ) -> None:
        self.steps, self.first, self.every_s, self.clock = steps, first, every_s, clock
        self.say = say
        self.last_print = clock()

    def __call__(self, step: int, passed: bool) -> None:
        now = self.clock()
        due = step < self.first or step + 1 == self.steps or now - self.last_print >= self.every_s
        if due or not passed:
            self.last_print = now
            self.say(f"train step {step + 1}/{self.steps}: {'ok' if passed else 'DIVERGED'}")


def plan(cfg: Any, selected: Sequence[str], processes: int) -> str:
    """The run's plan, in one line: model, devices (and slices), processes, schedule, checks."""
    return (
        f"{cfg.model_name}: {cfg.num_devices} devices{_slices(cfg)} in "
        f"{processes} process(es), "
        f"S={cfg.num_stages} M={cfg.num_microbatches} R={cfg.num_repeats} "
        f"L={cfg.layers_per_stage}; checks: {', '.join(selected)}"
    )


def _slices(cfg: Any) -> str:
    """The slices a multi-slice mesh spans, as the plan line says them."""
    if cfg.num_slices == 1:
        return ""
    return (
        f" ({cfg.num_slices} slices of {cfg.num_devices // cfg.num_slices}: "
        f"dcn_data_parallelism={cfg.dcn_data_parallelism} x "
        f"dcn_pipeline_parallelism={cfg.dcn_pipeline_parallelism})"
    )


def workers_line(calls_s: float, transfer_s: float) -> str:
    """The cost of running the sides in workers: seconds in calls, and moving arrays."""
    share = transfer_s / calls_s if calls_s > 0 else 0.0
    return (
        f"{calls_s:.1f}s in calls to the workers, {transfer_s:.2f}s of it moving arrays "
        f"between the processes ({share:.1%})"
    )
