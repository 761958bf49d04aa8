"""The exit-code contract of the `parity` and `migrate` commands, and what each error maps to.

    0  pass (parity holds; the checkpoint was written)
    1  a real parity or verification failure
    2  bad input: usage, config, checkpoint, paths, and resources (out of memory, disk full)
    3  a lost worker or an unreachable coordinator (multi-process runs, another environment)
    4  an internal error: an exception nobody expected, that is, a bug in the tool
    130, 143  interrupted by SIGINT, SIGTERM (128 + the signal's number)

When several apply, the largest wins (a crash or bad input is never hidden behind a pass or a
failure). No JAX here: the classification runs before, without and after JAX alike.
"""

from __future__ import annotations

import os
import re
import signal

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_WORKER = 3
EXIT_INTERNAL = 4
MESSAGE_CHARS = 2000  # an error message is cut here: a hostile input must not print gigabytes


class BadInput(Exception):
    """Input the tool refuses (config, checkpoint, path, flag): exit 2, its message, no
    traceback. The project's own error classes (ConfigError, CheckpointError, ...) derive it."""


class WorkerLost(Exception):
    """A worker process that died, hung past its time bound or broke the protocol: exit 3. The
    run cannot go on without it (every later call would fail the same way)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so that cleanup (`finally`) runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _chain(error: BaseException):
    """`error`, then its causes and contexts (innermost last), each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        cause = error.__cause__
        if cause is None and not error.__suppress_context__:
            cause = error.__context__
        error = cause


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def out_of_memory(error: BaseException) -> bool:
    """XLA's RESOURCE_EXHAUSTED (an allocation the devices cannot hold), or MemoryError."""
    for e in _chain(error):
        if isinstance(e, MemoryError):
            return True
        # XlaRuntimeError (jax 0.10) / JaxRuntimeError (0.12): matched by name, without JAX.
        if type(e).__name__.endswith("RuntimeError") and "RESOURCE_EXHAUSTED" in str(e)[:500]:
            return True
    return False


_TENSORSTORE_OS_ERROR = re.compile(r"(?P<what>[^:\[]*)\[os_error_code='(?P<code>\d+)'\]")


def os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (disk full, permission denied, a symlink loop), if any; also
    one that TensorStore (under Orbax) reports as text: `...: No space left on device
    [os_error_code='28']`."""
    for e in _chain(error):
        if isinstance(e, OSError):
            return e
        found = _TENSORSTORE_OS_ERROR.search(str(e)[:5000])
        if found:
            code = int(found.group("code"))
            path = re.search(r'Failed writing: "([^"]+)"|at local file "([^"]+)"', str(e))
            where = next((g for g in path.groups() if g), None) if path else None
            return OSError(code, os.strerror(code), where)
    return None


def describe_os_error(error: OSError) -> str:
    """`No space left on device: /path` (the path when the error names one)."""
    what = error.strerror or _first_line(error) or type(error).__name__
    paths = [p for p in (error.filename, error.filename2) if p is not None]
    return what + (": " + " -> ".join(str(p) for p in paths) if paths else "")


def _interruption(error: BaseException) -> Interrupted | None:
    """The `Interrupted` that `error` was raised while handling, if any: a signal can land
    inside a library's own cleanup, which then fails in its turn (measured: orbax/JAX raising
    "Slice ... is not concrete" on the way out of an interrupted save); the signal is the cause."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Interrupted):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def classify(error: BaseException) -> tuple[int, str, str]:
    """(exit status, label, one-line message) for an exception that reached the top."""
    error = _interruption(error) or error
    if isinstance(error, Interrupted):
        return 128 + error.signum, "interrupted", f"stopped by {error}"
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT, "interrupted", "stopped by SIGINT"
    if isinstance(error, BadInput):
        return EXIT_USAGE, "error", shorten(str(error))
    if isinstance(error, WorkerLost):
        return EXIT_WORKER, "error", shorten(str(error))
    if out_of_memory(error):
        detail = shorten(_first_line(error), 500)
        return (
            EXIT_USAGE,
            "error",
            "out of memory: the config needs more memory than this machine has"
            + (f" ({detail})" if detail else "")
            + "; use smaller sizes or fewer devices",
        )
    os_problem = os_error(error)
    if os_problem is not None:
        return EXIT_USAGE, "error", shorten(describe_os_error(os_problem))
    return (
        EXIT_INTERNAL,
        "internal error",
        f"{type(error).__name__}: {shorten(_first_line(error), 500)} (a bug in this tool; "
        "rerun with --verbose for the traceback)",
    )
