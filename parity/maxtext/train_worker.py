"""The harness's client of a release's MaxText training code in its worker
(`parity.maxtext.train_factory`): started with the release's own environment, and one typed
method per thing that worker does (`train.py`, its restore path, `train_compile.py`)."""

from __future__ import annotations

import os
import re
from typing import Any

from parity.maxtext.gate_config import MaxTextConfig, still_running
from parity.remote.client import Worker, WorkerSet
from parity.remote.environments import Environment

FACTORY = "parity.maxtext.train_factory:make"


def simulated_device_flags(count: int) -> str:
    """This process's XLA_FLAGS with `count` simulated host devices (the workers' mesh)."""
    kept = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    return f"{kept.strip()} --xla_force_host_platform_device_count={count}".strip()


class TrainWorker:
    """One release's training code, in the worker `start` started."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def _call(self, method: str, **kwargs: Any) -> tuple[dict, dict]:
        reply = self.worker.call("call", method=method, kwargs=kwargs)
        arrays, _ = self.worker.receive_tree(reply["tree"])
        return arrays, reply["facts"]

    def train(
        self, directory: str, run_name: str, steps: int, checkpoint_period: int
    ) -> dict[str, Any]:
        """`train.py` until `steps` (resuming from the run's latest checkpoint), a checkpoint
        every `checkpoint_period` steps and at the end: its facts (the metrics it logged)."""
        return self._call(
            "train",
            directory=directory,
            run_name=run_name,
            steps=steps,
            checkpoint_period=checkpoint_period,
        )[1]

    def restore(
        self, directory: str, run_name: str, steps: int, tokens: list | None = None
    ) -> tuple[dict, dict]:
        """The state the release's `train.py` would resume `run_name` from (arrays by the
        release's own paths; with `tokens`, its logits on them too) and its facts."""
        return self._call(
            "restore", directory=directory, run_name=run_name, steps=steps, tokens=tokens
        )

    def train_compile(self, topology: str, num_slices: int) -> dict[str, Any]:
        """The release's `train_compile.py` for a TPU slice: the compiled step's facts, or the
        compiler's refusal."""
        return self._call("train_compile", topology=topology, num_slices=num_slices)[1]


def start(
    workers: WorkerSet,
    config: MaxTextConfig,
    environments: dict[str, Environment],
    variables: dict[str, str],
) -> dict[str, TrainWorker]:
    """Each release's training worker for `config`, started into `workers` (which stops them)."""
    for side in ("linen", "nnx"):
        options = {"framework": side, "overrides": config.keys}
        workers.start(side, environments[side], FACTORY, options, None, variables, still_running)
    return {side: TrainWorker(workers[side]) for side in ("linen", "nnx")}
