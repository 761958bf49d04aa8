"""The `parity` command: exit codes, reports, golden files, and every check on every shipped
tiny config (the config matrix)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import jax
import pytest
from conftest import CONFIG_DIR, FAST_CODEGEN, SHIPPED_TINY_CONFIGS, tiny
from rich.console import Console

from migrate import cli as migrate_cli
from migrate import errors
from migrate.common import placement
from migrate.runtime import devices
from parity import cli, run_inputs
from parity.decoder import cost
from parity.engine import registry
from parity.engine.registry import Front
from parity.engine.result import CheckResult
from parity.reports import report, run_facts
from parity.run_options import RunOptions

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = "llama2-tiny"  # what `make parity` runs (Makefile's CONFIG)


def parity_command() -> list[str]:
    """The installed console script, as users run it (module form when not installed)."""
    script = Path(sys.executable).parent / "parity"
    return [str(script)] if script.exists() else [sys.executable, "-m", "parity.cli"]


def run_parity(
    *args: str, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*parity_command(), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or os.environ.copy(),
    )


def default_codegen_env() -> dict[str, str]:
    """This environment with XLA's default code generation (the suite's faster, unoptimised
    machine code removed: `conftest.FAST_CODEGEN`)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(FAST_CODEGEN, "")
    return {**os.environ, "XLA_FLAGS": " ".join(flags.split())}


def run_in_process(*args: str) -> int:
    argv = cli.FLAGS(["parity", *args])
    try:
        return cli.run(argv)
    finally:
        cli.FLAGS.unparse_flags()


FILE = "configs/base.yml"  # a file where a directory is wanted


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "missing CONFIG"),
        (("configs/nope.yml",), "config file not found"),
        (("configs/llama2-tiny.yml", "num_pipeline_microbatchs=4"), "did you mean"),
        (("configs/llama2-tiny.yml", "num_pipeline_microbatches=6"), "multiple of S"),
        (("configs/llama2-tiny.yml", "--checks=forwrd"), "unknown checks ['forwrd']"),
        (("configs/llama2-tiny.yml", "ici_data_parallelism=2"), "needs 16 devices"),
        (("configs/llama2-tiny.yml", f"--compilation_cache_dir={FILE}"), "is not a directory"),
        (("--maxtext", "configs/maxtext/pp4.yml", f"--compilation_cache_dir={FILE}/x"), "is not"),
        # report paths and the golden file: refused before any JAX work, --dry_run too
        (("llama2-tiny", "--json=/proc/x.json", "--dry_run"), "cannot write"),
        (("llama2-tiny", "--plot=p.png", "--checks=forward", "--dry_run"), "do not include train"),
        (("llama2-tiny", "--plot=p.gif", "--dry_run"), "unknown image format '.gif'"),
        (("llama2-tiny", "--golden=/nowhere/golden", "--require_golden"), "--update_golden"),
    ],
)
def test_usage_and_config_errors_exit_2_with_a_message(args, message, capsys):
    assert run_in_process(*args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_bad_flag_exits_2_without_traceback():
    result = run_parity("configs/llama2-tiny.yml", "--steps=-1", timeout=120)
    assert result.returncode == 2
    assert "parity: error:" in result.stderr and "Traceback" not in result.stderr


def test_simulated_devices_are_requested_before_jax(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # pretend JAX is not imported yet
    del sys.modules["jax"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4")
    devices.ensure_simulated_devices(16)
    assert os.environ["XLA_FLAGS"] == ("--xla_cpu_foo=1 --xla_force_host_platform_device_count=16")
    devices.ensure_simulated_devices(8)  # already enough: unchanged
    assert os.environ["XLA_FLAGS"].endswith("=16")
    with pytest.raises(devices.DeviceCountError, match="at most 512 simulated CPU devices"):
        devices.ensure_simulated_devices(devices.MAX_SIMULATED_DEVICES + 1)
    assert os.environ["XLA_FLAGS"].endswith("=16")  # unchanged


def test_golden_diff_lists_per_key_differences():
    golden = {
        "nnx/a": {"names": ["embed"], "shape": [4], "spec": "P('fsdp',)"},
        "nnx/gone": {"names": [], "shape": [], "spec": "P()"},
    }
    current = {
        "nnx/a": {"names": ["mlp"], "shape": [4], "spec": "P('tensor',)"},
        "nnx/new": {"names": [], "shape": [], "spec": "P()"},
    }
    from parity.decoder.golden import golden_differences

    assert golden_differences(golden, current) == [
        "~ nnx/a: names: golden ['embed'] -> current ['mlp']",
        "~ nnx/a: spec: golden P('fsdp',) -> current P('tensor',)",
        "- nnx/gone: in golden, not in current",
        "+ nnx/new: new, not in golden: {'names': [], 'shape': [], 'spec': 'P()'}",
    ]


TWIN_CHECKS = ("roundtrip", "forward", "grads", "train", "layers")
# Every program a run compiles is one the gate or the twins jit (the twins' init, forward and
# backward, train and eval steps, the drill-down's stages, the efficiency program). An eager op
# is a program too, named after its primitive (`convert_element_type`, `_multi_slice`,
# `broadcast_in_dim`, ...): glue that belongs inside one of these. The configs run in a
# subprocess (the default, the 16-device mesh) see every program; in-process ones only those
# new to this pytest process.
GATE_PROGRAMS = {
    f"jit({name})"
    for name in (
        "init", "create", "step", "init_fn", "train_step", "<lambda>", "apply",
        "cross_entropy_loss", "plain_layer", "after", "_as_float32",
    )
}  # fmt: skip


DEFAULT_STACK = (3, 12)  # Python of the default stack (README, Stacks)


def matrix_params() -> list:
    """The config matrix's configs; the default config's run is in the oldest stack's
    compatibility layer (its one `--checks=all` run)."""
    compat = lambda name: pytest.mark.compat if name == DEFAULT_CONFIG else ()
    return [pytest.param(name, marks=compat(name)) for name in SHIPPED_TINY_CONFIGS]


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix_params())
def test_every_check_passes_on_every_shipped_tiny_config(name, tmp_path, capsys):
    """The config matrix CI gates: every check (`--checks=all`) and every report, on every
    shipped tiny config; on its report, each side's pipeline against its reference leaf by leaf
    and the loop's collectives at their minimum (the runs that prove the checks pass serve
    these too). Meshes that fit this session's devices run in-process (sharing compiled
    programs with the other tests); larger ones run the console script, which requests its own
    simulated devices, and so does the default config on the default stack, with XLA's default
    code generation, as users run it (the suite's own is unoptimised: conftest.FAST_CODEGEN; on
    the oldest stack it runs in-process, sharing the compatibility layer's programs)."""
    cfg = tiny(name)
    json_path, junit_path, plot_path = (tmp_path / f for f in ("r.json", "r.xml", "r.png"))
    args = (
        str(CONFIG_DIR / f"{name}.yml"),
        "--checks=all",
        "--steps=2",
        f"--json={json_path}",
        f"--junit={junit_path}",
        f"--plot={plot_path}",
        f"--golden={tmp_path / 'golden'}",
        "--norequire_golden",  # written, under CI too
    )
    if name == DEFAULT_CONFIG and sys.version_info >= DEFAULT_STACK:
        result = run_parity(*args, env=default_codegen_env())
        status, out, err = result.returncode, result.stdout, result.stderr
    elif cfg.num_devices <= jax.device_count():
        status = run_in_process(*args)
        out, err = capsys.readouterr()
    else:
        result = run_parity(*args)
        status, out, err = result.returncode, result.stdout, result.stderr
    assert status == cli.EXIT_PASS, out + err[-3000:]
    assert "PASS" in out and "FAIL" not in out
    checks_run = len(registry.names(Front.TWINS)) + 1  # and golden
    assert out.rstrip().splitlines()[-1] == f"PASS: {checks_run} checks"
    assert "[parity] --golden: no golden file at" in err  # written, said
    for step in (1, 2):  # the train check reports every step
        assert f"[parity] train step {step}/2: ok" in err

    data = json.loads(json_path.read_text())
    assert data["version"] == report.JSON_SCHEMA_VERSION and data["passed"] is True
    assert data["config"] == name
    run = data["run"]  # what ran
    assert (run["config_file"], run["overrides"], run["adjusted"]) == (args[0], [], [])
    assert run["weights"] == {"source": "init", "seed": cfg.seed}
    assert run["resolved_config"]["derived"]["num_microbatches"] == cfg.num_microbatches
    assert run["versions"]["jax"] == jax.__version__ and run["versions"]["flax"]
    checks = {c["name"]: c for c in data["checks"]}
    assert list(checks) == [*registry.names(Front.TWINS), "golden"]
    assert set(data["cost"]["programs"]) <= GATE_PROGRAMS, data["cost"]["programs"]
    for check in data["checks"]:
        assert set(check["worst"]) == {"metric", "value", "tolerance", "where"}
        assert check["worst"]["value"] <= check["worst"]["tolerance"]
    for name_ in TWIN_CHECKS:  # Linen vs NNX: zero difference, whatever the dtype
        assert checks[name_]["worst"]["value"] == checks[name_]["worst"]["tolerance"] == 0
    assert_pipeline_compared_every_gradient(cfg, checks["pipeline"]["details"])
    assert_loop_communicates_at_the_minimum(cfg, checks["compile"])
    sharding = {d["tensor"]: d for d in checks["sharding"]["details"]}
    for side in ("input", "output"):
        record = sharding[f"train step {side}: params/decoder_norm/scale"]
        assert record["linen"] == record["nnx"] == record["declared"] == "P(None,)"
    (efficiency,) = checks["efficiency"]["details"]
    assert efficiency["measured"] == efficiency["theoretical"] == placement.work_overhead(cfg)
    assert "same optimised program" in checks["compile"]["message"]
    assert [s["step"] for s in checks["train"]["steps"]] == [0, 1]

    suite = ET.parse(junit_path).getroot().find("testsuite")
    assert suite.get("tests") == str(len(checks)) and suite.get("failures") == "0"
    assert [c.get("name") for c in suite.findall("testcase")] == list(checks)
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "golden" / f"{name}.sharding.json").exists()


def assert_pipeline_compared_every_gradient(cfg, details: list[dict]) -> None:
    """Each side's pipeline against its reference: the loss, the logits, the gradient norm and
    every gradient leaf in the reference layout (a llama2 layer's 9, a mixture-of-experts
    layer's 10, and the norm, the embedding and an untied head outside them)."""
    records = {d["tensor"]: d for d in details}
    grads = {
        side: {
            t.removeprefix(f"{side}/grads/params/")
            for t in records
            if t.startswith(f"{side}/grads/params/")
        }
        for side in ("linen", "nnx")
    }
    assert grads["linen"] == grads["nnx"], grads
    outside = {"decoder_norm/scale", "token_embedder/embedding"}
    outside |= set() if cfg.logits_via_embedding else {"logits_dense/kernel"}
    in_layers = {t for t in grads["linen"] if t.startswith("layers/")}
    assert grads["linen"] - in_layers == outside, sorted(grads["linen"])
    assert len(in_layers) == (10 if cfg.num_experts > 1 else 9), sorted(in_layers)
    for side in ("linen", "nnx"):
        for tensor in ("loss", "logits", "grad_norm"):
            assert records[f"{side}/{tensor}"]["passed"], (side, tensor)


def assert_loop_communicates_at_the_minimum(cfg, compile_check: dict) -> None:
    """The pipeline loop's body, both ways, moves activations across stages with exactly one
    collective-permute and nothing else; ag-once leaves no gather in it, ag-per-repeat moves
    its gathers to the repeat body (the compiled train step the compile check reads)."""
    assert cost.loop_body_minimum(cfg), "a shipped config without a scanned pipeline loop"
    by_tensor = {r["tensor"]: r for r in compile_check["details"]}
    for direction in cost.DIRECTIONS:
        rotation = by_tensor[f"loop body {direction}: collective-permute across stages"]
        assert rotation["linen"] == rotation["nnx"] == rotation["minimum"] == 1
        across = [t for t in by_tensor if t.startswith(f"loop body {direction}:") and "across" in t]
        assert across == [f"loop body {direction}: collective-permute across stages"], across
    if cfg.pipeline_fsdp_ag_once:
        assert by_tensor["loop body forward: all-gather over fsdp (ag-once)"]["nnx"] == 0
    if cfg.pipeline_fsdp_ag_per_repeat:
        for direction in cost.DIRECTIONS:
            in_loop = by_tensor[f"loop body {direction}: all-gather over fsdp (ag-per-repeat)"]
            assert in_loop["linen"] == in_loop["nnx"] == 0
    if cfg.pipeline_fsdp_ag_per_repeat and cfg.ici_fsdp_parallelism > 1 and cfg.num_repeats > 2:
        # The window moves (R > 2): one gather per weight of the window per block forward, the
        # same again backward, recomputed under the block's remat (XLA's combiner may merge).
        per_repeat = by_tensor["repeat body forward: all-gather over fsdp (ag-per-repeat)"]
        assert per_repeat["linen"] == per_repeat["nnx"] >= 1
    assert "loop body across stages fwd/bwd: collective-permute 1/1" in compile_check["message"]


@pytest.mark.slow
def test_golden_mismatch_fails_and_prints_the_differences(tmp_path):
    golden_dir = tmp_path / "golden"
    args = (str(CONFIG_DIR / "llama2-tiny.yml"), "--checks=roundtrip", f"--golden={golden_dir}")
    args += ("--norequire_golden",)  # the first run writes it, under CI too
    assert run_in_process(*args) == cli.EXIT_PASS  # written
    assert run_in_process(*args) == cli.EXIT_PASS  # compared, equal
    path = golden_dir / "llama2-tiny.sharding.json"
    golden = json.loads(path.read_text())
    golden["nnx/decoder_norm/scale"]["names"] = ["embed"]
    path.write_text(json.dumps(golden))
    junit = tmp_path / "r.xml"
    assert run_in_process(*args, f"--junit={junit}") == cli.EXIT_FAIL
    failure = ET.parse(junit).getroot().find("testsuite/testcase[@name='golden']/failure")
    assert "nnx/decoder_norm/scale: names: golden ['embed'] -> current ['norm']" in (
        failure.get("message")
    )
    assert run_in_process(*args, "--update_golden") == cli.EXIT_PASS
    assert run_in_process(*args) == cli.EXIT_PASS


# ------------------------------------------------------------------ what a report says


def passing(name: str, where: str = "linen-init/grads/params/decoder_norm/scale") -> CheckResult:
    return CheckResult(name, True, "max_rel", 0.0, 0.0, where, message="bit-exact")


FAILING_WHERE = "linen-init/grads/params/pipeline/layers/layers_0/self_attention/query/kernel"


def test_the_table_fits_the_terminal_names_failures_only_and_ends_with_the_verdict():
    failed = CheckResult("grads", False, "max_rel", 0.5, 0.0, FAILING_WHERE, status="failed")
    results = [passing("roundtrip"), failed, passing("train", "step 0")]
    cost = {"compilations": 12, "cache_reads": 3, "compile_seconds": 10.5, "run_seconds": 2.25,
            "compare_seconds": 0.5, "wall_seconds": 13.0, "programs": []}  # fmt: skip
    for width in (80, 100, 160):
        sink = io.StringIO()
        console = Console(file=sink, width=width)
        report.render_table(results, "llama2-tiny ici_tensor_parallelism=2", console, [cost] * 3)
        lines = sink.getvalue().rstrip().splitlines()
        assert max(map(len, lines)) <= width, (width, sink.getvalue())
        assert "llama2-tiny ici_tensor_parallelism=2" in sink.getvalue()
        table = [line for line in lines if line.startswith("│")]
        where = "".join(line.split("│")[5].strip() for line in table)  # a path broken after a /
        assert where == FAILING_WHERE, (width, sink.getvalue())  # only on the failing row
        assert lines[-1] == "FAIL: grads (exit 1)"
        assert ("cost: 36 (9 cached) compiles" in sink.getvalue()) == (width <= 100), width
    assert report.wrap_path("a/bb/ccc", 4) == "a/\nbb/\nccc"
    assert report.verdict_line(results[:1] + results[2:]) == "PASS: 2 checks"
    errored = CheckResult("train", False, "error", 0, 0, "-", status="errored")
    skipped = CheckResult("pipeline", True, "max_rel", 0, 0, "-", status="skipped")
    assert report.verdict_line([failed, errored]) == "FAIL: grads; ERROR: train (exit 4)"
    assert report.verdict_line([passing("forward"), skipped]) == "PASS: 2 checks, 1 skipped"
    assert report.verdict_line([skipped], errors.EXIT_USAGE) == (
        "PASS: 1 check, 1 skipped; a report was not written (exit 2)"
    )
    text = report.text_report(results, "block").splitlines()
    assert text[-1] == "FAIL: grads (exit 1)"
    assert text[1:4] == [
        "  check      verdict  worst        tolerance  where",
        "  roundtrip  PASS     max_rel=0    0",
        f"  grads      FAIL     max_rel=0.5  0          {FAILING_WHERE}",
    ]


def test_the_json_report_says_what_ran_and_what_a_checkpoint_changed(capsys):
    """A checkpoint recorded with S=8 under llama2-tiny (S=4, M=8) and the delay asked for: its
    layout wins and M=8 no longer fits the delay, so M resets to -1 (16); each key said."""
    layout = {"ici_pipeline_parallelism": 8, "dcn_pipeline_parallelism": 1,
              "num_layers_per_pipeline_stage": 1, "num_pipeline_repeats": 1,
              "scan_layers_per_stage": False, "pipeline_parallel_layers": -1}  # fmt: skip
    stored = {"layout_keys": layout, "weight_dtype": "float32", "layout": "pipeline",
              "framework": "nnx", "step": 3, "model_name": "llama2-tiny"}  # fmt: skip
    path = CONFIG_DIR / "llama2-tiny.yml"
    overrides = ["pipeline_delay_activation_forwarding=true"]
    cfg, adjusted = run_inputs.checkpoint_config(path, overrides, stored)
    assert (cfg.num_stages, cfg.num_microbatches, cfg.forwarding_delay) == (8, 16, 2)
    assert [(a.key, a.asked, a.used) for a in adjusted] == [
        ("ici_pipeline_parallelism", 4, 8),
        ("num_pipeline_repeats", 2, 1),
        ("num_pipeline_microbatches", 8, -1),
    ]
    err = capsys.readouterr().err
    assert "[parity] --checkpoint changed num_pipeline_microbatches=8 -> -1 (reset to its " in err
    weights = run_inputs.checkpoint_weights("ckpt", stored)
    facts = run_facts.twins_facts(path, CONFIG_DIR / "base.yml", overrides, cfg, weights, adjusted)
    assert facts.title("llama2-tiny") == (
        f"llama2-tiny pipeline_delay_activation_forwarding=true (weights: checkpoint "
        f"{Path('ckpt').absolute()})"
    )
    data = json.loads(
        json.dumps(report.to_json([], "llama2-tiny", None, {"run": facts.as_json()}), default=str)
    )
    assert data["config"] == "llama2-tiny"  # as before: old readers read on
    run = data["run"]
    assert run["config_file"] == str(path) and run["overrides"] == overrides
    assert run["resolved_config"]["num_pipeline_microbatches"] == -1
    assert run["resolved_config"]["derived"]["num_microbatches"] == 16
    assert run["weights"]["source"] == "checkpoint" and run["weights"]["step"] == 3
    assert run["adjusted"][2]["why"].startswith("reset to its default, M=16")
    assert run["versions"]["jax"] == jax.__version__ and run["versions"]["python"]


def test_a_missing_golden_file_fails_under_ci_and_is_said_elsewhere(tmp_path, capsys):
    golden = tmp_path / "golden"  # a wrong path: no golden file there
    checks = ["roundtrip"]
    assert run_inputs.golden_required(RunOptions(), {"CI": "true"})
    assert not run_inputs.golden_required(RunOptions(), {})
    assert not run_inputs.golden_required(RunOptions(require_golden=False), {"CI": "true"})
    with pytest.raises(errors.BadInput, match="--update_golden") as refused:
        run_inputs.outputs(RunOptions(golden=str(golden), require_golden=True), "m", checks)
    assert str(golden / "m.sharding.json") in str(refused.value) and not golden.exists()
    written = run_inputs.outputs(RunOptions(golden=str(golden), require_golden=False), "m", checks)
    assert written.golden_missing and written.golden_data is None
    assert "--golden: no golden file at" in capsys.readouterr().err
    updated = run_inputs.outputs(
        RunOptions(golden=str(golden), update_golden=True, require_golden=True), "m", checks
    )
    assert not updated.golden_missing  # --update_golden writes it, under CI too


def test_report_paths_are_refused_up_front_and_plots_take_their_format(tmp_path):
    def refused(message: str, checks: Sequence[str] = ("train",), **values) -> None:
        with pytest.raises(errors.BadInput, match=message):
            run_inputs.outputs(RunOptions(**values), "m", list(checks))

    refused("cannot write", json="/proc/x.json")
    refused("do not include train", ("forward",), plot=str(tmp_path / "p.png"))
    refused("trains no step", plot=str(tmp_path / "p.png"), steps=0)
    refused(r"unknown image format '\.gif'", plot=str(tmp_path / "p.gif"))
    assert [report.plot_format(p) for p in ("a.PNG", "a", "a.jpg", "a.svg", "a.pdf", "a.x")] == [
        "png", "png", "jpeg", "svg", "pdf", None
    ]  # fmt: skip
    pytest.importorskip("matplotlib")
    steps = tuple(
        {"step": i, "loss_linen": 1.0, "loss_nnx": 1.0, "max_rel": 0.0, "passed": True}
        for i in range(2)
    )
    train = CheckResult("train", True, "max_rel", 0.0, 0.0, "-", steps=steps)
    for name, magic in (("p.jpg", b"\xff\xd8"), ("p.svg", b"<?xml"), ("p.pdf", b"%PDF")):
        assert report.write_plot([train], "m", tmp_path / name)
        assert (tmp_path / name).read_bytes().startswith(magic), name


def test_version_and_each_migrate_command_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as exited:
        cli._parse_flags(["parity", "--version"])
    assert exited.value.code == cli.EXIT_PASS
    line = capsys.readouterr().out
    assert line.startswith("parity (linen-nnx-parity) ") and f"jax {jax.__version__}" in line
    assert migrate_cli._parse_flags(["migrate", "--version"]) == migrate_cli.EXIT_OK
    assert capsys.readouterr().out.startswith("migrate (linen-nnx-parity) ")
    listed = set()
    for command in migrate_cli.COMMANDS:
        assert migrate_cli._parse_flags(["migrate", command, "--help"]) == migrate_cli.EXIT_OK
        page = capsys.readouterr().out
        assert page.startswith(f"migrate {command}: ") and f"    migrate {command} " in page
        others = [c for c in migrate_cli.COMMANDS if c != command]
        assert not any(f"    migrate {c} " in page for c in others), page
        flags_shown = {f for f in migrate_cli.FLAGS if f"--{f}=" in page or f"]{f}\n" in page}
        assert flags_shown == set(migrate_cli.COMMAND_FLAGS[command]), command
        listed |= flags_shown
    assert listed == set(migrate_cli.FLAGS)  # every flag is some command's
