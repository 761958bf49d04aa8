"""Bad input never crashes, hangs or destroys data (`parity`, the config loader, the exit-code
contract): each kind of hostile input exits 2 (3 for a lost coordinator, 4 for an internal
error) in seconds, with one message line and no traceback, and leaves the files around it as
they were. The checkpoint side is tests/test_migrate_safety.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
import xml.etree.ElementTree as ET

import pytest
from hostile import CONFIGS, REPO, TINY, config_dir, read_only, refused, run, snapshot, unreadable
from rich.console import Console
from test_cli import run_in_process

from migrate import errors
from migrate.checkpoints.convert import ConversionError
from migrate.runtime.cli_support import guarded
from parity import cli
from parity.engine import numeric
from parity.engine.result import CheckResult
from parity.multiprocess import launch
from parity.reports import progress as progress_lib
from parity.reports import report

# ------------------------------------------------------------------ config values

STAGES_1024 = ("ici_pipeline_parallelism=1024", "base_num_decoder_layers=1024")
# (id, overrides, fragments of the one error line)
BAD_VALUES = [
    ("huge-dim", ["base_emb_dim=1099511627776"], ["base_emb_dim=1099511627776", "1..65536"]),
    ("huge-layers", ["base_num_decoder_layers=100000000"], ["base_num_decoder_layers", "1..1024"]),
    ("overflowing-int", [f"seed={10**400}"], ["seed=1000", "0..4294967295"]),
    ("overflowing-float", [f"learning_rate={10**400}"], ["learning_rate=", "finite"]),
    ("inf-learning-rate", ["learning_rate=.inf"], ["learning_rate=inf: must be a finite number"]),
    ("inf-epsilon", ["normalization_layer_epsilon=.inf"], ["normalization_layer_epsilon=inf"]),
    ("nan", ["adam_b1=.nan"], ["adam_b1=nan: must be a finite number"]),
    ("parallelism-bound", ["ici_pipeline_parallelism=5000"], ["ici_pipeline_parallelism=5000"]),
    (
        "mesh-axis-twice",
        ["logical_axis_rules=[[embed, [fsdp, fsdp]]]"],
        ["'embed' -> ['fsdp', 'fsdp']", "'fsdp' twice"],
    ),
    (
        "too-many-simulated-devices",
        # vocab_size: the tables shard vocab over the 1024 stages too (a valid config but for
        # its device count)
        [*STAGES_1024, "num_pipeline_repeats=1", "num_pipeline_microbatches=-1", "vocab_size=1024"],
        ["needs 2048 devices", "at most 512 simulated CPU devices"],
    ),
    (
        "unrolled-iterations",
        [
            "scan_pipeline_iterations=false",
            "per_device_batch_size=128",
            "num_pipeline_microbatches=512",
        ],
        ["scan_pipeline_iterations=false", "1027 layer applications traced unrolled", "512"],
    ),
    (
        "efficiency-unrolled",
        ["--checks=efficiency", "per_device_batch_size=64", "num_pipeline_microbatches=256"],
        ["--checks=efficiency: traces 515 layer applications unrolled"],
    ),
    (
        "memory",
        ["base_emb_dim=65536", "vocab_size=2097152"],
        ["needs at least", "GiB: 2 x (parameters", "of memory is available", "--nomemory_check"],
    ),
    ("control-character-name", ['model_name="a\\x07b"'], ["model_name='a\\x07b'", "printable"]),
    ("undecodable-name", [b"model_name=\xff"], ["model_name"]),
    ("self-alias", ["logical_axis_rules=&a [*a]"], ["alias *a refers to itself"]),
    ("deep-override", ["seed=" + "[" * 40 + "]" * 40], ["nested deeper than 32 levels"]),
    (
        "misspelled-rule-name",  # would leave every embed dimension replicated, and pass
        ["logical_axis_rules=[[embd, fsdp], [layers, stage]]"],
        ["logical_axis_rules: 'embd' names no logical axis", "did you mean 'embed'?"],
    ),
    ("duplicate-key-in-override", ["logical_axis_rules={a: 1, a: 2}"], ["key 'a' appears twice"]),
    ("no-checks", ["--checks="], ["--checks: no checks selected; known checks: roundtrip"]),
    ("no-checks-commas", ["--checks=,"], ["no checks selected"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "fragments"), [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES]
)
def test_bad_config_values_exit_2_before_jax(overrides, fragments):
    start = time.monotonic()
    result = run("parity", TINY, *overrides, timeout=30)
    refused(result, errors.EXIT_USAGE, *fragments)
    assert time.monotonic() - start < 15


# ------------------------------------------------------------------ config files


def alias_bomb() -> str:
    """1 KB of YAML that expands to 10**9 strings."""
    lines = ["model_name: bomb", "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


BAD_FILES = [
    ("alias-bomb", alias_bomb(), ["expands to more than 100000 values"]),
    ("deep-nesting", "model_name: " + "[" * 5000 + "]" * 5000 + "\n", ["nested deeper than 32"]),
    ("not-utf8", b"model_name: \xff\xfe\n", ["not UTF-8 text"]),
    ("not-a-mapping", "- a\n- b\n", ["expected a mapping of key: value, got list"]),
    ("non-string-key", "1: 2\n", ["key 1 is not a string"]),
    ("python-object", "model_name: !!python/object:os.system ls\n", ["not valid YAML"]),
    ("two-documents", "model_name: a\n---\nmodel_name: b\n", ["not valid YAML"]),
    ("huge-integer-text", "seed: " + "9" * 5000 + "\n", ["model.yml: ValueError"]),
    (
        "duplicate-key",  # PyYAML keeps the last silently: the run would use S=2
        "model_name: dup\nici_pipeline_parallelism: 4\nseed: 1\nici_pipeline_parallelism: 2\n",
        ["model.yml: key 'ici_pipeline_parallelism' appears twice (lines 2 and 4)"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "fragments"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_config_files_exit_2_in_seconds(text, fragments, tmp_path):
    path = config_dir(tmp_path, text)
    before = snapshot(tmp_path)
    start = time.monotonic()
    refused(run("parity", str(path), timeout=30), errors.EXIT_USAGE, *fragments)
    assert time.monotonic() - start < 15
    assert snapshot(tmp_path) == before


# Line 3 opens no key where the flow sequence of line 2 is still open: PyYAML reports it on
# five lines (the context, a quote of the source, a caret under the problem).
UNCLOSED = "seed: [1, 2\nvocab_size: 64\n"
YAML_PLACE = "not valid YAML at line 3, column {column}: expected ',' or ']', but got ':'"


@pytest.mark.slow
@pytest.mark.parametrize("program", ["parity", "parity --maxtext", "migrate"])
def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(program, tmp_path):
    """A config that is not YAML: exit 2 and stderr is one line, naming the file, the line and
    the column (counted from 1) of the problem and what it is, as every config error."""
    if program == "parity --maxtext":
        path = tmp_path / "gate.yml"  # no base.yml beside it: this file alone
        path.write_text("maxtext:\n  " + UNCLOSED.replace("\n", "\n  "))
        column, args = 13, ["--maxtext", str(path), "--dry_run"]
    else:
        path = config_dir(tmp_path, "model_name: broken\n" + UNCLOSED)
        column, args = 11, [str(path), "--dry_run"]
        if program == "migrate":
            args = ["init", f"--config={path}", "--framework=nnx", str(tmp_path / "out")]
    before = snapshot(tmp_path)
    result = run(program.split()[0], *args, timeout=30)
    err = refused(result, errors.EXIT_USAGE, f"{path}: {YAML_PLACE.format(column=column)}")
    assert len(err.strip().splitlines()) == 1, err
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["symlink-loop", "directory", "unreadable", "missing"])
def test_unreadable_config_paths_exit_2(kind, tmp_path):
    path = config_dir(tmp_path, "model_name: x\n")
    path.unlink()
    if kind == "symlink-loop":
        path.symlink_to(path.name)
        fragment = "Too many levels of symbolic links"
    elif kind == "directory":
        path.mkdir()
        fragment = "Is a directory"
    elif kind == "unreadable":
        path.write_text("model_name: x\n")
        unreadable(path)
        fragment = "cannot read config"
    else:
        fragment = "config file not found"
    before = snapshot(tmp_path)
    refused(run("parity", str(path), timeout=30), errors.EXIT_USAGE, fragment, str(path))
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ output paths


@pytest.mark.slow
def test_output_paths_are_refused_before_any_check(tmp_path):
    """A directory, a parent that is a file, a symlink loop, a read-only folder, a corrupt
    golden: exit 2 at once (no check runs, nothing is created or removed)."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "loop.json").symlink_to("loop.json")
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / "llama2-tiny.sharding.json").write_text('{"nnx/a": ')
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "llama2-tiny.sharding.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "locked").mkdir()
    cases = [
        ([f"--json={tmp_path / 'adir'}"], ["--json=", "is a directory"]),
        ([f"--junit={tmp_path / 'afile' / 'r.xml'}"], ["--junit=", "Not a directory"]),
        ([f"--json={tmp_path / 'loop.json'}"], ["Too many levels of symbolic links"]),
        ([f"--plot={tmp_path / 'adir'}", "--checks=train"], ["--plot=", "is a directory"]),
        ([f"--golden={tmp_path / 'afile'}"], ["--golden:", "is not a directory"]),
        ([f"--golden={golden}"], ["golden file", "not valid JSON"]),
        ([f"--golden={deep}"], ["golden file", "not valid JSON"]),
        ([f"--json={tmp_path / 'locked' / 'sub' / 'r.json'}"], ["is not writable"]),
    ]
    before = snapshot(tmp_path)
    with read_only(tmp_path / "locked"):
        for flags, fragments in cases:
            start = time.monotonic()
            result = run("parity", TINY, "--checks=roundtrip", *flags, timeout=30)
            refused(result, errors.EXIT_USAGE, *fragments)
            assert time.monotonic() - start < 15, flags
            assert b"roundtrip ..." not in result.stderr  # no check started
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ multi-process flags


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--process_id=5", "--coordinator_address=127.0.0.1:1234"], ["--process_id=5", "0..1"]),
        (["--process_id=1", "--coordinator_address=nohost"], ["expected HOST:PORT"]),
        (["--process_id=1", "--coordinator_address=host:99999"], ["port in 1..65535"]),
        (["--process_id=1", "--coordinator_address=:80"], ["expected HOST:PORT"]),
        (["--process_id=1", "--coordinator_address=a b:80"], ["is not a host name"]),
    ],
)
def test_a_lone_worker_with_bad_flags_exits_2_at_once(flags, fragments):
    start = time.monotonic()
    refused(run("parity", TINY, "--num_processes=2", *flags, timeout=30), 2, *fragments)
    assert time.monotonic() - start < 15


@pytest.mark.slow
@pytest.mark.parametrize("process_id", [1, 0])
def test_an_unreachable_coordinator_exits_3_in_bounded_time(process_id):
    """Process 1: nothing listens at the address. Process 0: it runs the coordinator, but the
    other process never joins. Either way exit 3 after --init_timeout_s, not a C++ abort."""
    port = launch.free_port()  # nothing listens there
    timeout = 3
    start = time.monotonic()
    result = run(
        "parity", TINY, "--num_processes=2", f"--process_id={process_id}",
        f"--coordinator_address=127.0.0.1:{port}", f"--init_timeout_s={timeout}",
        "--checks=roundtrip", timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    what = "cannot reach the coordinator" if process_id else "joining 2 processes"
    refused(result, errors.EXIT_WORKER, what, f"127.0.0.1:{port}", f"{timeout}s")
    assert timeout - 1 <= elapsed < timeout + 20


# ------------------------------------------------------------------ statuses and reports


def fake_check(monkeypatch, outcome) -> None:
    """`roundtrip` replaced by `outcome` (a CheckResult, or an exception to raise)."""

    def check(session):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(numeric, "roundtrip", check)  # the registry imports it at the call


class ResourceExhausted(RuntimeError):
    """Stands for jax's JaxRuntimeError / XlaRuntimeError (matched by name and text)."""


ResourceExhausted.__name__ = "JaxRuntimeError"
OOM = "RESOURCE_EXHAUSTED: Out of memory allocating"
OS_27 = "[os_error_code='27']"
PASSED = CheckResult("roundtrip", True, "max_rel", 0.0, 0.0, "-")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("outcome", "status", "verdict"),
    [
        (PASSED, errors.EXIT_PASS, "passed"),
        (ConversionError("linen->nnx", ["a/kernel: names differ"]), errors.EXIT_FAIL, "failed"),
        (
            ResourceExhausted("RESOURCE_EXHAUSTED: Out of memory allocating 1e15 bytes"),
            2,
            "bad_input",
        ),
        (TypeError("unsupported operand"), errors.EXIT_INTERNAL, "errored"),
    ],
    ids=["passed", "parity-failure", "out-of-memory", "crash"],
)
def test_a_check_that_raises_is_failed_only_for_a_parity_error(
    outcome, status, verdict, monkeypatch, tmp_path, capsys
):
    """A converter error is a parity failure (1); out of memory is bad input (2); a bug in
    the harness is an internal error (4), never a parity failure. JSON and JUnit say which."""
    fake_check(monkeypatch, outcome)
    json_path, junit_path = tmp_path / "r.json", tmp_path / "r.xml"
    assert (
        run_in_process(TINY, "--checks=roundtrip", f"--json={json_path}", f"--junit={junit_path}")
        == status
    )
    data = json.loads(json_path.read_text())
    assert data["checks"][0]["status"] == verdict and data["passed"] is (verdict == "passed")
    case = ET.parse(junit_path).getroot().find("testsuite/testcase")
    kind = {"failed": "failure", "bad_input": "error", "errored": "error"}.get(verdict)
    assert [child.tag for child in case] == ([kind] if kind else [])
    out = capsys.readouterr().out
    assert {"passed": "PASS", "failed": "FAIL"}.get(verdict, "ERROR") in out


@pytest.mark.slow
def test_a_report_that_cannot_be_written_keeps_the_verdict_and_exits_2(
    monkeypatch, tmp_path, capsys
):
    fake_check(monkeypatch, PASSED)

    def disk_full(*args):
        raise OSError(28, "No space left on device", str(tmp_path / "r.json"))

    monkeypatch.setattr(report, "write_json", disk_full)
    junit = tmp_path / "r.xml"
    status = run_in_process(
        TINY, "--checks=roundtrip", f"--json={tmp_path / 'r.json'}", f"--junit={junit}"
    )
    out, err = capsys.readouterr()
    assert status == errors.EXIT_USAGE
    assert "PASS" in out  # the verdict table is on stdout
    assert "--json: the report" in err and "No space left on device" in err
    assert junit.exists()  # the other report is still written


@pytest.mark.slow
def test_golden_stays_inside_its_folder_and_missing_report_folders_are_created(
    monkeypatch, tmp_path
):
    """`model_name=../escaped --golden=DIR` writes inside DIR; report parents are created."""
    fake_check(monkeypatch, PASSED)
    golden = tmp_path / "work" / "golden"
    json_path = tmp_path / "work" / "new" / "deeper" / "r.json"
    args = (TINY, "model_name=../escaped", "--checks=roundtrip", f"--golden={golden}")
    args += ("--norequire_golden",)  # written where missing, under CI too
    assert run_in_process(*args, f"--json={json_path}") == errors.EXIT_PASS
    assert [p.name for p in golden.iterdir()] == ["_.._escaped.sharding.json"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["golden", "new"]
    assert json.loads(json_path.read_text())["config"] == "../escaped"
    assert run_in_process(*args) == errors.EXIT_PASS  # compared, equal


@pytest.mark.parametrize(
    ("name", "stem"),
    [("../escaped", "_.._escaped"), ("a/b\\c", "a_b_c"), (".hidden", "_.hidden"), ("", "_"),
     ("llama2-7b", "llama2-7b"), ("\udcff" * 3, "___"), ("x" * 500, "x" * 200)],
)  # fmt: skip
def test_file_stem_is_one_safe_name(name, stem, tmp_path):
    assert report.file_stem(name) == stem
    assert report.golden_path(tmp_path, name).parent == tmp_path


def test_the_table_prints_text_that_is_not_valid_unicode():
    cfg = cli.load_config(TINY)
    result = CheckResult(
        "forward", False, "max_rel", 1.0, 0.0, "bad\udcffplace", message="why \udcfe [red]x"
    )
    with open(os.devnull, "w", encoding="utf-8") as sink:
        report.render_table([result], cfg.model_name, Console(file=sink, width=120))
    assert report.printable("a\udcffb") == "a\\udcffb"


def test_plot_path_is_written_as_given(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = cli.load_config(TINY)
    steps = tuple(
        {"step": i, "loss_linen": 1.0, "loss_nnx": 1.0, "max_rel": 0.0, "passed": True}
        for i in range(2)
    )
    train = CheckResult("train", True, "max_rel", 0.0, 0.0, "-", steps=steps)
    path = tmp_path / "plot"  # no suffix: matplotlib would have written plot.png
    assert report.write_plot([train], cfg.model_name, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plot.png").exists()


# ------------------------------------------------------------------ the guard


@pytest.fixture
def hooks_restored(monkeypatch):
    """After an error the guard silences what the exiting process would still print
    (unraisable exceptions, warnings): give them back to pytest afterwards."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    with warnings.catch_warnings():
        yield


@pytest.mark.slow
def test_an_internal_error_exits_4_with_one_line_and_the_traceback_only_when_verbose():
    crash = "from parity import cli; cli.run = lambda argv: 1 / 0; cli.main()"
    command = [sys.executable, "-c", crash, TINY]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    quiet = subprocess.run(command, capture_output=True, timeout=60, env=env)
    err = refused(quiet, errors.EXIT_INTERNAL, "parity: internal error: ZeroDivisionError")
    assert "--verbose" in err
    loud = subprocess.run([*command, "--verbose"], capture_output=True, timeout=60, env=env)
    assert loud.returncode == errors.EXIT_INTERNAL and b"Traceback" in loud.stderr


@pytest.mark.parametrize(
    ("error", "status", "fragment"),
    [
        (errors.BadInput("bad key"), 2, "bad key"),
        (MemoryError(), 2, "out of memory"),
        (ResourceExhausted(f"{OOM} 9 bytes"), 2, "out of memory"),
        (OSError(28, "No space left on device", "/ckpt/x"), 2, "No space left on device: /ckpt/x"),
        (OSError(13, "Permission denied", "/ro"), 2, "Permission denied: /ro"),
        (
            ValueError(f"OUT_OF_RANGE: Failed writing: \"/ckpt/d/1\": File too large {OS_27}"),
            2,
            "File too large: /ckpt/d/1",
        ),
        (KeyboardInterrupt(), 128 + signal.SIGINT, "SIGINT"),
        (errors.Interrupted(signal.SIGTERM), 128 + signal.SIGTERM, "SIGTERM"),
        (RecursionError("maximum recursion depth exceeded"), 4, "RecursionError"),
        (KeyError("x"), 4, "KeyError"),
    ],
)  # fmt: skip
def test_every_exception_has_its_exit_status(error, status, fragment, capsys, hooks_restored):
    def body() -> int:
        raise error

    assert guarded("parity", body, verbose=lambda: False) == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and fragment in err and "Traceback" not in err


def test_a_huge_message_is_cut(capsys, hooks_restored):
    def body() -> int:
        raise errors.BadInput("x" * 10**7)

    assert guarded("parity", body, verbose=lambda: False) == errors.EXIT_USAGE
    assert len(capsys.readouterr().err) < 3 * errors.MESSAGE_CHARS


# ------------------------------------------------------------------ progress


def test_train_progress_prints_the_first_steps_then_throttles(capsys):
    seconds = iter(range(1000))  # one second per step
    progress = progress_lib.StepProgress(
        100, first=3, every_s=10.0, clock=lambda: float(next(seconds))
    )
    for step in range(100):
        progress(step, passed=step != 50)
    lines = capsys.readouterr().err.splitlines()
    printed = [int(line.split("train step ")[1].split("/")[0]) for line in lines]
    assert printed[:3] == [1, 2, 3] and printed[-1] == 100
    assert "train step 51/100: DIVERGED" in "\n".join(lines)
    assert 10 <= len(printed) <= 15  # every ~10 steps, not 100 lines


@pytest.mark.slow
def test_dry_run_validates_without_jax():
    result = run("parity", str(CONFIGS / "llama2-7b.yml"), "--checks=compile", "--dry_run")
    assert result.returncode == 0, result.stderr
    assert b"llama2-7b: 8 devices" in result.stdout
