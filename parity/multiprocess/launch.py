"""The local launcher: `parity CONFIG --num_processes=N` runs N workers on this machine.

Each worker is `python -m parity.cli` with the same arguments plus `--process_id` and a
coordinator on 127.0.0.1 at a free port, in its own process group, with
`XLA_FLAGS=--xla_force_host_platform_device_count=<devices per process>` simulated CPU devices.
Their output is streamed with a `[worker i]` prefix. The launcher exits with the worst status:

- every worker exited 0, 1 or 2: the largest of those;
- a worker ended with an internal error (4): EXIT_INTERNAL at once, naming it; the others are
  stopped (they cannot finish without it);
- a worker died (a signal, or any other status, 3 included): EXIT_WORKER at once, naming it;
  the others are stopped;
- a worker ended normally but others still run GRACE_S later, or the run outlasts
  `timeout_s`: EXIT_WORKER, naming the workers still running and how long each was silent.

Stopping a worker is SIGTERM to its group, then SIGKILL after KILL_AFTER_S; the launcher waits
for every worker before it returns, so none is left behind (workers also get SIGKILL if the
launcher itself dies, via PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from migrate.errors import EXIT_INTERNAL, EXIT_WORKER

GRACE_S = 30.0  # how long the others may run on after one worker ended with 0, 1 or 2
KILL_AFTER_S = 5.0  # SIGTERM -> SIGKILL
NORMAL = (0, 1, 2)
REPO = Path(__file__).resolve().parents[2]  # the checkout: parity/multiprocess/launch.py
_print_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(devices_per_process: int) -> dict[str, str]:
    """The launcher's environment with simulated CPU devices and this package importable."""
    env = os.environ.copy()
    xla = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    count = f"--xla_force_host_platform_device_count={devices_per_process}"
    env["XLA_FLAGS"] = " ".join([*xla.split(), count])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _die_with_parent() -> None:
    """In the child before exec: its own process group, and SIGKILL when the launcher dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclasses.dataclass
class Worker:
    index: int
    process: subprocess.Popen
    last_output: float
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"worker {self.index} (pid {self.process.pid})"


def _pump(worker: Worker, stream: IO[str], sink: IO[str]) -> None:
    for line in stream:
        worker.last_output = time.monotonic()
        with _print_lock:
            sink.write(f"[worker {worker.index}] {line}")
            sink.flush()
    stream.close()


def _start(index: int, command: list[str], env: dict[str, str]) -> Worker:
    process = subprocess.Popen(
        command,
        cwd=os.getcwd(),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    return Worker(index, process, time.monotonic())


def _stop(workers: Sequence[Worker]) -> None:
    """SIGTERM every live worker's group, SIGKILL what is left after KILL_AFTER_S, reap all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [w for w in workers if w.process.poll() is None]
        for w in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.process.pid, sig)
        deadline = time.monotonic() + KILL_AFTER_S
        for w in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.process.wait(max(deadline - time.monotonic(), 0.01))
    for w in workers:
        w.process.wait()


def _describe(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def _log(message: str) -> None:
    with _print_lock:
        print(f"[parity] {message}", file=sys.stderr, flush=True)


def _supervise(workers: list[Worker], timeout_s: float) -> int:
    start = time.monotonic()
    first_end: float | None = None
    while True:
        statuses = [w.process.poll() for w in workers]
        for w, status in zip(workers, statuses, strict=True):
            if status is not None and status not in NORMAL:
                running = [o.name for o, s in zip(workers, statuses, strict=True) if s is None]
                internal = status == EXIT_INTERNAL
                _log(
                    f"error: {w.name} {_describe(status)}"
                    + (" (an internal error)" if internal else "")
                    + "; stopping "
                    + (", ".join(running) or "nothing (all ended)")
                )
                return EXIT_INTERNAL if internal else EXIT_WORKER
        if all(s is not None for s in statuses):
            return max(statuses)
        now = time.monotonic()
        if first_end is None and any(s is not None for s in statuses):
            first_end = now
        overdue = first_end is not None and now - first_end > GRACE_S
        if overdue or now - start > timeout_s:
            running = sorted((w for w in workers if w.process.poll() is None), key=_silence)
            why = (
                f"still running {GRACE_S:.0f}s after another worker ended"
                if overdue
                else f"timed out after {timeout_s:g}s (--timeout_s)"
            )
            silent = ", ".join(f"{w.name}, silent for {now - w.last_output:.0f}s" for w in running)
            _log(f"error: {why}; stopping {silent}")
            return EXIT_WORKER
        time.sleep(0.1)


def _silence(worker: Worker) -> float:
    return worker.last_output  # longest silent first: the likeliest to be stuck


def launch(
    worker_args: Sequence[str], num_processes: int, devices_per_process: int, timeout_s: float
) -> int:
    """Run `parity` as `num_processes` local workers; the worst exit status (EXIT_WORKER when
    one died, hung or the run timed out)."""
    address = f"127.0.0.1:{free_port()}"
    env = worker_env(devices_per_process)
    base = [sys.executable, "-m", "parity.cli", *worker_args, f"--coordinator_address={address}"]
    workers: list[Worker] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for i in range(num_processes):
            workers.append(_start(i, [*base, f"--process_id={i}"], env))
        for w in workers:
            for stream, sink in ((w.process.stdout, sys.stdout), (w.process.stderr, sys.stderr)):
                reader = threading.Thread(target=_pump, args=(w, stream, sink), daemon=True)
                reader.start()
                w.readers.append(reader)
        _log(
            f"launched {num_processes} workers x {devices_per_process} CPU devices, coordinator "
            f"{address}, timeout {timeout_s:g}s: " + ", ".join(w.name for w in workers)
        )
        status = _supervise(workers, timeout_s)
    except KeyboardInterrupt:
        _log("interrupted: stopping " + ", ".join(w.name for w in workers))
        status = 130
    finally:
        _stop(workers)
        for w in workers:
            for reader in w.readers:
                reader.join(timeout=5)
        signal.signal(signal.SIGTERM, previous)
    return status


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
