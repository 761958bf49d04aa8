"""What the `parity` and `migrate` entry points share: the guard that turns every exception
into its exit code (`migrate.errors`), signals that unwind like exceptions, and a prompt exit.

    exit_now(guarded("parity", lambda: run(argv), verbose=lambda: FLAGS.verbose))

No JAX here.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from migrate.errors import (
    EXIT_INTERNAL,
    EXIT_USAGE,
    EXIT_WORKER,
    BadInput,
    Interrupted,
    classify,
    describe_os_error,
)

_deferring = 0  # > 0 inside `signals_deferred()`
_received: list[int] = []  # signals not yet acted on (deferred, or their exception swallowed)
# The error printed without --verbose, held (with the frames it keeps alive) until `exit_now`
# turns logging off: what the exit logs after that line is noise.
_quiet_exit: BaseException | None = None


def _raise_interrupted(signum: int, frame) -> None:
    _received.append(signum)
    if not _deferring:
        # Raised in whatever Python code runs now; where that is a GC callback or a __del__,
        # Python only prints it (see `_drop_swallowed`): `raise_if_interrupted` raises it again.
        raise Interrupted(signum)


def raise_if_interrupted() -> None:
    """Raise `Interrupted` for a signal received but not acted on. Called at the points where
    stopping is safe and matters (before a checkpoint is saved or moved into place, before
    each check), since a signal's exception can be swallowed where it fires."""
    if _received and not _deferring:
        signum = _received[0]
        _received.clear()
        raise Interrupted(signum)


def _drop_swallowed(unraisable) -> None:
    """An `Interrupted` that Python could not raise (it fired in a GC callback): recorded in
    `_received`, so not printed."""
    if not isinstance(unraisable.exc_value, Interrupted):
        _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` in the main thread, so that `finally` blocks and
    `except BaseException` cleanups run (SIGTERM would otherwise end the process at once).
    Elsewhere than the main thread this does nothing."""
    global _previous_unraisablehook
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _drop_swallowed
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = _previous_unraisablehook


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """A critical section (moving a checkpoint into place): a SIGINT or SIGTERM that arrives
    inside is raised when it ends, so the section is never left half done."""
    global _deferring
    _deferring += 1
    try:
        yield
    except BaseException:
        if _deferring == 1:
            _received.clear()  # the section failed: its error, not the signal, is reported
        raise
    finally:
        _deferring -= 1
    raise_if_interrupted()


def quiet_library_tracebacks() -> None:
    """Log records print as their one line, without a traceback (Orbax logs the errors of its
    writer threads with theirs, through whatever handler the process has): every record is
    made without `exc_info`. Not under --verbose."""
    make_record = logging.getLogRecordFactory()

    def without_traceback(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return record

    logging.setLogRecordFactory(without_traceback)


def error_line(program: str, message: str, label: str = "error") -> int:
    """Print `PROGRAM: LABEL: MESSAGE` on stderr; returns EXIT_USAGE for `return usage(...)`."""
    print(f"{program}: {label}: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def guarded(program: str, body: Callable[[], int], verbose: Callable[[], bool]) -> int:
    """`body()`'s exit status; any exception becomes its status from `errors.classify` with a
    one-line message (and the traceback when `verbose()`), never a bare traceback. After that
    line, what abandoned library objects print as they are collected (an Orbax event loop, a
    save never awaited) is dropped too, unless `verbose()`."""
    global _quiet_exit
    _quiet_exit = None
    try:
        with signals_raise():
            status = body()
            raise_if_interrupted()  # a signal whose exception was swallowed still stops us
        return status
    except SystemExit:
        raise
    except BaseException as e:  # the point: nothing escapes unclassified
        if _received and not isinstance(e, KeyboardInterrupt):
            # The signal's exception fired inside a library that failed in its turn on the way
            # out (measured: an interrupted Orbax save surfacing as JAX's "Slice ... is not
            # concrete"): the signal stopped the run, whatever surfaced.
            e = Interrupted(_received[0])
        _received.clear()  # acted on: an in-process caller's next run starts clean
        status, label, message = classify(e)
        error_line(program, message, label)
        loud = False
        with contextlib.suppress(Exception):
            loud = verbose()
        if loud:
            traceback.print_exc()
        else:
            _quiet_exit = sys.exc_info()[1]
            sys.unraisablehook = lambda unraisable: None
            warnings.simplefilter("ignore")
        return status


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _interrupted_while_exiting(program: str, status: int) -> Callable[[int, object], None]:
    def leave(signum: int, frame) -> None:
        _flush()
        with contextlib.suppress(Exception):
            name = signal.Signals(signum).name
            print(
                f"{program}: {name} while exiting: the work was already complete "
                f"(exit {status}); leaving now",
                file=sys.stderr,
                flush=True,
            )
        os._exit(status)

    return leave


_TEMPORARY: list[str] = []  # directories this run made: removed however it exits


def remove_at_exit(directory: str) -> None:
    """`directory` (made by this run) removed when the process exits: at the interpreter's
    exit, and by `exit_now`'s prompt exit, which skips the interpreter's exit hooks."""
    _TEMPORARY.append(directory)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


def exit_now(status: int, distributed: bool = False, program: str = "") -> None:
    """Exit with `status`. After an internal error, a lost worker or an interrupt, threads that
    JAX, Orbax or the distributed runtime left running must not hold the process (or hang it in
    their shutdown): flush and leave at once. Otherwise a normal exit; so too after an internal
    error in a multi-process run (`distributed`), whose peers leave the runtime together.

    The outcome is decided here (a checkpoint in place, a report written): a SIGINT or SIGTERM
    during the interpreter's shutdown (JAX clears its caches then) ends it at once with that
    status and one line, instead of a `KeyboardInterrupt` traceback from an exit hook. After an
    error line printed without --verbose, nothing more is logged."""
    if program and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _interrupted_while_exiting(program, status))
    if _quiet_exit is not None:
        # What the libraries log as their abandoned objects are collected at exit restates the
        # error line once per object (measured: an Orbax save on a full disk, one asyncio "Task
        # exception was never retrieved" per failed write, 68 KB of them on a slow run).
        logging.disable(logging.CRITICAL)
    prompt = status == EXIT_WORKER or status >= 128 or (status == EXIT_INTERNAL and not distributed)
    if prompt and "jax" in sys.modules:
        _flush()
        for directory in _TEMPORARY:
            shutil.rmtree(directory, ignore_errors=True)
        os._exit(status)
    sys.exit(status)


def unwritable_reason(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (made with its parents if missing), or None:
    its nearest existing ancestor must be a directory this process can write."""
    ancestor = Path(os.path.abspath(directory))
    while not ancestor.exists():
        if ancestor.is_symlink():
            return f"{ancestor} is a broken symbolic link"
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None


def ensure_directory(directory: Path, what: str) -> Path:
    """`directory`, created with its parents when missing; BadInput when that cannot be."""
    if directory.exists() and not directory.is_dir():
        raise BadInput(f"{what}: {directory} is not a directory")
    reason = unwritable_reason(directory)
    if reason:
        raise BadInput(f"{what}: cannot write in {directory}: {reason}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{what}: cannot create {directory}: {describe_os_error(e)}") from None
    return directory


def check_output_file(path: str, what: str) -> Path:
    """A file to be written later (a report): refused now when it is a directory, a broken link
    or cannot be written (an existing file opened for appending, else a file made and removed
    in its folder); its missing parent directories are created now."""
    target = Path(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a symlink loop, a parent that is a file
        raise BadInput(f"{what}={path}: {describe_os_error(e)}") from None
    if mode is None and target.is_symlink():
        raise BadInput(f"{what}={path}: a broken symbolic link")
    if mode is not None and stat.S_ISDIR(mode):
        raise BadInput(f"{what}={path}: is a directory; give a file path")
    if mode is not None and not os.access(target, os.W_OK):
        raise BadInput(f"{what}={path}: is not writable")
    folder = ensure_directory(target.absolute().parent, what)
    # Permission bits do not say everything (root passes `access`; /proc and read-only or
    # full file systems refuse at the write): make and remove a file there.
    try:
        if mode is None:
            descriptor, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
            os.close(descriptor)
            os.unlink(probe)
        else:
            with open(target, "ab"):  # opened, not written: the file is unchanged
                pass
    except OSError as e:
        where = f"a file in {folder}" if mode is None else str(target)
        reason = e.strerror or describe_os_error(e)
        raise BadInput(f"{what}={path}: cannot write {where}: {reason}") from None
    return target
