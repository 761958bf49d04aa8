"""`migrate` never destroys data: what `--force` may replace, destinations it must refuse,
edited `meta`, staging names and their cleanup on SIGINT, SIGTERM, SIGKILL and a full disk.
Each refusal exits 2 with one message line, and the files around are left as they were."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hostile import REPO, TINY, command, read_only, refused, run, snapshot
from test_migrate_cli import migrate as migrate_in_process

from migrate import errors
from migrate.checkpoints import destination
from migrate.checkpoints.meta import read_meta
from migrate.runtime import cli_support

pytestmark = [
    pytest.mark.compat,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
CONFIG = f"--config={TINY}"
CONVERT = ("convert", CONFIG, "--from=nnx", "--to=linen")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """An NNX checkpoint (pipeline S=4 R=2), read only by the tests."""
    path = tmp_path_factory.mktemp("safety") / "nnx"
    assert migrate_in_process("init", CONFIG, "--framework=nnx", str(path)) == 0
    return path


@pytest.fixture
def place(tmp_path) -> Path:
    """A folder of someone's files: a test's destination goes in or next to it."""
    folder = tmp_path / "place"
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "todo.txt").write_text("keep me")
    (folder / "data.bin").write_bytes(os.urandom(64))
    return folder


@pytest.mark.slow
def test_force_never_replaces_what_the_tool_did_not_write(src, place, tmp_path):
    """A directory of other files, the working directory, a folder above it, a folder above
    the source, a file, a symbolic link: refused even with --force."""
    (place / "link").symlink_to(place / "notes")
    init = ("init", CONFIG, "--framework=nnx")
    replace = "; not replacing it, even with --force"
    cases = [
        (CONVERT, [str(src), str(place)], tmp_path, "is not a checkpoint this tool wrote"),
        (init, ["."], place, "is or contains the current directory"),
        (init, [".."], place / "notes", "is or contains the current directory"),
        (CONVERT, [str(src), str(src.parent)], place, "must not be, contain or lie inside"),
        (CONVERT, [str(src), str(place / "data.bin")], place, f"is not a directory{replace}"),
        (CONVERT, [str(src), str(place / "link")], place, f"is a symbolic link{replace}"),
    ]
    before, source_before = snapshot(tmp_path), snapshot(src)
    for args, paths, cwd, fragment in cases:
        result = run("migrate", *args, "--force", *paths, cwd=cwd, timeout=30)
        refused(result, errors.EXIT_USAGE, fragment)
        assert snapshot(tmp_path) == before, (args, paths)
    assert snapshot(src) == source_before


def test_force_replaces_a_checkpoint_it_wrote(src, tmp_path):
    dst = tmp_path / "ours"
    assert migrate_in_process(*CONVERT, str(src), str(dst)) == 0
    (dst / "meta" / "extra").write_text("from the first run")
    assert migrate_in_process(*CONVERT, str(src), str(dst)) == errors.EXIT_USAGE  # no --force
    assert migrate_in_process(*CONVERT, "--force", str(src), str(dst)) == 0
    assert not (dst / "meta" / "extra").exists() and read_meta(dst)["framework"] == "linen"
    assert [p.name for p in tmp_path.iterdir()] == ["ours"]  # no staging, no old copy left


@pytest.mark.slow
def test_a_destination_that_cannot_be_written_is_refused_before_any_work(src, place):
    before = snapshot(place)
    refused(
        run("migrate", *CONVERT, str(src), str(place / "data.bin" / "dst"), timeout=30),
        errors.EXIT_USAGE,
        "cannot be created",
        "data.bin is not a directory",
    )
    with read_only(place / "notes"):
        result = run("migrate", *CONVERT, str(src), str(place / "notes" / "a" / "dst"), timeout=30)
        refused(result, errors.EXIT_USAGE, "cannot be created", "notes is not writable")
    name = "n" * 256
    refused(
        run("migrate", *CONVERT, str(src), str(place / name), timeout=30),
        errors.EXIT_USAGE,
        "longer than 255 bytes",
    )
    assert snapshot(place) == before


def _edit(meta: dict, edit: str) -> None:
    if edit == "huge-stages":
        meta["layout_keys"]["ici_pipeline_parallelism"] = 100_000
    elif edit == "string-stages":
        meta["layout_keys"]["ici_pipeline_parallelism"] = "4"
    elif edit == "bool-version":
        meta["version"] = True
    elif edit == "negative-step":
        meta["step"] = -1
    elif edit == "shape-of-text":
        next(iter(meta["arrays"].values()))["shape"] = "64"
    elif edit == "missing-layout-key":
        del meta["layout_keys"]["scan_layers_per_stage"]
    elif edit == "wrong-dtype":
        meta["weight_dtype"] = "float64"
    elif edit == "seed-out-of-bounds":
        meta["rng"]["seed"] = -5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        ("huge-stages", "layout_keys.ici_pipeline_parallelism=100000: expected an integer in 1.."),
        ("string-stages", "layout_keys.ici_pipeline_parallelism=4: expected an integer"),
        ("bool-version", "version True"),
        ("negative-step", "step: expected an integer"),
        ("shape-of-text", ".shape: expected a list"),
        ("missing-layout-key", "layout_keys: expected exactly"),
        ("wrong-dtype", "weight_dtype: expected one of float32, bfloat16"),
        ("seed-out-of-bounds", "rng: expected seed (an integer in 0..4294967295)"),
    ],
)
def test_an_edited_meta_is_refused_before_jax(edit, fragment, src, tmp_path):
    """The device count comes from a validated meta only: one edited field (100000 stages
    would ask XLA for 200000 devices) is refused at once."""
    edited = tmp_path / "edited"
    shutil.copytree(src, edited)
    meta_file = edited / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    _edit(meta, edit)
    meta_file.write_text(json.dumps(meta))
    before = snapshot(tmp_path)
    start = time.monotonic()
    result = run("migrate", *CONVERT, str(edited), str(tmp_path / "dst"), timeout=30)
    refused(result, errors.EXIT_USAGE, "invalid meta item", fragment)
    assert time.monotonic() - start < 15
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_long_destination_name_gets_a_short_staging_name(tmp_path):
    """A 245-character destination name is legal: staging names never grow with it."""
    name = "c" * 245
    result = run("migrate", "init", CONFIG, "--framework=linen", name, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert read_meta(tmp_path / name)["framework"] == "linen"


def test_a_signal_that_a_library_turns_into_another_error_is_still_the_signal(capsys):
    """CI saw `migrate convert` exit 4 ("internal error: ValueError: Slice slice(32, 64, 1) is
    not concrete") after a SIGINT that landed inside an Orbax save: the signal's exception
    became another on the library's way out. The signal is what stopped the run: 128 + signum."""

    def body() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except BaseException:
            raise ValueError("Slice slice(32, 64, 1) is not concrete") from None
        return errors.EXIT_PASS

    assert cli_support.guarded("migrate", body, lambda: False) == 128 + signal.SIGTERM
    assert "migrate: interrupted: stopped by SIGTERM" in capsys.readouterr().err
    assert cli_support.guarded("migrate", lambda: errors.EXIT_PASS, lambda: False) == 0
    # and a real error with no signal stays an internal error
    assert cli_support.guarded("migrate", lambda: 1 / 0, lambda: False) == errors.EXIT_INTERNAL


ABANDONED_TASKS = """
import asyncio, atexit
from migrate.runtime import cli_support

abandoned = []
atexit.register(abandoned.clear)  # collected at exit, as Orbax's are

async def write(i):
    raise ValueError(f"OUT_OF_RANGE: Error writing shard {i}: File too large")

def body():
    loop = asyncio.new_event_loop()
    abandoned.extend(loop.create_task(write(i)) for i in range(50))  # never retrieved
    loop.run_until_complete(asyncio.sleep(0.01))
    raise OSError(27, "File too large")

cli_support.exit_now(cli_support.guarded("migrate", body, lambda: VERBOSE), program="migrate")
"""


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_what_abandoned_tasks_log_at_exit_follows_the_error_line_only_when_verbose(verbose):
    """CI saw a full-disk `migrate convert` print its one line and then 68 KB: Orbax's failed
    writes, each an asyncio task never retrieved, logged as they were collected at exit (how many
    depends on timing). After the error line, nothing more, unless --verbose."""
    script = ABANDONED_TASKS.replace("VERBOSE", str(verbose))
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    err = result.stderr.decode()
    assert result.returncode == errors.EXIT_USAGE, err
    never_retrieved = err.count("Task exception was never retrieved")
    if verbose:
        assert never_retrieved == 50, err[-3000:]
    else:
        assert err.splitlines() == ["migrate: error: File too large"], err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_conversion_removes_the_staging_directory(sig, src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    process = subprocess.Popen(
        [*command("migrate"), *CONVERT, "--verify", str(src), str(out / "dst")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 60
    while not list(out.glob(".migrate-staging-*/checkpoint*")):  # the save has started
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no staging directory appeared"
        time.sleep(0.01)
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + sig, err.decode()[-3000:]
    assert f"migrate: interrupted: stopped by {sig.name}".encode() in err
    assert b"Traceback" not in err
    time.sleep(1)  # nothing may reappear
    assert list(out.iterdir()) == []


# `migrate` as its console script runs it, with one exit hook that holds the interpreter's
# shutdown open (JAX clears its caches in one): a signal then lands after the outcome is decided.
SLOW_EXIT = """
import atexit, sys, time
atexit.register(lambda: (print("shutting down", file=sys.stderr, flush=True), time.sleep(30)))
from migrate import cli
sys.argv = ["migrate", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_after_success_exits_quietly_with_the_checkpoint_complete(sig, tmp_path):
    """Ctrl-C during interpreter exit, after the checkpoint was written: the decided status
    (0), one line that says the work was complete, no `KeyboardInterrupt` traceback."""
    dst = tmp_path / "dst"
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_EXIT, "init", CONFIG, "--framework=linen", str(dst)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = b""
    while b"shutting down" not in line:
        line = process.stderr.readline()
        assert line or process.poll() is None, "exited before its shutdown"
    process.send_signal(sig)
    _, err = process.communicate(timeout=30)
    err = err.decode()
    assert process.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert f"migrate: {sig.name} while exiting: the work was already complete (exit 0)" in err
    assert read_meta(dst)["framework"] == "linen"
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True])
def test_an_empty_directory_is_a_destination(force, src, tmp_path):
    """`mkdir out && migrate convert SRC out` writes there (nothing to lose), with or without
    --force; a non-empty directory is refused without advising a --force that would then be
    refused too."""
    out = tmp_path / "out"
    out.mkdir()
    args = [*CONVERT, *(["--force"] if force else []), str(src), str(out)]
    assert migrate_in_process(*args) == 0
    assert read_meta(out)["framework"] == "linen"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    result = run("migrate", *CONVERT, str(src), str(other), timeout=60)
    err = refused(result, errors.EXIT_USAGE, "is not a checkpoint this tool wrote", "even with")
    assert "pass --force" not in err
    assert (other / "keep.txt").read_text() == "mine"


def test_a_signal_waits_until_the_final_move_is_done():
    """SIGTERM inside the critical section (the two renames of the final move) is raised when
    the section ends, never in the middle."""
    done = []
    raised = pytest.raises(errors.Interrupted, match="SIGTERM")
    with cli_support.signals_raise(), raised, cli_support.signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        done.append("both renames")
    assert done == ["both renames"]


def test_a_signal_swallowed_where_it_fired_stops_the_run_at_the_next_safe_point(capsys):
    """A signal's exception fires in whatever Python code runs: in a GC callback or __del__,
    Python only prints it. It is raised again before the checkpoint is saved or moved."""

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, inside __del__: its exception is lost

    with cli_support.signals_raise():
        Finalised()
        with pytest.raises(errors.Interrupted, match="SIGTERM"):
            cli_support.raise_if_interrupted()
        cli_support.raise_if_interrupted()  # once only
    assert "Interrupted" not in capsys.readouterr().err


@pytest.mark.slow
def test_stale_staging_directories_are_removed_by_the_next_run(src, tmp_path):
    """A run killed by SIGKILL leaves its staging directory; the next run for the same
    destination removes it (moving back an old destination it had moved aside). Staging
    directories of live runs or other destinations, and anything not ours, stay."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    dst = tmp_path / "dst"

    def staging(token: str, owner: dict | None, *entries: str) -> Path:
        path = tmp_path / f"{destination.STAGING_PREFIX}{token}"
        path.mkdir()
        if owner is not None:
            (path / destination.OWNER_FILE).write_text(json.dumps(owner))
        for entry in entries:
            (path / entry).mkdir(parents=True)
            (path / entry / "f").write_text("x")
        return path

    me = psutil.Process()
    killed = {"destination": str(dst), "pid": dead.pid, "started": 1.0}
    alive = {"destination": str(dst), "pid": me.pid, "started": me.create_time()}
    other = {"destination": str(tmp_path / "other"), "pid": dead.pid, "started": 1.0}
    stale = staging("0" * 12, killed, "checkpoint.orbax-checkpoint-tmp/params")
    restored = staging("1" * 12, killed, "replaced/meta", "checkpoint")
    live = staging("2" * 12, alive, "checkpoint")
    elsewhere = staging("3" * 12, other, "checkpoint")
    leftover = staging("4" * 12, None, "checkpoint.orbax-checkpoint-tmp/params.orbax-tmp")
    foreign = staging("5" * 12, None, "my-files")
    not_ours = tmp_path / ".migrate-staging-mine"
    not_ours.mkdir()
    assert destination.remove_stale(dst) == [stale, restored, leftover]
    assert (dst / "meta" / "f").read_text() == "x"  # the old destination is back
    assert all(p.is_dir() for p in (live, elsewhere, foreign, not_ours))

    # The same through the command: a killed run's leftovers go, the conversion goes through.
    shutil.rmtree(dst)
    shutil.rmtree(live)
    again = staging("6" * 12, killed, "checkpoint")
    result = run("migrate", *CONVERT, str(src), str(dst), timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert f"removed {again}, left by a run that was killed".encode() in result.stderr
    assert not again.exists() and read_meta(dst)["framework"] == "linen"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork():RuntimeWarning")  # the child execs at once
def test_a_full_disk_exits_2_and_leaves_nothing(src, tmp_path):
    """Writes fail with EFBIG past a file-size limit (the way they fail with ENOSPC on a full
    disk): one line naming the error, exit 2, no staging directory left."""

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    out = tmp_path / "out"
    out.mkdir()
    result = run(
        "migrate", *CONVERT, str(src), str(out / "dst"), timeout=120, preexec_fn=small_files
    )
    refused(result, errors.EXIT_USAGE, "File too large")
    assert list(out.iterdir()) == []
