"""The harness's end of a worker: start it with its interpreter, call it with a time bound, and
turn its death, a hang or a broken reply into `WorkerLost` (exit 3) naming the worker.

    worker = Worker(python="/path/to/other/venv/bin/python", pythonpath=[checkout], name="nnx")
    info = worker.start("parity.decoder.remote_twins:make", options, batch)
    reply = worker.call("own_weights")

Every call waits at most `timeout_s` (the first, which builds the side, `start_timeout_s`);
past that the worker is killed. What the worker prints on stderr is kept (its last lines
name a crash) and shown under `--verbose`-like `echo`. A worker never outlives its owner's
failure: `WorkerSet.closed_on_failure` stops every worker started inside the block (its
process ended, its temporary directory removed) when the block raises, whatever the stage.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from migrate.errors import BadInput, WorkerLost
from parity.remote import forked, protocol

REPO = Path(__file__).resolve().parent.parent.parent  # a checkout, or the caller's site-packages
PROJECT_PACKAGES = ("migrate", "parity")  # all a worker imports of this installation


def project_path(directory: Path) -> Path:
    """`directory/packages`, holding links to this installation's own packages and nothing
    else: a worker imports them ahead of its own environment's packages, and no other package
    of the caller's (installed, the folder above `parity/` is the caller's whole
    site-packages: its jax and flax would hide the worker's own)."""
    folder = directory / "packages"
    folder.mkdir(exist_ok=True)
    for name in PROJECT_PACKAGES:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(REPO / name, target_is_directory=True)
    return folder


STDERR_LINES = 200


class WorkerError(Exception):
    """An exception the worker reported: `where` is `model` (the side's own code), `config`
    (a config reader of its factory: `release` names the packages its factory declares,
    `summary` is the refusal as one line) or `worker` (the server), `remote_type` and `detail`
    the worker's exception and traceback."""

    def __init__(self, name: str, error: dict[str, Any]) -> None:
        self.worker = name
        self.where = error.get("where", "worker")
        self.release = str(error.get("release", ""))
        self.summary = str(error.get("summary", ""))
        self.remote_type = str(error.get("type", "Exception"))
        self.remote_module = str(error.get("module", ""))
        self.detail = str(error.get("detail", ""))
        super().__init__(str(error.get("message", "")))


def check_interpreter(python: str) -> str:
    """`python` as an absolute executable path (a relative one read against the caller's
    directory: the worker starts in its own), or BadInput (exit 2) saying what it is instead.
    Links are kept, not resolved: a venv's interpreter is a link that finds its venv by its
    own path."""
    found = shutil.which(python) if os.sep not in python else python
    if found is None or not os.path.exists(found):
        raise BadInput(f"worker interpreter {python!r}: not found")
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise BadInput(f"worker interpreter {python!r}: not an executable file")
    return os.path.abspath(found)


# What a caller is told while a call runs long: `(worker name, what it is doing, seconds so
# far)`, every `WAIT_LINE_S` seconds of one call.
OnWait = Callable[[str, str, float], None]
WAIT_LINE_S = 30.0


class Worker:
    """One worker process serving one side (`parity.remote.worker`)."""

    def __init__(
        self,
        python: str,
        name: str,
        pythonpath: Sequence[str | Path] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
        on_wait: OnWait | None = None,
        wait_line_s: float = WAIT_LINE_S,
        factory_module: str | None = None,
    ) -> None:
        self.python = check_interpreter(python)
        self.name, self.timeout_s, self.start_timeout_s = name, timeout_s, start_timeout_s
        self.on_wait, self.wait_line_s = on_wait, wait_line_s
        self.directory: Path | None = Path(tempfile.mkdtemp(prefix=f"parity-worker-{name}-"))
        try:
            self._launch(pythonpath, env, factory_module)
        except BaseException:  # a failed or interrupted launch leaves nothing behind
            self.close()
            raise

    def _launch(
        self,
        pythonpath: Sequence[str | Path],
        env: dict[str, str] | None,
        factory_module: str | None,
    ) -> None:
        """Start the process (forked from its environment's fork server where the caller asks
        for one and names the factory: `parity.remote.forked`) and wait for its `ready` line."""
        assert self.directory is not None
        own_paths = [str(Path(p).resolve()) for p in pythonpath]
        paths = [*own_paths, str(project_path(self.directory))]
        environment = {**os.environ, **(env or {})}
        environment["PYTHONPATH"] = os.pathsep.join(paths)
        environment.setdefault("JAX_PLATFORMS", "cpu")
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.replies: queue.Queue[str | None] = queue.Queue()
        self.info: dict[str, Any] = {}  # what `start` answered: versions, devices
        self.seconds_in_calls = 0.0
        self.io_seconds = 0.0  # this process writing and reading array files
        self.calls = 0
        process: Any = None
        if factory_module is not None:
            process = forked.spawn(
                self.python, own_paths, environment, factory_module, self.directory, project_path
            )
        try:
            self.process = process or subprocess.Popen(
                [self.python, "-u", "-m", "parity.remote.worker", str(self.directory)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=environment,
                # not the caller's directory: `-m` puts the working directory first on the
                # path, where a checkout would hide the side's own (`--nnx_path`)
                cwd=self.directory,
            )
        except OSError as e:
            raise BadInput(f"worker interpreter {self.python!r}: cannot start it: {e}") from None
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        ready = self._reply(self.start_timeout_s, "starting")
        if ready.get("ready", {}).get("version") != protocol.VERSION:
            raise WorkerLost(f"worker {self.name}: speaks another protocol: {ready}")

    # -------------------------------------------------------------- reading

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip("\n"))

    def _lost(self, why: str) -> WorkerLost:
        self.close()
        tail = [line for line in self.stderr_tail if line.strip()][-12:]
        shown = ("; its last words: " + " | ".join(tail)[-1500:]) if tail else ""
        return WorkerLost(f"worker {self.name} ({self.python}): {why}{shown}")

    def _next_line(self, timeout_s: float, doing: str) -> str | None:
        """The worker's next stdout line (None: it closed stdout), waiting at most
        `timeout_s`; `on_wait` is told every `wait_line_s` seconds meanwhile."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            left = deadline - time.monotonic()
            wait = min(left, self.wait_line_s) if self.on_wait is not None else left
            try:
                return self.replies.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise self._lost(f"no answer within {timeout_s:.0f}s while {doing}") from None
                assert self.on_wait is not None
                self.on_wait(self.name, doing, time.monotonic() - start)

    def _reply(self, timeout_s: float, doing: str) -> dict[str, Any]:
        line = self._next_line(timeout_s, doing)
        if line is None:
            self.process.wait(timeout=30)
            code = self.process.returncode
            how = f"killed by signal {-code}" if code and code < 0 else f"exited with {code}"
            raise self._lost(f"{how} while {doing}")
        try:
            return protocol.decode(line)
        except protocol.ProtocolError as e:
            raise self._lost(str(e)) from None

    # -------------------------------------------------------------- calls

    def versions(self) -> dict[str, str]:
        """What the worker's side reported at its start: the versions of the packages its
        factory declares, then Python's, JAX's and flax's."""
        reported = dict(self.info.get("packages", {}))
        reported.update({k: self.info[k] for k in ("python", "jax", "flax") if k in self.info})
        return reported

    def call(self, op: str, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        """One request, its reply's `ok` part; `WorkerError` for an exception it reported."""
        if self.process.poll() is not None:
            raise self._lost(f"exited with {self.process.returncode} before {op}")
        start = time.perf_counter()
        try:
            assert self.process.stdin is not None
            protocol.send(self.process.stdin, {"op": op, **args})
        except (BrokenPipeError, OSError):
            raise self._lost(f"stopped reading requests ({op})") from None
        doing = f"{op} {args['method']}" if "method" in args else op
        reply = self._reply(self.timeout_s if timeout_s is None else timeout_s, doing)
        self.seconds_in_calls += time.perf_counter() - start
        self.calls += 1
        if reply.get("compiles") and "jax" in sys.modules:  # never the one to start JAX
            with contextlib.suppress(Exception):  # what it cost never costs the reply
                from parity.engine import compiles

                compiles.record(reply["compiles"], self.name)
        if "error" in reply:
            raise WorkerError(self.name, reply["error"])
        return reply.get("ok", {})

    def start(self, factory: str, options: dict[str, Any], batch: Any) -> dict[str, Any]:
        """Build the worker's side: `factory(options, batch)` in the worker's environment."""
        manifest = self.send_tree({"batch": batch})
        try:
            return self.call(
                "start", self.start_timeout_s, factory=factory, options=options, batch=manifest
            )
        except WorkerError as e:  # a config reader refused the config: bad input, not a bug
            if e.where != "config":
                raise
            who = f"{e.release} (the {self.name} side)" if e.release else f"the {self.name} side"
            raise BadInput(f"{who} rejects the config: {e.summary or str(e)}") from None

    def send_tree(self, tree: Any, names: dict | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        manifest = protocol.write_tree(self.directory, protocol.flatten(tree).items(), names)
        self.io_seconds += time.perf_counter() - start
        return manifest

    def receive_tree(self, manifest: dict[str, Any]) -> tuple[dict, dict]:
        start = time.perf_counter()
        found = protocol.read_tree(self.directory, manifest)
        self.io_seconds += time.perf_counter() - start
        return found

    def transfer_seconds(self) -> float:
        """Seconds both processes spent writing and reading array files for this worker."""
        try:
            return self.io_seconds + float(self.call("stats", timeout_s=30)["io_seconds"])
        except Exception:  # a lost worker: what this process measured
            return self.io_seconds

    def close(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            try:
                assert process.stdin is not None
                protocol.send(process.stdin, {"op": "quit"})
                process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                process.kill()
                process.wait(timeout=30)
        directory = getattr(self, "directory", None)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
            self.directory = None  # closed: a second close (at exit, `__del__`) does nothing

    def __del__(self) -> None:
        self.close()


def compilation_cache_variables() -> dict[str, str]:
    """This process's persistent compilation cache as the environment a worker's JAX reads at
    its start: the workers compile through the run's cache (`--compilation_cache_dir`, or the
    run's own temporary one), so a second run reads their programs. None where this process
    keeps no cache (or has not started JAX: importing it here would fix its devices)."""
    jax = sys.modules.get("jax")
    directory = jax.config.jax_compilation_cache_dir if jax is not None else None
    if not directory:
        return {}
    seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    return {  # absolute: the worker runs in a directory of its own
        "JAX_COMPILATION_CACHE_DIR": os.path.abspath(os.path.expanduser(str(directory))),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(seconds),
    }


class WorkerSet(dict):
    """The workers of a pair's sides, by framework: started from their environments, what they
    cost, closed together."""

    @contextlib.contextmanager
    def closed_on_failure(self) -> Iterator[WorkerSet]:
        """Every worker added to the set inside the block is closed (its process stopped, its
        temporary directory removed) and dropped from the set when the block raises, whatever
        raised (a failed start, a lost worker, an interrupt); workers the set held before are
        left to their owner."""
        before = {id(worker) for worker in self.values()}
        try:
            yield self
        except BaseException:
            for framework, worker in list(self.items()):
                if id(worker) not in before:
                    worker.close()
                    del self[framework]
            raise

    def start(
        self,
        framework: str,
        where: Any,
        factory: str,
        options: dict,
        batch: Any,
        variables: dict[str, str] | None = None,
        on_wait: OnWait | None = None,
    ) -> Worker:
        """A worker for `framework` in `where` (an `environments.Environment`), with extra
        environment `variables`, its side built by `factory(options, batch)`; `worker.info` is
        what the side reported (versions). `on_wait` is told while a call runs long."""
        paths = [*([where.path] if where.path else []), *where.extra_paths]
        env = {**compilation_cache_variables(), **(variables or {})}
        with self.closed_on_failure():
            worker = Worker(
                where.python,
                framework,
                paths,
                env=env,
                timeout_s=where.timeout_s,
                on_wait=on_wait,
                factory_module=factory.partition(":")[0],
            )
            self[framework] = worker
            worker.info = worker.start(factory, {**options, "patch": where.patch}, batch)
        return worker

    def call_and_transfer_seconds(self) -> tuple[float, float]:
        """Seconds in calls to the workers (their work included), and of those the seconds
        spent moving arrays between the processes (writing and reading their files)."""
        calls = sum(w.seconds_in_calls for w in self.values())
        return calls, sum(w.transfer_seconds() for w in self.values())

    def describe(self, environments: dict[str, Any]) -> str:
        """Each side's interpreter, the versions its worker reported (the packages its factory
        declares, then Python, JAX and flax), its checkout if any."""
        parts = []
        for side, worker in self.items():
            versions = ", ".join(f"{name} {v}" for name, v in worker.versions().items())
            path = environments[side].path
            parts.append(
                f"{side}: {worker.python} ({versions})" + (f", checkout {path}" if path else "")
            )
        return "; ".join(parts)

    def close(self) -> None:
        for worker in self.values():
            worker.close()
