"""Multi-process parity: the local launcher, 2 processes x 4 devices against 1 x 8, and faults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CONFIG_DIR
from test_cli import REPO, run_in_process

from parity import cli
from parity.multiprocess import distributed, launch

CONFIG = str(CONFIG_DIR / "llama2-tiny.yml")
CHECKS = "--checks=roundtrip,forward,grads,pipeline,train"


def launch_parity(*args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """`parity CONFIG --num_processes=2 ...` as a user runs it: the launcher in a subprocess."""
    environ = os.environ.copy() | env
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "parity.cli", CONFIG, "--num_processes=2", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
    )


def worker_pids(stderr: str) -> list[int]:
    launched = next(line for line in stderr.splitlines() if "launched 2 workers" in line)
    return [int(p) for p in re.findall(r"worker \d \(pid (\d+)\)", launched)]


def assert_gone(pids: list[int]) -> None:
    assert len(pids) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"worker pid {pid} is still there"


@pytest.mark.slow
def test_worker_flags_need_a_divisible_mesh_and_a_coordinator(capsys):
    assert run_in_process(CONFIG, "--num_processes=3") == cli.EXIT_USAGE
    assert "does not divide the mesh's 8 devices" in capsys.readouterr().err
    assert run_in_process(CONFIG, "--num_processes=2", "--process_id=0") == cli.EXIT_USAGE
    assert "needs --coordinator_address and --process_id" in capsys.readouterr().err


def test_single_process_helpers_are_device_get_and_device_put():
    import jax
    import numpy as np

    host = np.arange(8.0, dtype=np.float32)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    placed = distributed.place({"a": host}, sharding)["a"]
    assert placed.sharding == sharding
    np.testing.assert_array_equal(distributed.to_host(placed), host)
    assert distributed.worst_status(1) == 1 and distributed.is_main()


def test_host_gathers_group_leaves_by_mesh_within_the_size_limit(monkeypatch):
    """One gather program per group: leaves of one mesh together, in order, a group closed
    before it would pass GATHER_GROUP_BYTES, a leaf larger than the limit alone."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices())
    meshes = [Mesh(devices.reshape(2, 4), ("a", "b")), Mesh(devices.reshape(4, 2), ("a", "b"))]
    sizes = [(0, 16), (1, 16), (0, 16), (0, 40), (0, 16), (1, 16)]  # (mesh, float32 elements)
    arrays = [
        jax.device_put(np.zeros(n, np.float32), NamedSharding(meshes[m], PartitionSpec()))
        for m, n in sizes
    ]
    monkeypatch.setattr(distributed, "GATHER_GROUP_BYTES", 128)  # 32 float32s
    assert distributed._gather_groups(arrays) == [[0, 2], [3], [4], [1, 5]]


def test_worker_env_sets_devices_and_import_path(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    env = launch.worker_env(4)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


@pytest.mark.slow
@pytest.mark.compat  # JAX's distributed runtime and its CPU collectives, on each stack's jax
def test_two_processes_give_the_verdicts_and_errors_of_one(tmp_path):
    """2 processes x 4 devices against 1 process x 8: the same program on the same global mesh,
    so the verdicts, worst errors and every Linen-against-NNX record are bit-identical.

    One thing may differ: an all-reduce between the processes (gloo) sums in another order than
    one within a process (measured with a bare psum of float32 [8, 4096] on this mesh: over
    fsdp, within a process, the same bits; over stage, across the processes, other bits).
    Process 0 holds stages 0-1 and process 1 stages 2-3, so what is summed over stages, the
    non-pipelined part's (the loss, and the final norm's and the tables' gradients, their batch
    split over stages), may round differently; the pipeline's layers, reduced within their
    stage, may not."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    start = time.perf_counter()
    result = launch_parity(CHECKS, "--steps=1", f"--json={two}", "--timeout_s=500")
    seconds_two = time.perf_counter() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tables = [line for line in result.stdout.splitlines() if "parity: llama2-tiny" in line]
    assert len(tables) == 1 and tables[0].startswith("[worker 0]")  # only process 0 reports
    assert_gone(worker_pids(result.stderr))
    start = time.perf_counter()
    assert run_in_process(CONFIG, CHECKS, "--steps=1", f"--json={one}") == cli.EXIT_PASS
    seconds_one = time.perf_counter() - start
    print(f"wall time: 2 processes {seconds_two:.1f}s, 1 process {seconds_one:.1f}s")
    expected, actual = json.loads(one.read_text()), json.loads(two.read_text())
    run_bound = ("checks", "cost")  # the checks: below; the cost: this run's seconds, programs
    assert {k: v for k, v in actual.items() if k not in run_bound} == {
        k: v for k, v in expected.items() if k not in run_bound
    }
    assert actual["cost"]["compilations"] > 0 and expected["cost"]["compilations"] > 0
    for a, b in zip(actual["checks"], expected["checks"], strict=True):
        assert (a["name"], a["passed"], a["worst"]) == (b["name"], b["passed"], b["worst"])
        assert [r["tensor"] for r in a["details"]] == [r["tensor"] for r in b["details"]]
        if a["worst"]["tolerance"] == 0:  # Linen against NNX: bit-exact in both runs
            assert a["details"] == b["details"], a["name"]
        else:  # the pipeline against the reference: within the tier in both runs
            for record, same in zip(a["details"], b["details"], strict=True):
                assert record["passed"] and same["passed"], record["tensor"]
                if "/grads/params/layers/" in record["tensor"]:  # nothing summed over stages
                    assert record == same
        for step, same in zip(a["steps"], b["steps"], strict=True):
            assert step["loss_linen"] == step["loss_nnx"] and step["max_rel"] == 0.0
            assert (step["step"], step["passed"]) == (same["step"], same["passed"])
            # The loss adds 4 non-negative per-stage partial sums in another order: at most
            # 3 roundings apart (measured on llama2-tiny: 1 ulp, 6.0627871 against 6.0627875).
            ulp = float(np.spacing(np.float32(same["loss_linen"])))
            assert abs(step["loss_linen"] - same["loss_linen"]) <= 3 * ulp
        assert len(a["steps"]) == len(b["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_worker_fails_the_run_in_time_and_leaves_no_process(fault):
    timeout = 20
    hook = {"kill": distributed.KILL_HOOK, "hang": distributed.HANG_HOOK}[fault]
    start = time.perf_counter()
    result = launch_parity(
        "--checks=roundtrip", f"--timeout_s={timeout}", timeout=timeout + 60, **{hook: "1"}
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == launch.EXIT_WORKER, result.stderr[-3000:]
    pids = worker_pids(result.stderr)
    error = next(line for line in result.stderr.splitlines() if "[parity] error:" in line)
    if fault == "kill":
        assert f"worker 1 (pid {pids[1]}) exited with status 7" in error
    else:
        assert f"timed out after {timeout}s" in error
        # the hung worker is named first: it has been silent longest
        assert error.split("stopping ")[1].startswith(f"worker 1 (pid {pids[1]})")
    # the timeout, plus start-up and SIGTERM -> SIGKILL escalation
    assert elapsed < timeout + launch.KILL_AFTER_S + 30
    assert_gone(pids)
