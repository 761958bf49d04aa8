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

from migrate.errors import EXIT_WORKER, BadInput

RETRY_S = 0.5
JAX_MARGIN_S = 30  # JAX's own initialization timeout comes this much after the watchdog


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
