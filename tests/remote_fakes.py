"""Worker factories for tests/test_remote.py: sides that misbehave on purpose (hang, die,
raise, print, sleep, get killed at a stage of the run), cheap to build (no model compiles).
Imported by the worker process."""

from __future__ import annotations

import collections
import os
import signal
import time
from typing import Any

import numpy as np


class FakeSide:
    """A Side-like object whose `run` does what `options['run']` says."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.framework = options.get("framework", "nnx")

    def own_weights(self) -> dict:
        return {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}}

    def to_common(self, weights: dict) -> dict:
        return weights

    def from_common(self, variables: dict) -> dict:
        return variables

    def plain(self, tree: Any) -> Any:
        return tree

    def lowered(self, weights: dict) -> Any:
        import jax

        return jax.jit(lambda w: w * 3).lower(weights["params"]["w"])

    def compiled(self, weights: dict) -> Any:
        return self.lowered(weights).compile()

    def program_shardings(self, compiled: Any) -> dict:
        return {}

    def run(self, weights: dict) -> Any:
        behaviour = self.options.get("run", "ok")
        if behaviour == "hang":
            time.sleep(3600)
        if behaviour == "die":
            os._exit(7)
        if behaviour == "raise":
            raise ValueError("the model's own error")
        if behaviour == "sleep":
            time.sleep(float(self.options.get("seconds", 1.0)))
        if behaviour == "print":
            print("chatter on stdout must not break the protocol")
        if behaviour == "compile":  # one program of its own, compiled in this worker
            import jax

            w = np.asarray(jax.jit(lambda w: w * 1)(weights["params"]["w"]))
            weights = {"params": {"w": w}}
        from parity.engine.side import Run

        w = weights["params"]["w"]
        return Run(loss=np.float32(w.sum()), outputs=w * 2, grads={"params": {"w": w}})


# Where `kill_at` kills the worker (SIGKILL, by itself: no reply, no cleanup of its own), by
# the requests it has received after `start`: the first, the second `run` (a check half done),
# the `stats` the harness asks for as the run ends.
KILLED_BY_REQUEST = {
    "first-call": lambda op, seen: seen["any"] == 1,
    "mid-check": lambda op, seen: op == "run" and seen["run"] == 2,
    "exit": lambda op, seen: op == "stats",
}


def _kill_at(stage: str) -> None:
    """SIGKILL this worker at `stage`: at once (`start`), or at the request that stage names."""
    if stage == "start":
        os.kill(os.getpid(), signal.SIGKILL)
    from parity.remote import protocol

    decode, seen = protocol.decode, collections.Counter()

    def counting(line: str) -> dict:
        message = decode(line)
        seen["any"] += 1
        seen[message.get("op")] += 1
        if KILLED_BY_REQUEST[stage](message.get("op"), seen):
            os.kill(os.getpid(), signal.SIGKILL)
        return message

    protocol.decode = counting


def make(options: dict[str, Any], batch: Any) -> tuple[FakeSide, Any]:
    """A `FakeSide`; `kill_at` (an option, or a key of `overrides` as the MaxText pair passes
    its config's keys) names the stage at which the NNX side's worker is killed."""
    if options.get("start") == "raise":
        raise RuntimeError("cannot build the side")
    stage = options.get("kill_at") or options.get("overrides", {}).get("kill_at")
    if stage and options.get("framework", "nnx") == "nnx":
        _kill_at(stage)
    return FakeSide(options), lambda b: b


def bug_rmsnorm_epsilon() -> None:
    """tests/test_injected_bugs.py's RMSNorm epsilon bug, patched in the worker's NNX code."""
    import pytest
    from test_injected_bugs import wrong_rmsnorm_epsilon

    wrong_rmsnorm_epsilon(pytest.MonkeyPatch())
