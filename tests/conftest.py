"""Shared fixtures. 8 simulated CPU devices, requested before JAX is imported."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from parity.remote import forked  # stdlib only: imports no JAX

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
# The suite compiles XLA:CPU machine code without LLVM's optimisations (its programs are tiny;
# most of its time is compiling them): the HLO every check compares, the shardings, collectives
# and memory are XLA's own either way; only the generated code is slower. Measured cold on
# tests/test_linen_pipeline.py: 119 s -> 95 s. The default config's matrix entry runs with XLA's
# defaults, as users run it (tests/test_cli.py).
FAST_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "--xla_backend_optimization_level" not in _flags:
    _flags = f"{_flags} {FAST_CODEGEN}"
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
# One persistent XLA compilation cache for the session (every xdist worker) and the CLI
# subprocesses it starts: the same programs (the twins in every NNX mode, the CLI's runs)
# compile once.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(Path(__file__).resolve().parent.parent / ".jax_cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The CPU, also where libtpu is installed (the TPU tests compile for its compile-only devices).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No size limit, as `parity` runs with its workers: a limit turns on JAX's LRU eviction, which
# lists and stats every entry on each write under one file lock for all processes (measured:
# 300 ms a write at the ~2,000 entries a whole run writes, the other processes waiting); a
# limit set in the shell is dropped for the same reason. Unlocked, a reader that meets an entry
# another process is still writing reads no program (JAX warns and compiles it).
os.environ.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
# Workers forked from a server per environment that imported their factory once
# (`parity.remote.forked`): the session starts about a hundred MaxText workers, each of which
# spent about 8 CPU-s importing MaxText. Set here, in the first pytest process (the xdist
# controller, whose workers and the `parity` processes they start inherit it); the servers end
# with this process.
if forkservers_created := forked.FOLDER_VARIABLE not in os.environ:
    os.environ[forked.FOLDER_VARIABLE] = tempfile.mkdtemp(prefix="parity-forkservers-")
    os.environ[forked.OWNER_VARIABLE] = str(os.getpid())

import pytest  # noqa: E402

from migrate.config.contract import Config  # noqa: E402
from migrate.config.loading import load_config  # noqa: E402
from parity import testing  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# The float32 pipeline variants the unit tests run on this session's 8 devices.
TINY_CONFIGS = (
    "llama2-tiny",
    "llama2-tiny-scan",
    "llama2-tiny-delay",
    "llama2-tiny-agonce",
    "llama2-tiny-agrepeat",
)
# Every shipped tiny config (the CLI's config matrix): also tensor parallelism, bfloat16, and
# the 16-device data x fsdp x tensor x stage mesh, and mixture-of-experts layers (mixtral-tiny).
SHIPPED_TINY_CONFIGS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*-tiny*.yml")))


def tiny(name: str, *overrides: str) -> Config:
    return load_config(CONFIG_DIR / f"{name}.yml", overrides)


def run_cli(tmp_path: Path, *args: str) -> tuple[int, dict]:
    """`parity` in-process (so monkeypatches apply), with its JSON report (`{}` when it
    wrote none)."""
    import json

    from parity import cli

    report = tmp_path / "report.json"
    argv = cli.FLAGS(["parity", *args, f"--json={report}"])
    try:
        status = cli.run(argv)
    finally:
        cli.FLAGS.unparse_flags()
    return status, json.loads(report.read_text()) if report.exists() else {}


def session_root(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session shares (the session's temporary
    root), for what one worker builds under a lock and the others reuse; without xdist, this
    session's own (a parent shared across sessions would serve a stale build)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def config_dir() -> Path:
    return CONFIG_DIR


@pytest.fixture(autouse=True)
def _compiled_programs_within_the_map_limit():
    """The whole suite in one process crossed `vm.max_map_count` after ~11 configs of the
    matrix and XLA segfaulted (`parity.testing.free_compiled_programs_near_map_limit`)."""
    yield
    testing.free_compiled_programs_near_map_limit()


# A test not marked `slow` starts no end-to-end run: one that does (a python, parity or migrate
# process, a worker, the parity command in-process, a whole decoder built for a pair, compiled
# or its train state initialised) fails, in every run (`make test`, `make test-fast`, a plain
# pytest), saying to mark it `slow`: `make test-fast` (-m "not slow") stays the fast layer.
# (tests/test_slow_guard.py holds the guard to that.) Its cost is a few attribute swaps a test.
PROGRAMS = ("parity", "migrate")  # and every python*


def refused_program(args) -> str | None:
    """The program a `subprocess.Popen(args)` would start, if a test not marked `slow` may not."""
    program = Path(str(args[0] if isinstance(args, list | tuple) else args).split()[0]).name
    return program if program.startswith("python") or program in PROGRAMS else None


def _not_slow(test: str, what: str) -> str:
    return f"{test} {what} but is not marked `slow`: mark it `slow` (pyproject.toml)"


def _end_to_end(test: str, what: str):
    def refuse(*args, **kwargs):
        pytest.fail(_not_slow(test, what))

    return refuse


@pytest.fixture(autouse=True)
def _a_test_not_marked_slow_starts_no_end_to_end_run(request):
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    import subprocess

    from migrate.checkpoints import commands, train_state
    from parity import cli as parity_cli
    from parity.decoder import session, twins

    test = request.node.nodeid
    popen = subprocess.Popen.__init__

    def start(self, args, *rest, **kwargs):
        program = refused_program(args)
        if program is not None:
            pytest.fail(_not_slow(test, f"starts a {program} process"))
        popen(self, args, *rest, **kwargs)

    # Its own MonkeyPatch: a test's `monkeypatch.undo()` leaves the guard in place.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", start)
        patch.setattr(parity_cli, "run", _end_to_end(test, "runs a parity command"))
        patch.setattr(session.DecoderPair, "__init__", _end_to_end(test, "builds the twins' pair"))
        compiled = ("linen_initial_variables", "_linen_step", "_linen_train_fns")
        for name in (*compiled, "_nnx_initial_state", "_nnx_step", "_nnx_train_fns"):
            patch.setattr(twins, name, _end_to_end(test, f"compiles the whole decoder ({name})"))
        for module in (train_state, commands):
            patch.setattr(module, "init_state", _end_to_end(test, "initialises a train state"))
        yield


import jax  # noqa: E402  (after XLA_FLAGS: the session has exactly 8 simulated devices)

assert jax.device_count() == 8, f"expected 8 simulated CPU devices, got {jax.device_count()}"


def pytest_unconfigure(config):
    """The session's fork servers end with the process that made their folder: their sockets
    removed (each server exits within a tick of its loop), the folder with them."""
    if forkservers_created:
        folder = Path(os.environ[forked.FOLDER_VARIABLE])
        forked.stop_servers(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fresh_nnx():
    """NNX caches cleared around the test: the injected bug must be traced, and must not
    leak into later tests."""
    from parity.decoder import twins

    twins.clear_nnx_caches()
    yield
    twins.clear_nnx_caches()
