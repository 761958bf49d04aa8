"""Workers forked from a fork server of their environment (`parity.remote.forked`, the
suite's default: tests/conftest.py): served, lost and ended as plain ones are, one server per
environment and factory, a server refused where its imports start a thread, and a server that
ends with its owner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_remote import assert_lost_in_bounded_time

from migrate import errors
from parity.remote import forked
from parity.remote.client import Worker
from parity.remote.proxy import RemoteSide

TESTS = str(Path(__file__).resolve().parent)
FAKES = "remote_fakes:make"


@pytest.fixture
def servers(monkeypatch) -> Path:
    """A folder of this test's own for the servers (short: a socket's path has a limit),
    owned by this process; every server in it stopped at the end."""
    folder = Path(tempfile.mkdtemp(prefix="parity-fs-"))
    monkeypatch.setenv(forked.FOLDER_VARIABLE, str(folder))
    monkeypatch.setenv(forked.OWNER_VARIABLE, str(os.getpid()))
    yield folder
    forked.stop_servers(folder)
    shutil.rmtree(folder, ignore_errors=True)


def forked_worker(factory_module: str = "remote_fakes", paths=(TESTS,), **options) -> Worker:
    worker = Worker(
        sys.executable, "nnx", list(paths), timeout_s=options.pop("timeout_s", 60),
        factory_module=factory_module,
    )  # fmt: skip
    worker.start(f"{factory_module}:make", options, {"x": np.zeros(2, np.int32)})
    return worker


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_servers_key_leaves_out_pytests_bookkeeping_only():
    """The running test's name changes from test to test and no import reads it: one server
    serves a session; any other variable may be read at import (JAX reads its configuration
    then), so it makes another server."""
    env = {"JAX_PLATFORMS": "cpu", "PYTEST_CURRENT_TEST": "a (call)", "PYTEST_XDIST_WORKER": "gw0"}
    key = forked.server_key("/py", ["/p"], env, "m")
    moved = {**env, "PYTEST_CURRENT_TEST": "b (call)", "PYTEST_XDIST_WORKER": "gw1"}
    assert forked.server_key("/py", ["/p"], moved, "m") == key
    assert forked.server_key("/py", ["/p"], {**env, "JAX_PLATFORMS": "tpu"}, "m") != key
    assert forked.server_key("/py", ["/p"], {**env, "XLA_FLAGS": "--x"}, "m") != key
    assert forked.server_key("/py", ["/q"], env, "m") != key
    assert forked.server_key("/py", ["/p"], env, "other") != key


@pytest.mark.slow
def test_workers_forked_from_one_server_serve_and_end_as_plain_ones(servers):
    first, second = forked_worker(), forked_worker()
    try:
        for worker in (first, second):
            assert isinstance(worker.process, forked.ForkedProcess)
            side = RemoteSide(worker, "nnx")
            run = side.run(side.own_weights())
            assert float(run.loss) == 15.0
        assert first.process.pid != second.process.pid
        # one server, the parent of both: the environment's imports paid once
        assert len(list(servers.glob("*.sock"))) == 1
        assert parent_pid(first.process.pid) == parent_pid(second.process.pid) != os.getpid()
    finally:
        first.close()
        second.close()
    assert first.process.returncode == second.process.returncode == 0
    assert first.directory is None and second.directory is None


@pytest.mark.slow
@pytest.mark.parametrize("behaviour", ["die", "hang"])
def test_a_forked_worker_that_dies_or_hangs_is_lost_in_bounded_time(servers, behaviour):
    worker = forked_worker(run=behaviour, timeout_s=3)
    assert isinstance(worker.process, forked.ForkedProcess)
    assert_lost_in_bounded_time(worker, behaviour)


@pytest.mark.slow
def test_a_forked_worker_killed_by_a_signal_is_said_so(servers):
    with pytest.raises(errors.WorkerLost, match="killed by signal 9 while start"):
        forked_worker(kill_at="start")


@pytest.mark.slow
def test_a_factory_whose_imports_start_a_thread_is_not_forked(servers, tmp_path):
    """A thread running at the fork would leave its locks held in the child: the server refuses,
    says why, and the worker starts as a plain process."""
    (tmp_path / "threaded_factory.py").write_text(
        textwrap.dedent(
            """
            import threading, time
            from remote_fakes import make
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
            """
        )
    )
    worker = forked_worker("threaded_factory", paths=(TESTS, tmp_path))
    try:
        assert isinstance(worker.process, subprocess.Popen)
        side = RemoteSide(worker, "nnx")
        assert float(side.run(side.own_weights()).loss) == 15.0
    finally:
        worker.close()
    (refused,) = servers.glob("*.refused")
    assert "threaded_factory: 1 more threads after its imports" in refused.read_text()


@pytest.mark.slow
def test_a_server_ends_with_its_owner(servers, monkeypatch):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setenv(forked.OWNER_VARIABLE, str(owner.pid))
    worker = forked_worker()
    worker.close()
    (socket_path,) = servers.glob("*.sock")
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while socket_path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not socket_path.exists()  # the server removed its socket as it ended
