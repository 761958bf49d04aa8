"""Workers forked from a fork server of their environment (`parity.remote.forkserver`), where
the caller asks for it: `PARITY_WORKER_FORKSERVERS=DIR` names a folder the servers' sockets
live in, shared by every process of a session (the test suite sets it). One server per
interpreter, import path, environment and factory module, started by the first process that
needs it (under a lock) and used by every later one; it ends with the process named by
`PARITY_WORKER_FORKSERVERS_OWNER` (default: the one that started it), or when idle.

`ForkedProcess` is the part of `subprocess.Popen` a `Worker` uses (its pipes, `poll`, `wait`,
`kill`), for a process that is not this one's child: its exit status comes from the server.
Where no server can serve (none configured, a refusal, a failure to start), `spawn` returns
None and the caller starts the worker as a plain process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parity.remote import forkserver

FOLDER_VARIABLE = "PARITY_WORKER_FORKSERVERS"
OWNER_VARIABLE = "PARITY_WORKER_FORKSERVERS_OWNER"
START_TIMEOUT_S = 300.0
SOCKET_PATH_LIMIT = 100  # sun_path holds 108 bytes on Linux


class ForkedProcess:
    """A worker forked by a server: pipes like `Popen(text=True)`'s, its exit status read from
    the server's connection."""

    def __init__(
        self, connection: socket.socket, reader: Any, pid: int, pipes: tuple[Any, Any, Any]
    ) -> None:
        self.pid = pid
        self.stdin, self.stdout, self.stderr = pipes
        self.returncode: int | None = None
        self._connection, self._reader = connection, reader
        self._ended = threading.Event()
        threading.Thread(target=self._await_exit, daemon=True).start()

    def _await_exit(self) -> None:
        try:
            line = self._reader.readline()
            code = json.loads(line)["exit"] if line else None
        except (OSError, ValueError, KeyError):
            code = None
        if code is None:  # the server is gone before the worker: it ends as a lost process
            while forkserver.alive(self.pid):
                time.sleep(0.2)
            code = -signal.SIGKILL
        self.returncode = int(code)
        self._connection.close()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# Variables left out of a server's key: pytest's bookkeeping (the test running, the xdist
# worker), which changes from test to test and which no import reads. The child gets them.
UNKEYED_PREFIXES = ("PYTEST_",)


def server_key(python: str, paths: Sequence[str], env: dict[str, str], factory: str) -> str:
    """What makes two workers forkable from one image: the interpreter, the import path, the
    environment their imports may read (JAX reads its configuration at import; only pytest's
    bookkeeping is left out) and the factory."""
    kept = sorted((k, v) for k, v in env.items() if not k.startswith(UNKEYED_PREFIXES))
    described = json.dumps([python, list(paths), kept, factory])
    return hashlib.sha256(described.encode()).hexdigest()[:20]


def _connect(socket_path: Path) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(socket_path))
    except OSError:
        connection.close()
        return None
    return connection


def _start_server(
    python: str, socket_path: Path, factory: str, env: dict[str, str], folder: Path
) -> str | None:
    """A server at `socket_path`, detached from this process's session; None once it listens,
    else why it does not."""
    owner = os.environ.get(OWNER_VARIABLE) or str(os.getpid())
    log = socket_path.with_suffix(".log")
    with open(log, "ab") as stderr:
        server = subprocess.Popen(
            [python, "-u", "-m", "parity.remote.forkserver", str(socket_path), factory, owner],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=folder,
            start_new_session=True,  # an interrupt of this process's terminal is not its own
        )
    assert server.stdout is not None
    message: dict[str, Any] = {}

    def read_ready() -> None:  # the first JSON line: a library may print before it
        for raw in server.stdout:
            with contextlib.suppress(ValueError):
                found = json.loads(raw)
                if isinstance(found, dict) and ("ready" in found or "refused" in found):
                    message.update(found)
                    return

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if "ready" in message:
        return None
    with contextlib.suppress(OSError):
        server.kill()
    return message.get("refused") or f"no ready line (log: {log})"


def spawn(
    python: str,
    paths: Sequence[str],
    env: dict[str, str],
    factory: str,
    directory: Path,
    project_links: Callable[[Path], Path],
) -> ForkedProcess | None:
    """A worker on `directory`, forked by the server for this interpreter, import path
    (`paths`: the worker's own, before the folder of links to this installation that
    `project_links(folder)` makes for the server), environment and factory module; None where
    no server serves it (the caller starts a plain process)."""
    folder_name = os.environ.get(FOLDER_VARIABLE)
    if not folder_name:
        return None
    try:
        return _spawn(python, paths, env, factory, directory, project_links, Path(folder_name))
    except OSError:  # a folder that cannot be written, a server that cannot start: plain
        return None


def _spawn(
    python: str,
    paths: Sequence[str],
    env: dict[str, str],
    factory: str,
    directory: Path,
    project_links: Callable[[Path], Path],
    folder: Path,
) -> ForkedProcess | None:
    key = server_key(python, paths, {k: v for k, v in env.items() if k != "PYTHONPATH"}, factory)
    socket_path = folder / f"{key}.sock"
    if len(str(socket_path)) > SOCKET_PATH_LIMIT:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    connection = _connect(socket_path)
    if connection is None:
        with open(folder / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            connection = _connect(socket_path)
            if connection is None:
                refused = folder / f"{key}.refused"
                if refused.exists():
                    return None
                socket_path.unlink(missing_ok=True)  # a server that ended without removing it
                server_paths = [*paths, str(project_links(folder))]
                server_env = {**env, "PYTHONPATH": os.pathsep.join(server_paths)}
                why = _start_server(python, socket_path, factory, server_env, folder)
                if why is not None:
                    refused.write_text(why + "\n")
                    return None
                connection = _connect(socket_path)
                if connection is None:
                    return None
    return _request(connection, directory, env)


def _request(
    connection: socket.socket, directory: Path, env: dict[str, str]
) -> ForkedProcess | None:
    """One worker from the server on `connection`, on three new pipes."""
    ends = [os.pipe() for _ in range(3)]  # (read, write) each
    theirs = [ends[0][0], ends[1][1], ends[2][1]]
    ours = [ends[0][1], ends[1][0], ends[2][0]]
    request = {"directory": str(directory), "cwd": str(directory), "env": env}
    reader = connection.makefile("r")  # one reader: the exit line may come with the pid's
    try:
        socket.send_fds(connection, [json.dumps(request).encode()], theirs)
        reply = json.loads(reader.readline() or "{}")
    except (OSError, ValueError):
        reply = {}
    finally:
        for fd in theirs:
            os.close(fd)
    if "pid" not in reply:
        for fd in ours:
            os.close(fd)
        connection.close()
        return None
    # held open for the worker's life, closed with it (as `Popen`'s pipes are)
    pipes = (
        open(ours[0], "w", encoding="utf-8", errors="replace", buffering=1),  # noqa: SIM115
        open(ours[1], encoding="utf-8", errors="replace"),  # noqa: SIM115
        open(ours[2], encoding="utf-8", errors="replace"),  # noqa: SIM115
    )
    return ForkedProcess(connection, reader, int(reply["pid"]), pipes)


def stop_servers(folder: Path) -> None:
    """Remove every server's socket in `folder`: each one exits within a tick of its loop."""
    for socket_path in folder.glob("*.sock"):
        with contextlib.suppress(OSError):
            socket_path.unlink()
