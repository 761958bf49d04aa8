"""A worker's way to its coordinator, checked before and bounded while JAX joins it. No JAX.

JAX's own failure here is a C++ abort (SIGABRT) once its initialization timeout passes: an
exit status CI cannot read. Instead: a malformed address or process id is bad input (exit 2)
before anything starts; a coordinator that does not answer within `timeout_s` (TCP connect,
retried), or processes that do not all join within it, end the worker with EXIT_WORKER (3) and
one line, from a watchdog thread that exits before JAX's own timeout could fire.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from migrate.errors import EXIT_WORKER, BadInput

MAX_LOCAL_PROCESSES = 32  # workers the local launcher starts at most
RETRY_S = 0.5
JAX_MARGIN_S = 30  # JAX's own initialization timeout comes this much after the watchdog


def check_process_flags(
    cfg: Any, processes: int, process_id: int | None, coordinator_address: str | None
) -> None:
    """`--num_processes`, `--process_id` and `--coordinator_address` against the config's
    mesh and slices, before anything starts; BadInput (exit 2) names the conflict."""
    if cfg.num_devices % processes:
        raise BadInput(
            f"--num_processes={processes} does not divide the mesh's {cfg.num_devices} devices"
        )
    per_process, per_slice = cfg.num_devices // processes, cfg.num_devices // cfg.num_slices
    if processes > 1 and per_slice % per_process and per_process % per_slice:
        raise BadInput(
            f"--num_processes={processes} ({per_process} devices each) and {cfg.num_slices} "
            f"slices of {per_slice} devices (dcn_data_parallelism x dcn_pipeline_parallelism): "
            "a process must hold whole slices, or a slice whole processes (hosts)"
        )
    if processes > 1 and process_id is None and coordinator_address is None:
        if processes > MAX_LOCAL_PROCESSES:
            raise BadInput(
                f"--num_processes={processes}: the local launcher starts at most "
                f"{MAX_LOCAL_PROCESSES} workers"
            )
    elif processes > 1 and (process_id is None or coordinator_address is None):
        raise BadInput("a multi-process worker needs --coordinator_address and --process_id")
    elif processes > 1:
        check_worker_flags(processes, process_id, coordinator_address)


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (`[IPV6]:PORT` too) -> (host, port); anything else is BadInput."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(host) > 253:
        raise BadInput(
            f"--coordinator_address={address!r}: expected HOST:PORT with a port in 1..65535"
        )
    if any(c.isspace() or c in "/@" for c in host):
        raise BadInput(f"--coordinator_address={address!r}: {host!r} is not a host name")
    return host, int(port)


def check_worker_flags(num_processes: int, process_id: int, address: str) -> None:
    """A lone worker's flags, before anything starts."""
    if not 0 <= process_id < num_processes:
        raise BadInput(
            f"--process_id={process_id}: must be in 0..{num_processes - 1} "
            f"(--num_processes={num_processes})"
        )
    parse_address(address)


def wait_reachable(address: str, timeout_s: float) -> None:
    """Return once something accepts TCP connections at `address`; after `timeout_s` of
    refusals, exit with EXIT_WORKER."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(RETRY_S, 0.1)):
                return
        except OSError as e:
            if time.monotonic() + RETRY_S > deadline:
                lost(f"cannot reach the coordinator at {address} within {timeout_s:g}s ({e})")
        time.sleep(RETRY_S)


def lost(message: str) -> None:
    """`parity: error: MESSAGE` and exit EXIT_WORKER now (threads and all)."""
    print(f"parity: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_WORKER)


@contextlib.contextmanager
def deadline(timeout_s: float, what: str) -> Iterator[None]:
    """Exit with EXIT_WORKER if the block runs past `timeout_s` (JAX's blocking calls release
    the GIL, so the watchdog thread runs while they wait)."""
    timer = threading.Timer(timeout_s, lost, args=(f"{what}: no progress in {timeout_s:g}s",))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
