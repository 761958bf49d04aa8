"""Compile-time parity (memory, FLOPs, collectives) and the pipeline's FLOP overhead."""

from __future__ import annotations

import functools

import pytest
from conftest import CONFIG_DIR, tiny

from parity import checks, cli


@functools.cache
def session(name: str, *overrides: str) -> checks.Session:
    return checks.Session(tiny(name, *overrides))


def test_compile_check_nnx_costs_what_linen_costs():
    result = checks.compile_cost(session("llama2-tiny"))
    assert result.passed, result.details
    by_field = {r["tensor"]: r for r in result.details}
    for field in ("temp_bytes", "flops", "argument_bytes", "output_bytes"):
        assert by_field[field]["ratio"] == 1.0, by_field[field]
        assert by_field[field]["linen"] > 0
    assert by_field["collectives: collective-permute"]["linen"] > 0  # the stage rotation
    assert "per device: linen args" in result.message


def test_compile_check_arguments_are_sharded_not_replicated():
    """Abstract params and optimizer moments carry their shardings: per-device argument bytes
    are the real arrays' (8-way over stage x fsdp), not a replicated copy."""
    s = session("llama2-tiny")
    compiled = s.train_start("linen")[2]
    result = checks.compile_cost(s)
    argument_bytes = next(r for r in result.details if r["tensor"] == "argument_bytes")
    assert argument_bytes["linen"] == compiled.memory_analysis().argument_size_in_bytes


@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-delay"])
def test_pipeline_flop_overhead_matches_theory(name):
    s = session(name)
    result = checks.efficiency(s)
    record = result.details[0]
    assert record["theoretical"] == pytest.approx(s.cfg.pipeline_flop_overhead)
    assert result.passed, result.message
    assert record["measured"] >= record["theoretical"]  # never less work than the schedule


@pytest.mark.slow
def test_7b_compile_check_runs_without_allocating_weights(capsys):
    argv = cli.FLAGS(["parity", "--checks=compile"])
    try:
        status = cli.run([*argv, str(CONFIG_DIR / "llama2-7b.yml")])
    finally:
        cli.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert status == cli.EXIT_PASS, out
    assert "linen args 10.51 GiB" in out and "nnx args 10.51 GiB" in out
