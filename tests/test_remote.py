"""A Side in another Python environment (`parity.remote`): the wire format, a worker that
dies, hangs, raises or chatters, bad environments refused before JAX, and the decoder twins
gated with each side in its own worker process (the engine's checks, unchanged), an injected
bug in the NNX worker caught where the in-process gate catches it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hostile import REPO, TINY, refused, run

from migrate import errors
from migrate.config.loading import load_config
from parity.engine.result import errored
from parity.engine.side import SideError
from parity.remote import protocol
from parity.remote.client import Worker
from parity.remote.proxy import RemoteSide

TESTS = str(Path(__file__).resolve().parent)
FAKES = "remote_fakes:make"


def fake_worker(timeout_s: float = 60, **options) -> Worker:
    worker = Worker(sys.executable, options.get("framework", "nnx"), [TESTS], timeout_s=timeout_s)
    worker.start(FAKES, options, {"x": np.zeros(2, np.int32)})
    return worker


@pytest.mark.compat
def test_a_tree_travels_bit_exact_with_its_names_and_placements(tmp_path):
    """Every dtype (bfloat16 as its bits), shapes, logical names and placements by path."""
    leaves = {
        ("params", "a"): np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        ("params", "b"): (np.arange(4) / 3).astype(ml_dtypes.bfloat16),
        ("opt", "0", "count"): np.array(3, np.int32),
        ("mask",): np.array([True, False]),
    }
    names = {("params", "a"): ("embed", None)}
    placements = {("params", "a"): {"spec": [None, "fsdp"], "axis_names": ["fsdp"]}}
    manifest = protocol.write_tree(tmp_path, leaves.items(), names, placements)
    json.dumps(manifest)  # the manifest itself is JSON
    arrays, entries = protocol.read_tree(tmp_path, manifest)
    assert list(arrays) == list(leaves)
    for path, array in leaves.items():
        assert arrays[path].dtype == array.dtype and arrays[path].shape == array.shape
        assert arrays[path].tobytes() == array.tobytes()
    assert entries[("params", "a")] == {
        "names": ("embed", None),
        "placement": placements[("params", "a")],
    }
    assert entries[("mask",)]["names"] is None
    assert list(tmp_path.iterdir()) == []  # read files are removed
    assert protocol.nest(protocol.flatten({"a": {"b": 1, "c": [2, 3]}})) == {
        "a": {"b": 1, "c": {"0": 2, "1": 3}}
    }


@pytest.mark.compat
def test_a_workers_program_text_is_hlo_on_this_jax():
    """The lowered program as the worker sends it (`worker.program_text`): HLO text on this
    stack's jax, whichever `as_text` signature it has."""
    import jax

    from parity.remote import worker

    text = worker.program_text(jax.jit(lambda x: x * 2).lower(np.ones(3, np.float32)))
    assert "HloModule" in text and "multiply" in text


@pytest.mark.slow
def test_a_worker_imports_the_projects_packages_and_nothing_else_of_the_callers(
    tmp_path, monkeypatch
):
    """Installed, the folder above `parity/` is the caller's whole site-packages. A worker's
    path holds links to the project's own packages only: the caller's jax, flax and maxtext
    beside them (here ones that cannot be imported) are not the worker's, which imports its
    own environment's jax and flax (the versions its interpreter reports) and serves its
    side."""
    import flax
    import jax

    from parity.remote import client

    site = tmp_path / "site-packages"
    for package in ("jax", "flax", "maxtext"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text(
            f'raise ImportError("the caller\'s {package}")\n'
        )
    for name in ("migrate", "parity"):
        (site / name).symlink_to(REPO / name, target_is_directory=True)
    monkeypatch.setattr(client, "REPO", site)
    worker = Worker(sys.executable, "nnx", [TESTS], timeout_s=60)
    try:
        info = worker.start(FAKES, {}, {"x": np.zeros(2, np.int32)})
        assert (info["jax"], info["flax"]) == (jax.__version__, flax.__version__)
        assert worker.call("own_weights")["handle"] >= 1  # it serves its side
    finally:
        worker.close()


@pytest.mark.slow
@pytest.mark.compat
def test_a_worker_serves_its_side_and_stdout_chatter_does_not_break_it():
    worker = fake_worker(run="print")
    try:
        side = RemoteSide(worker, "nnx")
        weights = side.own_weights()
        assert side.to_common(weights)["params"]["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
        result = side.run(weights)
        assert float(result.loss) == 15.0 and result.outputs.tolist() == [[0, 2, 4], [6, 8, 10]]
        deadline = time.monotonic() + 10  # stderr is read by a thread of its own
        while "chatter on stdout" not in "\n".join(worker.stderr_tail):
            assert time.monotonic() < deadline, list(worker.stderr_tail)
            time.sleep(0.05)
    finally:
        worker.close()


@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.parametrize(("framework", "status"), [("nnx", "failed"), ("linen", "bad_input")])
def test_an_error_of_the_model_code_keeps_its_meaning(framework, status):
    """Raised by the NNX side's model: a parity failure; by the Linen side's: bad input; the
    message names the worker's exception type and the traceback is the worker's."""
    worker = fake_worker(run="raise", framework=framework)
    try:
        side = RemoteSide(worker, framework)
        with pytest.raises(SideError) as raised:
            side.run(side.own_weights())
        assert "raised ValueError in run: the model's own error" in str(raised.value)
        assert "remote_fakes.py" in raised.value.detail
        assert errored("forward", raised.value).status == status
    finally:
        worker.close()


def cached_worker(workers, cache: Path, **options) -> Worker:
    """A fake worker started by a run whose persistent cache is `cache` (the session's cache
    settings restored)."""
    import jax

    from parity.engine import compiles
    from parity.remote.environments import Environment

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        compiles.use_compilation_cache(str(cache))
        where = Environment(sys.executable, extra_paths=(TESTS,))
        return workers.start(options.get("framework", "nnx"), where, FAKES, options, {})
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


@pytest.mark.slow
def test_a_worker_compiles_through_the_runs_cache_and_its_compiles_count_in_the_run(tmp_path):
    """The run's persistent cache (`--compilation_cache_dir`, here a new one) is the worker's:
    its program is written there (a second run reads it); and the compile, made in the worker,
    is counted in the check that called it, its program named after the worker."""
    from parity.engine import compiles
    from parity.remote.client import WorkerSet

    cache = tmp_path / "xla"
    workers = WorkerSet()
    try:
        side = RemoteSide(cached_worker(workers, cache, run="compile"), "nnx")
        weights = side.own_weights()
        with compiles.measure() as cost:
            side.run(weights)
        assert cost.compilations == 1 and cost.cache_reads == 0, cost
        assert cost.programs == ["nnx/jit(<lambda>)"] and cost.compile_seconds > 0
        with compiles.measure() as again:  # a new function, the same program: read, not built
            side.run(weights)
        assert (again.compilations, again.cache_reads) == (1, 1), again
    finally:
        workers.close()
    assert [p for p in cache.iterdir() if p.name.startswith("jit__lambda")], list(cache.iterdir())


@pytest.mark.slow
def test_a_workers_compile_time_says_whether_it_compiled_or_read_the_cache(tmp_path):
    """What the compile check says of a worker's program (`--maxtext`): "compiled in" where
    the worker compiled it; in a second run, which reads it from the persistent cache, that it
    was a read, never a compile time."""
    from parity.remote.client import WorkerSet

    sources = []
    for _ in range(2):  # two runs, one cache
        workers = WorkerSet()
        try:
            side = RemoteSide(cached_worker(workers, tmp_path / "xla"), "nnx")
            sources.append(side.compiled(side.own_weights()).facts["compile_source"])
        finally:
            workers.close()
    assert sources[0].startswith("compiled in "), sources
    assert sources[1].startswith("read from the persistent compilation cache in "), sources
    assert sources[1].endswith(", not compiled")


@pytest.mark.slow
@pytest.mark.parametrize("behaviour", ["die", "hang"])
def test_a_worker_that_dies_or_hangs_is_lost_in_bounded_time(behaviour):
    assert_lost_in_bounded_time(fake_worker(timeout_s=3, run=behaviour), behaviour)


def assert_lost_in_bounded_time(worker: Worker, behaviour: str) -> None:
    """A worker started with `timeout_s=3` whose `run` does `behaviour` (`die`, `hang`)."""
    side = RemoteSide(worker, "nnx")
    weights = side.own_weights()
    start = time.monotonic()
    with pytest.raises(errors.WorkerLost) as lost:
        side.run(weights)
    assert time.monotonic() - start < 15
    why = "exited with 7" if behaviour == "die" else "no answer within 3s"
    assert f"worker nnx ({sys.executable}): {why} while run" in str(lost.value)
    assert errors.classify(lost.value)[0] == errors.EXIT_WORKER
    assert worker.process.poll() is not None  # killed, not left behind


@pytest.mark.slow
def test_the_callers_working_directory_never_hides_the_sides_own_code(tmp_path, monkeypatch):
    """A worker imports what its side's path names (`--nnx_path`), not a same-named module in
    the directory `parity` was started from (a checkout's root, as users run it): `python -m`
    puts the working directory first on the import path."""
    (tmp_path / "remote_fakes.py").write_text('raise ImportError("the caller\'s copy")\n')
    monkeypatch.chdir(tmp_path)
    worker = fake_worker(run="ok")
    try:
        side = RemoteSide(worker, "nnx")
        assert float(side.run(side.own_weights()).loss) == 15.0
    finally:
        worker.close()


@pytest.mark.slow
def test_a_relative_interpreter_path_is_read_from_the_callers_directory(tmp_path, monkeypatch):
    """`--nnx_python=.venv/bin/python` names an interpreter from where `parity` runs; the worker
    starts in a directory of its own, where that path names nothing: it is made absolute
    first, its links kept (a venv's interpreter finds its venv by its own path)."""
    from parity.remote.client import check_interpreter

    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(sys.executable, tmp_path)
    assert check_interpreter(relative) == os.path.abspath(sys.executable)  # a link stays one
    worker = Worker(relative, "nnx", [TESTS], timeout_s=60)
    try:
        worker.start(FAKES, {"run": "ok"}, {"x": np.zeros(2, np.int32)})
        side = RemoteSide(worker, "nnx")
        assert float(side.run(side.own_weights()).loss) == 15.0
    finally:
        worker.close()


@pytest.mark.slow
def test_a_long_call_is_said_while_it_runs():
    """A call that runs longer than the worker's `wait_line_s` is told to `on_wait` as it
    runs (the MaxText gate prints it: building a large model, a train.py run), each time with
    the worker, the call and the seconds so far."""
    heard = []
    worker = Worker(
        sys.executable, "nnx", [TESTS], timeout_s=60,
        on_wait=lambda *told: heard.append(told), wait_line_s=0.2,
    )  # fmt: skip
    try:
        worker.start(FAKES, {"run": "sleep", "seconds": 1.0}, {"x": np.zeros(2, np.int32)})
        side = RemoteSide(worker, "nnx")
        assert float(side.run(side.own_weights()).loss) == 15.0
    finally:
        worker.close()
    during_run = [seconds for name, doing, seconds in heard if (name, doing) == ("nnx", "run")]
    assert len(during_run) >= 3 and during_run == sorted(during_run), heard
    assert during_run[-1] >= 0.6


def processes_naming(directory: Path) -> list[str]:
    """The command lines of the running processes that name `directory` (a worker names its
    own temporary directory on its command line)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if process.info["status"] != psutil.STATUS_ZOMBIE and any(
            str(directory) in part for part in cmdline
        ):
            found.append(" ".join(cmdline))
    return found


def live_children_of_processes_naming(directory: Path) -> list[str]:
    """The command lines of the live (not zombie) children of the processes that name
    `directory`: a fork server names its socket, in its folder, and its workers are its
    children."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(directory) in part for part in process.info["cmdline"] or []):
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in process.children():
                    if child.status() != psutil.STATUS_ZOMBIE:
                        found.append(" ".join(child.cmdline()))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["plain", "forked"])
@pytest.mark.parametrize("stage", ["start", "first-call", "mid-check", "exit"])
def test_a_worker_killed_at_any_stage_leaves_no_process_and_no_directory(
    stage, launch, tmp_path, monkeypatch
):
    """`parity --maxtext`'s run (`release_pair.run_gate`: its pair, its checks, its workers'
    end), here on fake sides, with the NNX worker killed (SIGKILL) as it starts, at its first
    call, halfway through `forward`, and as the run ends: a worker lost before the checks are
    done is `WorkerLost` (exit 3) naming it; one lost at the end leaves the results standing.
    Either way both workers are gone, and so are their temporary directories; plain processes
    or forked from a fork server (`parity.remote.forked`), whose children they then are."""
    from parity.maxtext import gate_config, release_pair
    from parity.remote import forked
    from parity.remote.environments import Environment

    servers = Path(tempfile.mkdtemp(prefix="parity-fs-"))  # before tempdir moves: a short path
    monkeypatch.setenv(forked.FOLDER_VARIABLE, str(servers) if launch == "forked" else "")
    monkeypatch.setenv(forked.OWNER_VARIABLE, str(os.getpid()))
    monkeypatch.setattr(release_pair, "FACTORY", FAKES)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = gate_config.load(REPO / "configs" / "maxtext" / "pp4.yml", [f"kill_at={stage}"])
    where = Environment(sys.executable, extra_paths=(TESTS,), timeout_s=60)
    environments = {"linen": where, "nnx": where}
    if stage == "exit":
        results, _, sides = release_pair.run_gate(config, environments, ["forward"], 1)
        assert [r.status for r in results] == ["passed"] and set(sides) == {"linen", "nnx"}
    else:
        with pytest.raises(errors.WorkerLost, match=r"worker nnx .*killed by signal 9"):
            release_pair.run_gate(config, environments, ["forward"], 1)
    assert list(tmp_path.iterdir()) == []
    assert processes_naming(tmp_path) == []
    if launch == "forked":
        assert list(servers.glob("*.sock")), "no fork server served the workers"
        deadline = time.monotonic() + 5  # the server reaps its children within a tick
        while live_children_of_processes_naming(servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_children_of_processes_naming(servers) == []
        forked.stop_servers(servers)
    shutil.rmtree(servers, ignore_errors=True)


@pytest.mark.slow
def test_a_side_that_cannot_be_built_is_an_error_of_its_code():
    worker = Worker(sys.executable, "linen", [TESTS], timeout_s=60)
    try:
        with pytest.raises(Exception, match="cannot build the side"):
            worker.start(FAKES, {"start": "raise"}, {})
    finally:
        worker.close()


BAD_ENVIRONMENTS = [
    (["--nnx_python=/no/such/python"], "worker interpreter '/no/such/python': not found"),
    ([f"--linen_python={REPO}"], "not an executable file"),
    ([f"--nnx_path={REPO / 'docs'}"], "not a checkout of this project with workers"),
    (["--nnx_python=python3", "--num_processes=2"], "a remote pair runs in one process"),
    # Nothing the workers can run: refused before either starts.
    (["--nnx_python=python3", "--checks=pipeline,layers"], "need the twins in this process"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "fragment"), BAD_ENVIRONMENTS)
def test_a_bad_environment_is_refused_before_jax(flags, fragment):
    start = time.monotonic()
    refused(run("parity", TINY, *flags, timeout=30), errors.EXIT_USAGE, fragment)
    assert time.monotonic() - start < 15


ACROSS = ("roundtrip", "init", "forward", "grads", "sharding", "program", "train", "random")


@pytest.mark.compat
@pytest.mark.slow
def test_the_twins_in_two_workers_pass_the_engine_checks(tmp_path):
    """`parity CONFIG --linen_python=... --nnx_python=...`: each side in its own worker (here
    this interpreter: the mechanism is the same for another one), every engine check passes
    bit-exact with dropout on (the `random` check's draws made in the workers), the local-only
    checks are said to be skipped, and the report is written."""
    report = tmp_path / "report.json"
    result = run(
        "parity", TINY, "dropout_rate=0.1", f"--nnx_python={sys.executable}",
        f"--linen_python={sys.executable}", "--checks=all", "--steps=2", f"--json={report}",
        timeout=900,
    )  # fmt: skip
    err = result.stderr.decode()
    assert result.returncode == 0, err[-3000:]
    assert "not across processes, skipped: pipeline, bubbles, layers, compile, efficiency" in err
    assert "s in calls to the workers" in err and "moving arrays between the processes" in err
    data = json.loads(report.read_text())
    checks = {c["name"]: c for c in data["checks"]}
    assert list(checks) == list(ACROSS)
    assert all(c["passed"] for c in checks.values())
    assert "decoder: 4 draws, same keys" in checks["random"]["message"]
    # the programs compiled (or read from the cache) in the workers count in the run's cost
    assert {"linen", "nnx"} <= {p.partition("/")[0] for p in data["cost"]["programs"]}


@pytest.mark.slow
def test_a_bug_injected_in_the_nnx_worker_is_caught_where_the_local_gate_catches_it():
    """The RMSNorm epsilon bug of tests/test_injected_bugs.py, patched at run time in the NNX
    worker (never in the code): forward and grads fail, naming the logits and the first
    norm's gradients, while the Linen worker is untouched."""
    from parity.decoder.remote_twins import RemoteDecoderPair
    from parity.engine import numeric
    from parity.remote.environments import Environment

    cfg = load_config(TINY)
    environments = {
        "linen": Environment(sys.executable),
        "nnx": Environment(
            sys.executable, patch="remote_fakes:bug_rmsnorm_epsilon", extra_paths=(TESTS,)
        ),
    }
    pair = RemoteDecoderPair(cfg, TINY, [], environments)
    try:
        forward = numeric.forward(pair)
        assert forward.status == "failed" and "logits" in forward.where
        grads = numeric.grads(pair)
        assert grads.status == "failed"
        assert numeric.roundtrip(pair).passed  # the weights themselves still match
    finally:
        pair.workers.close()


@pytest.mark.slow
def test_a_shipped_config_named_by_name_reaches_the_workers_as_its_file(tmp_path):
    """`parity llama2-tiny --nnx_python=...` from a folder of the user's: the workers build
    their sides from the shipped config's file, not from a path the name would make there."""
    done = run(
        "parity", "llama2-tiny", f"--nnx_python={sys.executable}", "--checks=roundtrip",
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert b"PASS" in done.stdout
