"""The `migrate` command: init, convert, re-staging, verification, exit codes and messages."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIG_DIR

from migrate import cli
from migrate.checkpoints import commands as checkpoint
from migrate.checkpoints import forward_check
from migrate.checkpoints.meta import CheckpointError, read_meta
from migrate.config.loading import load_config
from migrate.runtime import cli_support

# A damaged checkpoint fails an Orbax read while others are in flight; those end in Orbax's
# closed event loop and Python reports them as unraisable. The CLI silences them (its
# `_quiet_abandoned_reads`); here they are collected at once, inside the test that caused them.
pytestmark = [
    pytest.mark.compat,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

REPO = Path(__file__).resolve().parent.parent
CONFIG = f"--config={CONFIG_DIR / 'llama2-tiny.yml'}"


def migrate(*args: str) -> int:
    """The command in this process, as `migrate ARGS` would run it."""
    argv = cli.FLAGS(["migrate", *args])
    try:
        return cli.run(argv)
    finally:
        cli.FLAGS.unparse_flags()


@pytest.fixture(scope="module")
def nnx_ckpt(tmp_path_factory) -> Path:
    """`migrate init` of an NNX checkpoint, shared by the tests below."""
    path = tmp_path_factory.mktemp("cli") / "nnx"
    assert migrate("init", CONFIG, "--framework=nnx", str(path)) == cli.EXIT_OK
    return path


@pytest.mark.slow
def test_init_then_convert_with_verification(nnx_ckpt, tmp_path, capsys):
    capsys.readouterr()
    dst = tmp_path / "linen"
    code = migrate(
        "convert", CONFIG, "--from=nnx", "--to=linen", "--verify", "--verify_forward",
        str(nnx_ckpt), str(dst),
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == cli.EXIT_OK, out.err
    assert f"from {nnx_ckpt}: nnx, pipeline S=4 R=2 L=1, step 0" in out.out
    assert f"to   {dst}: linen, pipeline S=4 R=2 L=1, step 0" in out.out
    assert "checked before writing: bit-exact" in out.out
    assert "checked before writing: forward" in out.out
    assert "forward check on the converted weights: PASS" in out.err
    assert read_meta(dst)["framework"] == "linen"


def test_convert_restages_with_key_value_overrides(nnx_ckpt, tmp_path, capsys):
    dst = tmp_path / "s2"
    code = migrate(
        "convert", CONFIG, "--from=nnx", "--to=nnx", str(nnx_ckpt), str(dst),
        "ici_pipeline_parallelism=2", "num_pipeline_repeats=4",
    )  # fmt: skip
    assert code == cli.EXIT_OK, capsys.readouterr().err
    assert "nnx, pipeline S=2 R=4 L=1" in capsys.readouterr().out
    meta = read_meta(dst)
    assert meta["stages"] == {"S": 2, "R": 4, "L": 1}
    # Back to the reference layout; a second run needs --force.
    ref = tmp_path / "ref"
    args = ("convert", CONFIG, "--from=nnx", "--to=linen", "--layout=reference", str(dst), str(ref))
    assert migrate(*args) == cli.EXIT_OK
    assert "linen, reference N=8" in capsys.readouterr().out
    assert migrate(*args) == cli.EXIT_USAGE
    assert "already exists; pass --force" in capsys.readouterr().err
    assert migrate(*args, "--force") == cli.EXIT_OK


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "expected a command, convert, init, compare or port"),
        (("upgrade", CONFIG), "expected a command, convert, init, compare or port, got 'upgrade'"),
        (("init", "--framework=nnx", "dst"), "--config is required"),
        (("convert", CONFIG, "--from=nnx", "--to=linen", "src"), "expected SRC DST"),
        (("convert", CONFIG, "--to=linen", "src", "dst"), "--from and --to are required"),
        (("init", CONFIG, "dst"), "--framework is required"),
        (("init", CONFIG, "--framework=nnx", "dst", "num_pipeline_repeat=4"), "did you mean"),
        (
            ("init", CONFIG, "--framework=nnx", "dst", "ici_pipeline_parallelism=3"),
            "need S*L*R == base_num_decoder_layers",
        ),
        (
            ("init", CONFIG, "--framework=nnx", "dst", "ici_fsdp_parallelism=4"),
            "needs 16 devices",
        ),
        (
            ("convert", CONFIG, "--from=linen", "--to=nnx", "nowhere", "dst"),
            "nowhere: no checkpoint there",
        ),
    ],
)
def test_usage_config_and_checkpoint_errors_exit_2(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert migrate(*args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "dst").exists()


def test_checkpoint_errors_exit_2_and_leave_the_destination_alone(nnx_ckpt, tmp_path, capsys):
    convert = ("convert", CONFIG, "--from=nnx", "--to=linen")
    # A truncated data file.
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(nnx_ckpt), str(src)], check=True)
    data = max((p for p in (src / "params").rglob("*") if p.is_file()), key=os.path.getsize)
    data.write_bytes(data.read_bytes()[:100])
    assert migrate(*convert, str(src), str(tmp_path / "dst")) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"migrate: error: {src}: cannot restore the arrays" in err and "corrupt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # The wrong framework, and a dtype change nobody asked for.
    assert (
        migrate(*convert[:2], "--from=linen", "--to=nnx", str(nnx_ckpt), str(tmp_path / "d")) == 2
    )
    assert "holds nnx trees, not linen (--from=linen)" in capsys.readouterr().err
    assert migrate(*convert, str(nnx_ckpt), str(tmp_path / "d"), "weight_dtype=bfloat16") == 2
    assert "pass --dtype=bfloat16 to cast" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    gc.collect()  # the reads Orbax abandoned, here rather than in a later test


def test_failed_verification_exits_1_and_writes_nothing(nnx_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        checkpoint, "compare_checkpoints", lambda *args: ["params:token_embedder: 1 byte differs"]
    )
    dst = tmp_path / "dst"
    code = migrate(
        "convert", CONFIG, "--from=nnx", "--to=linen", "--verify", str(nnx_ckpt), str(dst)
    )
    assert code == cli.EXIT_VERIFY_FAILED
    err = capsys.readouterr().err
    assert f"verification failed; {dst} was not written" in err
    assert "params:token_embedder: 1 byte differs" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("child_status", "expected"),
    [(2, cli.EXIT_USAGE), (3, cli.EXIT_INTERNAL), (4, cli.EXIT_INTERNAL)],
)
def test_a_forward_check_that_cannot_run_is_not_a_verdict(
    child_status, expected, nnx_ckpt, tmp_path, capsys, monkeypatch
):
    """`--verify_forward`'s parity child exiting 2 is bad input; a crash or a lost worker of the
    child is an internal error, never exit 1 (a verdict on the weights); nothing is written."""
    finished = subprocess.CompletedProcess([], child_status, "", "the child's last line\n")
    monkeypatch.setattr(forward_check.subprocess, "run", lambda *args, **kwargs: finished)
    dst = tmp_path / "dst"
    args = ("convert", CONFIG, "--from=nnx", "--to=linen", "--verify_forward", nnx_ckpt, dst)
    code = cli_support.guarded("migrate", lambda: migrate(*map(str, args)), lambda: False)
    assert code == expected
    err = capsys.readouterr().err
    assert f"could not run (exit {child_status}): the child's last line" in err
    assert list(tmp_path.iterdir()) == []


def test_devices_follow_the_source_layout_and_the_overrides(nnx_ckpt, tmp_path):
    """Counted before JAX starts: the config, then the layout the source's validated meta
    records, then the overrides."""
    cfg = load_config(CONFIG_DIR / "llama2-tiny.yml")
    devices_needed = lambda changes, src: cli.target_config(cfg, changes, src).num_devices
    assert devices_needed({}, None) == 8  # stage 4 x fsdp 2
    restaged = {"ici_pipeline_parallelism": 2, "num_pipeline_repeats": 4}
    assert devices_needed(restaged, None) == 4
    src = tmp_path / "src"
    shutil.copytree(nnx_ckpt, src)
    meta_file = src / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["layout_keys"]["ici_pipeline_parallelism"] = 1
    meta_file.write_text(json.dumps(meta))
    assert devices_needed({}, str(src)) == 2
    assert devices_needed({"ici_fsdp_parallelism": 4}, str(src)) == 4
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        devices_needed({}, str(tmp_path / "missing"))


@pytest.mark.slow
def test_console_script_flag_errors_exit_2_before_jax(tmp_path):
    """The module as a program: a bad flag is one line on stderr, exit 2, no JAX start-up."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "migrate.cli"]
    bad = subprocess.run(
        [*command, "convert", CONFIG, "--from=lin", "a", "b"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2
    assert (
        bad.stderr.startswith("migrate: error: flag --from=lin") and "Traceback" not in bad.stderr
    )
    helped = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert helped.returncode == 0 and "migrate convert --config=CONFIG" in helped.stdout


@pytest.mark.slow
@pytest.mark.parametrize("program", ["parity", "migrate"])
def test_help_is_the_front_door(program):
    """`parity --help` and `migrate --help`, as installed console scripts: the usage, one line
    per check (or command), every one of the command's flags with its default, and the exit
    statuses; exit 0 and no JAX start-up (absl alone showed only "Try --helpfull" for parity)."""
    from migrate import cli as migrate_cli
    from parity import cli as parity_cli
    from parity.engine import registry

    CHECKS = dict(registry.help_lines(registry.Front.TWINS))

    script = Path(sys.executable).parent / program
    helped = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert helped.returncode == 0, helped.stderr
    page = helped.stdout
    assert "Try --helpfull" not in page and f"    {program} " in page
    if program == "parity":
        names, own = list(CHECKS), parity_cli.OWN_FLAGS
        assert "--helpfull" not in own and "verbosity" not in own
    else:
        names, own = [name for name, _ in migrate_cli.COMMAND_HELP], list(migrate_cli.FLAGS)
    for name in names:
        assert f"\n  {name} " in page, name
    flag_section = page.split("\nflags:\n", 1)[1].split("\nexit status:\n", 1)[0]
    entries = {
        block.split("\n", 1)[0].split("=")[0].replace("[no]", ""): block
        for block in ("\n" + flag_section).split("\n  --")[1:]
    }
    for flag in own:
        assert "(default:" in entries.get(flag, ""), flag
    statuses = page.split("exit status:\n", 1)[1]
    for status in ("0", "1", "2", "4", "128+N"):
        assert f"\n  {status} " in "\n" + statuses, status
