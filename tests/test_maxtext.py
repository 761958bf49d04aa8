"""The gate on a migration this project did not write: MaxText's own Linen decoder (0.2.3)
against its NNX port (0.2.5), each release in its own environment (`make maxtext-envs`), its
model built from MaxText's own base.yml and the config's keys (`parity --maxtext`). Skipped,
saying why, where the environments were not built."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hostile import REPO, refused, run

from migrate import errors
from parity.engine import registry, run_loop
from parity.engine.registry import Front
from parity.maxtext import gate_config

pytestmark = pytest.mark.slow
CONFIGS = REPO / "configs" / "maxtext"
TESTS = str(Path(__file__).resolve().parent)
MISSING = [s for s in gate_config.RELEASES if gate_config.default_python(s) is None]
if sys.version_info < (3, 12):  # MaxText needs 3.12; its gate runs on the default stack (CI time)
    WHY = "the MaxText gate runs on the default stack (Python 3.12)"
else:
    WHY = f"MaxText environments not built ({MISSING}): run make maxtext-envs"
needs_envs = pytest.mark.skipif(bool(MISSING) or sys.version_info < (3, 12), reason=WHY)


def gate(tmp_path, config: str, *args: str) -> tuple[int, dict, str]:
    report = tmp_path / "report.json"
    result = run(
        "parity", "--maxtext", str(CONFIGS / config), f"--json={report}", "--steps=2", *args,
        timeout=900,
    )  # fmt: skip
    data = json.loads(report.read_text()) if report.exists() else {}
    return result.returncode, data, result.stderr.decode()


@needs_envs
@pytest.mark.parametrize("config", ["pp4.yml", "circular.yml"])
def test_maxtext_linen_and_nnx_releases_agree(config, tmp_path):
    """Every default check passes: the weights cross both ways bit-exact, each release's own
    initialisation matches in names (the declared `embed_attn` rename applied), shapes and
    statistics, logits, loss and every gradient agree bit for bit (two microbatches per stage,
    circular, included), placements and compiled shardings agree, and two AdamW steps of
    MaxText's optimizer agree leaf by leaf; and each release's pipelined decoder equals its own
    decoder without pipelining (`pipeline`) within the reshaped tier, on both releases."""
    status, report, err = gate(tmp_path, config)
    assert status == 0, err[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(registry.defaults(Front.MAXTEXT))
    for name in ("forward", "grads", "train"):
        assert checks[name]["message"] == "identical computation: bit-exact", name
    pipeline = checks["pipeline"]
    assert pipeline["status"] == "passed", pipeline["message"]
    assert pipeline["details"][0]["whose"] == "every release holds to its own reference"
    by_release = {}
    for record in pipeline["details"][1:]:
        by_release.setdefault(record["release"], []).append(record)
    assert sorted(by_release) == ["0.2.3", "0.2.5"]
    for records in by_release.values():  # logits, loss, norm and every gradient, not bit-exact
        assert any(r["tensor"].endswith("/logits") for r in records)
        assert 0 < max(r["max_rel"] for r in records) <= pipeline["worst"]["tolerance"]
    assert "maxtext 0.2.3" in err and "maxtext 0.2.5" in err
    assert {side: report["sides"][side]["maxtext"] for side in ("linen", "nnx")} == (
        gate_config.RELEASES
    )
    # every program ran in a worker: its compile (or cache read) counts in the run's cost
    assert {p.partition("/")[0] for p in report["cost"]["programs"]} == {"linen", "nnx"}


@pytest.fixture(scope="module")
def linen_release():
    """One Linen (0.2.3) worker on pp4 for every injected NNX bug: the bugs patch the NNX release
    only, so the clean side is started and compiled once (CI time)."""
    from parity.maxtext.release_pair import start_side
    from parity.remote.client import WorkerSet
    from parity.remote.environments import Environment

    config = gate_config.load(CONFIGS / "pp4.yml", [])
    workers = WorkerSet()
    try:
        environment = Environment(gate_config.default_python("linen"))
        yield config, start_side(config, "linen", environment, workers)
    finally:
        workers.close()


@needs_envs
@pytest.mark.parametrize(
    ("bug", "check", "where", "unmoved", "inside"),
    [
        ("wrong_norm_axis_name", "init", "decoder/decoder_norm/scale: names", None, None),
        # a value bug: `layers` names the module whose output first differs
        ("scaled_logits", "forward", "logits", None, "decoder"),
        # the folded 1/sqrt(head_dim) dropped: each release's own init differs there; run on
        # the same weights the two compute the same logits
        ("dropped_query_scale", "init", "self_attention/query/kernel", "forward", None),
        # the same numbers, more memory: only the compile check sees it
        ("saved_everything_in_the_pipeline", "compile", "temp_bytes", "forward", None),
        # the first pipelined module whose weights differ between stages (the norms' scales
        # are all ones at initialisation), in the first iteration's first stage
        (
            "reversed_stage_order",
            "forward",
            "logits",
            None,
            "decoder/pipeline_module/layers/self_attention/query iteration 0 stage 0",
        ),
    ],
)
def test_a_bug_injected_in_the_nnx_release_is_caught_at_its_place(
    bug, check, where, unmoved, inside, linen_release
):
    """Each bug fails the check that sees it, at its place; a value bug is also located by
    `layers` at a module path inside the model (a pipelined one with its iteration and
    stage), and the check that cannot see it passes."""
    from parity.engine import numeric
    from parity.maxtext import compile_check
    from parity.maxtext.release_pair import MaxTextPair
    from parity.remote.environments import Environment

    config, linen = linen_release
    environments = {
        "linen": Environment(gate_config.default_python("linen")),
        "nnx": Environment(
            gate_config.default_python("nnx"), patch=f"maxtext_bugs:{bug}", extra_paths=(TESTS,)
        ),
    }
    table = {
        "init": numeric.init,
        "forward": numeric.forward,
        "compile": compile_check.compile_check,
    }
    pair = MaxTextPair(config, environments, started={"linen": linen})
    try:
        result = table[check](pair)
        control = table[unmoved](pair) if unmoved else None
        located = run_loop.call(pair, "layers") if inside else None
        pair_checks = {"pipeline": run_loop.call(pair, "pipeline")} if "stage" in bug else {}
    finally:
        pair.workers["nnx"].close()
    assert result.status == "failed", result.message
    assert where in result.where, result.where
    if control is not None:
        assert control.status == "passed", control.message
    if located is not None:
        assert located.status == "failed" and located.where == inside, located.where
        (first,) = [r for r in located.details if r["tensor"] == inside]
        assert first["tier"] == "beyond" and first["module"] == inside.split(" ")[0]
    if bug == "reversed_stage_order":
        # and each release against its own reference (`pipeline`): 0.2.3 holds, 0.2.5 alone
        # parts from its own decoder without pipelining, at the same place (its drill-down):
        # a bug of the port that the oracle alone would have found
        oracle = pair_checks["pipeline"]
        assert oracle.status == "failed", oracle.message
        summary = oracle.details[0]
        assert summary["failing_releases"] == ["0.2.5"]
        assert summary["whose"] == (
            "maxtext 0.2.5 alone parts from its own reference (maxtext 0.2.3 holds)"
        )
        assert summary["parts_at"] == {
            "0.2.5": "maxtext 0.2.5: decoder/pipeline_module/layers/self_attention/query "
            "iteration 0 stage 0 (layer 0, microbatch 0, repeat 0)"
        }


@needs_envs
def test_a_release_that_cannot_build_what_the_other_builds_is_a_finding(linen_release):
    """The NNX release's own code raises as it builds the config (a key its pipeline reads,
    missing: `maxtext_bugs.pipeline_reads_a_missing_key`) where the Linen release builds it: a
    migration regression, failed (exit 1), naming the release, MaxText's file and line and
    what the other release did; never an internal error of this tool."""
    from parity.maxtext import release_fault
    from parity.maxtext.release_pair import MaxTextPair
    from parity.remote.environments import Environment

    config, linen = linen_release
    environments = {
        "linen": Environment(gate_config.default_python("linen")),
        "nnx": Environment(
            gate_config.default_python("nnx"),
            patch="maxtext_bugs:pipeline_reads_a_missing_key",
            extra_paths=(TESTS,),
        ),
    }
    with pytest.raises(release_fault.Faults) as raised:
        MaxTextPair(config, environments, started={"linen": linen})
    assert raised.value.bad_input() is None
    result = raised.value.result("build")
    assert result.status == "failed"
    (record,) = result.details
    assert record["release"] == "0.2.5" and record["side"] == "nnx"
    assert record["raised_at"].startswith("maxtext/layers/"), record["raised_at"]
    assert record["error"].startswith("AttributeError: ")
    assert "num_pipeline_microbatches" in record["error"]
    assert record["other_release"] == "maxtext 0.2.3 (the linen side) completes it"
    assert "a migration regression" in result.message


def test_a_maxtext_config_is_validated_before_jax(tmp_path):
    """A base of the user's beside the config wins over the shipped one: here one that lacks
    the keys every gate config must set."""
    (tmp_path / "base.yml").write_text("maxtext:\n  decoder_block: llama2\n")
    bad = tmp_path / "bad.yml"
    bad.write_text("maxtext:\n  vocab_size: 128\n")
    refused(
        run("parity", "--maxtext", str(bad), timeout=30),
        errors.EXIT_USAGE,
        "must set per_device_batch_size, max_target_length",
    )
    bad.write_text("model_name: x\n")
    refused(run("parity", "--maxtext", str(bad), timeout=30), errors.EXIT_USAGE, "maxtext:")
