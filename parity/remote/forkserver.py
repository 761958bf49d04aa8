"""A fork server: a process of a worker's environment that has imported what the worker's side
needs and forks each new worker from that image, so that a process starting many workers of
one environment (a test suite, a sweep) pays the imports once (MaxText's: about 8 CPU-s a
worker, transformers and its model configs among them).

    python -m parity.remote.forkserver SOCKET FACTORY_MODULE OWNER_PID

It imports FACTORY_MODULE and the modules it declares in `PRELOAD`, refuses to serve where that
started a thread beyond JAX's own or JAX's backend (a fork would copy a lock some thread holds,
or devices the child must choose itself), then listens on the UNIX socket SOCKET. A request is
one JSON line, `{"directory", "cwd", "env"}`, with three file descriptors (the worker's stdin,
stdout and stderr); the server forks a worker (`parity.remote.worker`) on them and answers
`{"pid": PID}`, then `{"exit": CODE}` on the same connection when it ends (`CODE` negative: the
signal that killed it). It exits when OWNER_PID is gone, when its socket is removed, or after
`IDLE_S` seconds with no worker and no request. It starts no thread of its own (children are
reaped by polling, not by a signal handler): a fork copies only the thread that forks.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import select
import socket
import sys
import traceback
from pathlib import Path

IDLE_S = 120.0
TICK_S = 0.5
REQUEST_BYTES = 1 << 20


def threads() -> int:
    """The threads of this process, native ones included (Linux; elsewhere 0: Python's are
    counted apart)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def backend_started() -> bool:
    """Whether JAX (if imported) has started a backend: its devices are then fixed."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # another JAX's internals: assume the worst
        return True


def preload(factory_module: str) -> None:
    """The factory's module and what it declares in `PRELOAD`; a declared module this
    environment lacks is skipped (a release without it: its worker meets the same)."""
    module = importlib.import_module(factory_module)
    for name in getattr(module, "PRELOAD", ()):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _become_worker(request: dict, fds: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: the request's stdio, directory and environment, then the worker's
    server loop; never returns (the child's atexit handlers run, then it exits). `inherited`:
    the server's sockets, closed here (a child holding another worker's connection would keep
    it open past the server's close)."""
    code = 0
    try:
        for held in inherited:
            held.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        sys.argv = ["parity.remote.worker", request["directory"]]
        from parity.remote import worker

        worker.main(sys.argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _send(connection: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        connection.sendall((json.dumps(message) + "\n").encode())


def serve(socket_path: Path, owner: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(16)
    print(json.dumps({"ready": {"pid": os.getpid()}}), flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the starter stops reading: nothing more there
    os.dup2(devnull, 1)
    os.close(devnull)
    children: dict[int, socket.socket] = {}
    idle = 0.0
    try:
        while True:
            readable, _, _ = select.select([listener], [], [], TICK_S)
            if readable:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, REQUEST_BYTES, 3)
                if len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    _send(connection, {"error": "expected 3 file descriptors"})
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    inherited = [listener, connection, *children.values()]
                    _become_worker(json.loads(message), fds, inherited)
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                _send(connection, {"pid": pid})
            while children:  # reap without a signal handler: one thread, always
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if (connection := children.pop(pid, None)) is not None:
                    _send(connection, {"exit": os.waitstatus_to_exitcode(status)})
                    connection.close()
            idle = 0.0 if (children or readable) else idle + TICK_S
            if idle >= IDLE_S or not socket_path.exists() or not alive(owner):
                return
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            socket_path.unlink()


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        print(
            "usage: python -m parity.remote.forkserver SOCKET FACTORY_MODULE OWNER_PID",
            file=sys.stderr,
        )
        raise SystemExit(2)
    socket_path, factory_module, owner = Path(argv[1]), argv[2], int(argv[3])
    # JAX starts a native thread of its own at import, holding no lock a child needs (JAX
    # itself warns of a fork only once a backend exists): the baseline. Any other thread the
    # imports start is a refusal.
    with contextlib.suppress(ImportError):
        import jax  # noqa: F401
    baseline = threads()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the ready line only
        preload(factory_module)
    import threading

    extra = threads() - baseline
    if extra or threading.active_count() != 1 or backend_started():
        why = f"{extra} more threads" if extra else "a Python thread or JAX's backend started"
        print(json.dumps({"refused": f"{factory_module}: {why} after its imports"}), flush=True)
        raise SystemExit(1)
    serve(socket_path, owner)


if __name__ == "__main__":
    main(sys.argv)
