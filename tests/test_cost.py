"""Compile-time parity (memory, FLOPs, collectives), the pipeline's matmul work against the
schedule's theory, and the matmul FLOPs read off compiled HLO."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import CONFIG_DIR, tiny
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from migrate.common import sharding
from migrate.config import loading
from migrate.runtime import memory
from parity import cli
from parity.analysis import work
from parity.decoder import checks as decoder_checks
from parity.decoder import cost, efficiency
from parity.decoder.session import DecoderPair

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


@functools.cache
def session(name: str, *overrides: str) -> DecoderPair:
    return DecoderPair(tiny(name, *overrides))


@pytest.mark.slow
def test_compile_check_nnx_costs_what_linen_costs():
    result = decoder_checks.compile_cost(session("llama2-tiny"))
    assert result.passed, result.details
    by_field = {r["tensor"]: r for r in result.details}
    for field in ("temp_bytes", "flops", "argument_bytes", "output_bytes"):
        assert by_field[field]["ratio"] == 1.0, by_field[field]
        assert by_field[field]["linen"] > 0
    assert by_field["collectives: collective-permute"]["linen"] > 0  # the stage rotation
    assert "per device: linen args" in result.message
    for twin in ("linen", "nnx"):  # no reshard the partitioner had to replicate
        remats = by_field[f"partitioner: involuntary rematerialisations ({twin})"]
        assert remats[twin] == 0 and remats["remats"] == [] and remats["passed"]


@pytest.mark.slow
def test_compile_check_fails_on_a_reshard_the_partitioner_replicates(monkeypatch):
    """Seeded: the embedding reads its table as stored, split over fsdp (a layout the twins
    no longer use). The gradient's scatter then wants the rows split over embed, which the
    partitioner reaches only by replicating them: the compile check names it and fails."""
    from migrate.common import sharding as sharding_lib
    from parity.decoder import twins

    if jax.__version_info__ < (0, 12):
        pytest.skip(f"jax {jax.__version__}'s partitioner announces no rematerialisation here")

    def as_stored(names, mesh, cfg):
        return sharding_lib.named_sharding(tuple(names), mesh, cfg.logical_axis_rules)

    def forget():
        twins._linen_train_fns.cache_clear()
        twins.clear_nnx_caches()

    monkeypatch.setattr(sharding_lib, "gathered_over_fsdp", as_stored)
    forget()
    try:
        result = decoder_checks.compile_cost(DecoderPair(tiny("llama2-tiny")))
    finally:
        monkeypatch.undo()
        forget()
    assert not result.passed
    assert result.where == "partitioner: involuntary rematerialisations (linen)", result.where
    (remat, *_) = {r["tensor"]: r for r in result.details}[result.where]["remats"]
    assert remat["bytes"] > 0 and "'fsdp'" in remat["from"] and remat["to"]


@pytest.mark.slow
def test_compile_check_reports_aliased_and_peak_bytes_of_the_donated_train_step():
    """The train step donates parameters and optimizer state: per device the outputs reuse
    the arguments' buffers, and the peak is arguments + temp + outputs - aliased, reported
    under exactly these names for both twins and compared."""
    result = decoder_checks.compile_cost(session("llama2-tiny"))
    by_field = {r["tensor"]: r for r in result.details}
    for twin in ("linen", "nnx"):
        args, temp, out, alias, peak = (
            by_field[f][twin]
            for f in ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes", "peak_bytes")
        )
        cfg = session("llama2-tiny").cfg
        batch = 2 * 4 * cfg.global_batch_size * cfg.max_target_length // 2  # int32 x2, /fsdp
        assert alias == args - batch > 0  # every argument but the batch is donated
        assert 0 < out - alias < 1024  # what is not aliased: the metrics (and tuple tables)
        assert peak == args + temp + out - alias
    for field in ("alias_bytes", "peak_bytes"):
        assert by_field[field]["gated"] and by_field[field]["passed"]
        assert by_field[field]["ratio"] == 1.0
    assert "aliased" in result.message and "peak" in result.message
    # The reshards into and out of the pipeline are counted: the gather into it across stages.
    outside = {r["tensor"]: r for r in result.details if r["tensor"].startswith("outside")}
    assert outside["outside the loop forward: all-gather across stages"]["nnx"] >= 1
    assert all(r["passed"] and r["linen"] == r["nnx"] for r in outside.values())


@pytest.mark.slow
def test_collectives_outside_the_loops_and_in_their_bodies_partition_the_program():
    """Every collective of the compiled step is either in a pipeline loop's body or outside
    the loops (`hlo.outside_loops`, where the reshards into and out of the pipeline are
    counted), never both, never neither; and outside the loops there are both directions."""
    cfg = tiny("llama2-tiny")
    compiled = cost.compile_train_step(cfg, sharding.make_mesh(cfg), "nnx")
    in_loops = sum(len(loop.collectives) for loop in compiled.loops)
    assert len(compiled.loops) == 2 and in_loops > 0
    assert in_loops + len(compiled.outside_loops) == sum(compiled.collectives.values())
    assert {direction for direction, _ in compiled.outside_loops} == {"forward", "backward"}


@pytest.mark.slow
def test_compile_check_arguments_are_sharded_not_replicated():
    """Abstract params and optimizer moments carry their shardings: per-device argument bytes
    are the real arrays' (8-way over stage x fsdp), not a replicated copy."""
    s = session("llama2-tiny")
    compiled = s.compiled("linen")  # the train step, compiled for the Linen twin's own weights
    result = decoder_checks.compile_cost(s)
    argument_bytes = next(r for r in result.details if r["tensor"] == "argument_bytes")
    assert argument_bytes["linen"] == compiled.memory_analysis().argument_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama2-tiny", "llama2-tiny-delay", "llama2-tiny-tp"])
def test_pipeline_matmul_work_matches_theory_exactly(name):
    s = session(name)
    result = decoder_checks.efficiency(s)
    record = result.details[0]
    assert record["theoretical"] == pytest.approx(s.cfg.pipeline_flop_overhead)
    # Dot FLOPs are exact integers: the pipeline does the schedule's work and not a FLOP more.
    assert record["measured"] == record["theoretical"], record
    assert result.passed, result.message
    # The loop's own elementwise work is reported on its own, beside the matmul work.
    assert 0 < record["loop_elementwise_overhead"] < 0.05
    assert record["pipeline_flops"] > record["pipeline_dot_flops"]


def test_efficiency_catches_matmul_work_replicated_over_the_tensor_axis():
    """With no logical axis mapped to `tensor`, both devices of the tensor axis compute every
    matmul of their stage: real waste, which the measurement counts (twice the theory)."""
    cfg = tiny("llama2-tiny-tp")
    rules = tuple(
        (name, None if target == "tensor" else target) for name, target in cfg.logical_axis_rules
    )
    replicated = cfg.replace(logical_axis_rules=rules)
    measured = efficiency.pipeline_efficiency(replicated, sharding.make_mesh(replicated))
    assert measured.measured_overhead == 2 * measured.theoretical_overhead
    assert measured.relative_error > decoder_checks.EFFICIENCY_TOLERANCE


def _flops(fn, *args) -> tuple[float, float, float]:
    """(dot_flops of the compiled HLO, of the unoptimised HLO, XLA's cost-analysis FLOPs)."""
    lowered = jax.jit(fn).lower(*args)
    compiled = lowered.compile()
    analysed = compiled.cost_analysis()
    analysed = analysed[0] if isinstance(analysed, (list, tuple)) else analysed
    return (
        work.dot_flops(compiled.as_text()),
        work.dot_flops(lowered.as_text(dialect="hlo")),
        analysed["flops"],
    )


@pytest.mark.parametrize(
    ("fn", "shapes", "expected"),
    [
        (jnp.matmul, [(8, 16), (16, 32)], 2 * 8 * 32 * 16),
        (
            lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
            [(3, 8, 16), (3, 16, 4)],
            2 * 3 * 8 * 4 * 16,
        ),
        (
            lambda x, k: jax.lax.conv_general_dilated(
                x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
            ),
            [(2, 10, 10, 3), (3, 3, 3, 5)],
            2 * (2 * 8 * 8 * 5) * (3 * 3 * 3),
        ),
    ],
    ids=["matmul", "batched", "convolution"],
)
def test_dot_flops_counts_matmul_work_as_xla_does(fn, shapes, expected):
    args = [jnp.ones(shape, jnp.float32) for shape in shapes]
    compiled, unoptimised, analysed = _flops(fn, *args)
    assert compiled == unoptimised == analysed == expected


def test_dot_flops_counts_a_loop_body_once_and_ignores_elementwise_work():
    a, b = jnp.ones((8, 16)), jnp.ones((16, 16))
    body = lambda c, _: (jnp.tanh(c @ b) + 1.0, None)
    compiled, _, analysed = _flops(lambda a: jax.lax.scan(body, a, None, length=10)[0], a)
    assert compiled == 2 * 8 * 16 * 16  # once, as XLA's cost analysis counts it
    assert analysed > compiled  # tanh and add are FLOPs, not matmul work


def _xla_flops(compiled) -> float:
    analysed = compiled.cost_analysis()
    return (analysed[0] if isinstance(analysed, (list, tuple)) else analysed)["flops"]


@pytest.mark.parametrize("reduce", ["sum", "max", "window"])
def test_executed_work_counts_by_xla_s_rules_and_runs_loops_to_their_trip_count(reduce):
    """A loop body (matmul, compare and select, a reduction, converts): on the loop-free
    (unrolled) program the count is XLA's cost analysis, FLOP for FLOP; on the rolled one, with
    the body counted once, it is XLA's count again, and run to the trip count its matmul work
    is the unrolled program's. The efficiency check reads the rolled program."""
    w = jnp.ones((16, 16))
    reductions = {
        "sum": lambda y: y.sum(axis=1, keepdims=True),
        "max": lambda y: y.max(axis=1, keepdims=True),
        "window": lambda y: jax.lax.reduce_window(y, 0.0, jax.lax.add, (1, 16), (1, 16)),
    }

    def body(c, _):
        y = jnp.where(c @ w > 0, c @ w, 0.5 * c)
        return (y - reductions[reduce](y)).astype(jnp.bfloat16).astype(jnp.float32), None

    def program(unroll):
        return jax.jit(lambda a: jax.lax.scan(body, a, None, length=6, unroll=unroll)[0])

    a = jnp.ones((8, 16))
    rolled = program(1).lower(a).compile()
    unrolled = program(True).lower(a).compile()
    assert "while(" in rolled.as_text() and "while(" not in unrolled.as_text()
    performed = work.executed(rolled.as_text())
    assert performed.dot_flops == 6 * 2 * 8 * 16 * 16 == work.dot_flops(unrolled.as_text())
    assert work.executed(unrolled.as_text()).flops == _xla_flops(unrolled)
    assert work.executed(rolled.as_text(), loops_once=True).flops == _xla_flops(rolled)
    # XLA optimises the two forms apart (fusion, common subexpressions): close, not equal.
    assert performed.flops == pytest.approx(_xla_flops(unrolled), rel=0.05)
    assert performed.flops > 5 * _xla_flops(rolled)


def test_executed_work_refuses_a_loop_of_unknown_trip_count():
    body = lambda c: c @ jnp.ones((16, 16))
    loop = jax.jit(lambda a: jax.lax.while_loop(lambda c: c.sum() < 1e6, body, a))
    with pytest.raises(ValueError, match="known trip count"):
        work.executed(loop.lower(jnp.ones((8, 16))).compile().as_text())


def test_dot_flops_of_a_sharded_program_are_per_device():
    mesh = jax.make_mesh((8,), ("x",))
    a = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    b = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    compiled, unoptimised, _ = _flops(jnp.matmul, a, b)
    assert unoptimised == 2 * 64 * 32 * 16 and compiled == unoptimised / 8


@pytest.mark.slow
def test_7b_compile_check_runs_without_allocating_weights(capsys):
    argv = cli.FLAGS(["parity", "--checks=compile"])
    try:
        status = cli.run([*argv, str(CONFIG_DIR / "llama2-7b.yml")])
    finally:
        cli.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert status == cli.EXIT_PASS, out
    # Weights and both AdamW moments in float32, every one sharded 8 ways (the embedding and
    # logits tables over stages too: nothing replicated), all of it donated.
    cfg = loading.load_config(CONFIG_DIR / "llama2-7b.yml")
    state = f"{3 * 4 * memory.parameter_count(cfg) / 8 / 2**30:.2f} GiB"
    for twin in ("linen", "nnx"):
        assert f"{twin} args {state} + temp " in out, out
        assert f"- aliased {state} = peak " in out, out


def test_executed_work_counts_a_called_computation_once():
    """Unoptimised HLO calls a nested jit through `call(..., to_apply=...)`: its matmul counts
    once (a reducer's `to_apply` counts per reduced element instead)."""
    inner = jax.jit(lambda a, b: a @ b)
    lowered = jax.jit(lambda a, b: inner(a, b).sum()).lower(jnp.ones((8, 16)), jnp.ones((16, 4)))
    text = lowered.as_text(dialect="hlo")
    assert " call(" in text
    assert work.dot_flops(text) == 2 * 8 * 4 * 16


def test_executed_work_refuses_text_it_cannot_read_whole():
    """A matmul line the parser cannot read (here a dynamic dimension), or a call to a
    computation the text lacks, raises: either would otherwise count as no work."""
    text = jax.jit(jnp.matmul).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
    assert work.dot_flops(text) == 2 * 8 * 4 * 16
    dot_line = next(line for line in text.splitlines() if " dot(" in line)
    unreadable = text.replace(dot_line, dot_line.replace("f32[8,4]", "f32[<=8,4]", 1))
    with pytest.raises(ValueError, match="matmuls"):
        work.executed(unreadable)
    callee = re.search(r"calls=%?([\w.\-]+)", text)
    if callee:  # XLA:CPU wraps the dot in a fusion
        with pytest.raises(ValueError, match="not in the HLO text"):
            work.executed(text.replace(f"calls={callee[0][6:]}", "calls=%missing", 1))
