"""A MaxText release's own exception, told apart from a fault of this project's code.

A worker reports an exception with its traceback (`WorkerError.detail`). Read from the
innermost frame outwards, past the libraries both sides call (jax, flax, optax, ...), the first
frame that is either MaxText's (`.../maxtext/...` of the release's environment) or this
project's (`parity/`, `migrate/`) says whose fault it is: the release's (its code raised, or
called a library in a way that raised) or this harness's (exit 4, as any crash of ours). A
release's fault is a finding: it names the release and side, MaxText's file and line, and the
message's first line; what it means depends on what the other release did with the same config
(`parity.maxtext.release_pair`, `parity.maxtext.tpu_gate`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from parity.engine.result import CheckResult
from parity.maxtext.gate_config import RELEASES
from parity.remote.client import WorkerError
from parity.remote.worker import first_line

# A traceback's frame line: `  File "/path/to/file.py", line 612, in get_pipeline_stage_module`
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)', re.M)
_INSTALLED_RELEASE_FILE = re.compile(r"(?:site|dist)-packages/(?P<relative>maxtext/.+\.py)$")
_PROJECT_FILE = re.compile(r"(?:^|/)(?:parity|migrate)/[^/].*\.py$")  # parity/maxtext/... too
_RELEASE_FILE = re.compile(r"(?:^|/)(?P<relative>maxtext/.+\.py)$")  # a checkout of MaxText


@dataclasses.dataclass(frozen=True)
class ReleaseFault:
    """Where a MaxText release's own code raised in one side's worker."""

    side: str  # the pair's slot: linen (0.2.3) or nnx (0.2.5)
    error_type: str
    file: str  # relative to the release's site-packages: maxtext/layers/decoders.py
    line: int
    function: str
    message: str  # the exception's first line

    @property
    def release(self) -> str:
        return RELEASES[self.side]

    @property
    def place(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"

    def describe(self) -> str:
        return (
            f"maxtext {self.release} (the {self.side} side) raises {self.error_type} in its own "
            f"{self.place}: {self.message}"
        )

    def record(self, doing: str, other: str) -> dict:
        """A report record of the fault: `doing` what, and what the other release did."""
        return {
            "tensor": f"maxtext {self.release} ({self.side}): {doing}",
            "passed": False,
            "max_rel": float("inf"),
            "release": self.release,
            "side": self.side,
            "error": f"{self.error_type}: {self.message}",
            "raised_at": self.place,
            "other_release": other,
        }


def of(error: BaseException, side: str) -> ReleaseFault | None:
    """The release's fault behind `error` (a `WorkerError` of `side`'s worker), or None where
    the exception is not the release's own (this project's code, a lost worker, a library
    called by nothing of MaxText's)."""
    if not isinstance(error, WorkerError) or error.where != "model":
        return None
    frames = list(_FRAME.finditer(error.detail))
    for frame in reversed(frames):  # innermost first
        path = frame["file"].replace("\\", "/")
        m = _INSTALLED_RELEASE_FILE.search(path)
        if m is None and _PROJECT_FILE.search(path):
            return None
        if m := m or _RELEASE_FILE.search(path):
            return ReleaseFault(
                side=side,
                error_type=error.remote_type,
                file=m["relative"],
                line=int(frame["line"]),
                function=frame["function"],
                message=first_line(str(error)),
            )
    return None


def from_exception(error: BaseException) -> ReleaseFault | None:
    """`of` for what a check raises: a `WorkerError` (a worker's own call) or the `SideError` a
    proxied side makes of one (`parity.remote.proxy.RemoteSide.call`: its traceback kept)."""
    from parity.engine.side import SideError

    if isinstance(error, Faults):
        return None
    if isinstance(error, SideError) and error.framework in RELEASES:
        carried = WorkerError(
            error.framework,
            {
                "where": "model",
                "type": type(error.error).__name__,
                "message": str(error.error).split(" (in worker ")[0],
                "detail": getattr(error.error, "detail", "") or error.detail,
            },
        )
        return of(carried, error.framework)
    if isinstance(error, WorkerError) and error.worker in RELEASES:
        return of(error, error.worker)
    return None


class Faults(Exception):
    """The releases' own exceptions in one job both sides ran (`doing`): per side its fault,
    and the sides that completed it."""

    def __init__(self, doing: str, faults: dict[str, ReleaseFault], completed: list[str]) -> None:
        self.doing, self.faults, self.completed = doing, faults, completed
        super().__init__("; ".join(f.describe() for f in faults.values()))

    def other(self, side: str) -> str:
        """What the release beside `side` did with the same config, in words."""
        (other,) = (s for s in RELEASES if s != side)
        if other in self.faults:
            return f"maxtext {RELEASES[other]} raises too: {self.faults[other].describe()}"
        if other in self.completed:
            return f"maxtext {RELEASES[other]} (the {other} side) completes it"
        return f"maxtext {RELEASES[other]} (the {other} side): not known (the job stopped here)"

    def bad_input(self) -> str | None:
        """Where the Linen release (the original) faults: the config is bad input for the
        gate (nothing to hold the port to), in one line; None when only the NNX release does
        (a migration regression: a finding)."""
        if "linen" not in self.faults:
            return None
        both = "both releases refuse" if "nnx" in self.faults else "the Linen release refuses"
        lines = [self.faults[s].describe() for s in RELEASES if s in self.faults]
        if "nnx" not in self.faults:
            lines.append(self.other("linen"))
        return f"{both} the config ({self.doing}): " + "; ".join(lines)

    def result(self, name: str) -> CheckResult:
        """The check `name`'s verdict: failed (the NNX release alone raises: it cannot do what
        the Linen release does), or bad input (the Linen release raises)."""
        records = tuple(f.record(self.doing, self.other(s)) for s, f in self.faults.items())
        bad = self.bad_input()
        message = bad or (
            f"{self.faults['nnx'].describe()}; {self.other('nnx')}: a migration regression "
            f"({self.doing})"
        )
        return CheckResult(
            name=name,
            passed=False,
            metric="max_rel",
            value=float("inf"),
            tolerance=0.0,
            where=records[0]["tensor"],
            details=records,
            message=message,
            status="bad_input" if bad else "failed",
        )


def run_both(
    doing: str, jobs: dict[str, Callable[[], Any]], side_by_side: bool = True
) -> dict[str, Any]:
    """Each side's job (side -> a call to its worker), side by side in threads (else one after
    the other): their results; where a release's own code raises, `Faults` once every job has
    ended (what the other side did is part of the finding); any other exception as it is."""
    outcomes: dict[str, tuple[Any, BaseException | None]] = {}
    if side_by_side:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            running = {side: pool.submit(job) for side, job in jobs.items()}
            concurrent.futures.wait(running.values())
        for side, future in running.items():
            error = future.exception()
            outcomes[side] = (None if error else future.result(), error)
    else:
        for side, job in jobs.items():
            try:
                outcomes[side] = (job(), None)
            except Exception as e:  # classified below, with the other side's outcome
                if from_exception(e) is None:
                    raise
                outcomes[side] = (None, e)
    results, faults = {}, {}
    for side, (result, error) in outcomes.items():
        if error is None:
            results[side] = result
            continue
        fault = from_exception(error)
        if fault is None:
            raise error
        faults[side] = fault
    if faults:
        raise Faults(doing, faults, list(results))
    return results


def guarded(name: str, check: Callable[..., CheckResult]) -> Callable[..., CheckResult]:
    """`check` whose release faults are its verdict (`Faults.result`): one side's fault in a
    call of its own (a proxied side's) stops the check there."""

    def run(pair: Any, *args: Any) -> CheckResult:
        try:
            return check(pair, *args)
        except Faults as e:
            return e.result(name)
        except Exception as e:
            fault = from_exception(e)
            if fault is None:
                raise
            return Faults(f"the {name} check", {fault.side: fault}, []).result(name)

    return run
