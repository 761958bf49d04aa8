"""tests/conftest.py's guard: a test not marked `slow` that starts a python, parity or migrate
process, runs the parity command in-process, builds the twins' pair, compiles the whole decoder
or initialises a train state fails, naming itself, in every run, not only in `make test-fast`.
None of these tests is marked `slow`, so each runs in `make test` as in `make test-fast`: a guard
that only watched `make test-fast` would let the process start (or the function run) here, and
they would fail in `make test`, where every change is tested."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import refused_program

BIN = Path(sys.executable).parent


def refused_here(request, what: str):
    """The guard's failure for this test: it names the test and what it did."""
    pattern = f"{re.escape(request.node.nodeid)} {re.escape(what)} but is not marked `slow`"
    return pytest.raises(pytest.fail.Exception, match=pattern)


@pytest.mark.parametrize(
    ("args", "program"),
    [
        ([sys.executable, "-c", "pass"], Path(sys.executable).name),
        (f"{sys.executable} -c pass", Path(sys.executable).name),
        ([str(BIN / "parity"), "--help"], "parity"),
        ((str(BIN / "migrate"), "--help"), "migrate"),
    ],
)
def test_a_test_not_marked_slow_cannot_start_a_process_of_the_project(request, args, program):
    with refused_here(request, f"starts a {program} process"):
        subprocess.run(args, capture_output=True, timeout=60, check=False)


def test_a_test_not_marked_slow_may_start_other_programs():
    assert subprocess.run(["true"], check=False).returncode == 0


def test_a_test_not_marked_slow_cannot_run_the_parity_command_in_process(request):
    from parity import cli

    with refused_here(request, "runs a parity command"):
        cli.run(["parity", "llama2-tiny", "--against=twin"])


def test_a_test_not_marked_slow_cannot_build_or_compile_the_whole_decoder(request):
    from migrate.checkpoints import commands, train_state
    from parity.decoder import session, twins

    with refused_here(request, "builds the twins' pair"):
        session.DecoderPair(None)
    for name in ("linen_initial_variables", "_linen_step", "_nnx_initial_state", "_nnx_step"):
        with refused_here(request, f"compiles the whole decoder ({name})"):
            getattr(twins, name)()
    for module in (train_state, commands):
        with refused_here(request, "initialises a train state"):
            module.init_state()


def test_the_guard_outlives_a_tests_own_monkeypatch_undo(request, monkeypatch):
    monkeypatch.undo()
    with refused_here(request, f"starts a {Path(sys.executable).name} process"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


@pytest.mark.parametrize(
    ("args", "program"),
    [
        (["python3.12", "-m", "pytest"], "python3.12"),
        ("/usr/bin/python -c pass", "python"),
        ([Path("/x/.venv/bin/parity"), "llama2-tiny"], "parity"),
        (["migrate"], "migrate"),
        (["git", "status"], None),
        ("make lint", None),
        (["/usr/bin/parityx"], None),
    ],
)
def test_the_programs_a_test_not_marked_slow_may_not_start(args, program):
    assert refused_program(args) == program
