"""`parity --maxtext` and `migrate ... --to=maxtext` as careful as the twins' commands: MaxText
keys held to the twins' bounds and the memory both releases' workers need estimated before
either starts, flags the gate does not take refused (`--golden`) or honoured (`--steps` by the
checkpoint check), interpreter paths read from the caller's directory, progress while a worker
works, and `--force` over a MaxText checkpoints root `migrate` wrote, and over nothing else.
Each runs the command as a user does: its exit status, its one line, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest
from hostile import REPO, TINY, refused, run, snapshot
from test_maxtext_errors import PP4, needs_envs
from test_migrate_cli import migrate as migrate_in_process

from migrate import errors
from migrate.checkpoints import destination
from migrate.config.loading import load_config
from migrate.runtime import memory
from parity.maxtext import gate_config, gate_memory


def maxtext(*args: str, timeout: float = 60, **kwargs):
    return run("parity", "--maxtext", PP4, *args, timeout=timeout, **kwargs)


# ------------------------------------------------------------------ bounds, before any worker

OUT_OF_BOUNDS = [
    ("base_num_decoder_layers=-4", "base_num_decoder_layers=-4: must be a positive integer"),
    ("base_emb_dim=0", "base_emb_dim=0: must be a positive integer"),
    ("vocab_size=99999999999", "vocab_size=99999999999: must be an integer in 1..2097152"),
    ("head_dim=2.5", "head_dim=2.5: must be an integer in 1..4096"),
    ("num_experts=true", "num_experts=True: must be an integer in 1..1024"),
    ("num_pipeline_microbatches=0", "num_pipeline_microbatches=0: must be -1 or an integer"),
    ("num_pipeline_repeats=-3", "num_pipeline_repeats=-3: must be -1 or an integer in 1..1024"),
    ("ici_fsdp_parallelism=0", "ici_fsdp_parallelism=0: must be -1 or a positive integer"),
    (
        "ici_tensor_parallelism=1024",
        "ici_tensor_parallelism=1024: must be -1 or an integer in 1..512",
    ),
    ("dcn_data_parallelism=0", "dcn_data_parallelism=0: must be -1 or a positive integer"),
    ("per_device_batch_size=0", "per_device_batch_size=0: must be a number in (0, 65536]"),
    ("per_device_batch_size=0.01", "per_device_batch_size=0.01 on 8 devices: a global batch"),
    ("global_parameter_scale=3", "global_parameter_scale=3: must be a power of two"),
    ("dtype=float64", "dtype='float64': must be one of ['float32', 'bfloat16'"),
    ("weight_dtype=int8", "weight_dtype='int8': must be one of"),
    ("matmul_precision=best", "matmul_precision='best': must be one of"),
    ("dropout_rate=0.1", "dropout_rate=0.1: the MaxText gate compares deterministic runs"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("override", "fragment"), OUT_OF_BOUNDS, ids=[o for o, _ in OUT_OF_BOUNDS])
def test_a_maxtext_key_out_of_bounds_is_refused_before_the_workers(override, fragment):
    """Both releases accept nonsense (`base_num_decoder_layers=-4` built the same model on both
    and passed): the keys the project knows are held to the twins' bounds first, exit 2, the
    key named, in seconds (no worker, no JAX)."""
    start = time.monotonic()
    refused(maxtext(override, "--checks=init", timeout=30), errors.EXIT_USAGE, PP4, fragment)
    assert time.monotonic() - start < 15


def test_the_bounds_let_maxtexts_own_derived_values_through():
    """-1 where MaxText derives the value (microbatches, repeats, the DCN axes), the empty
    `mu_dtype` (the weights' dtype): accepted."""
    keys = [
        "num_pipeline_microbatches=-1", "num_pipeline_repeats=-1", "pipeline_parallel_layers=-1",
        "dcn_data_parallelism=-1", "mu_dtype=", "base_moe_mlp_dim=-1",
        "global_parameter_scale=4", "per_device_batch_size=0.5",
    ]  # fmt: skip
    assert gate_config.load(PP4, keys).num_devices == 8


# ------------------------------------------------------------------ memory, before any worker


HUGE = ["base_emb_dim=65536", "base_mlp_dim=262144", "base_num_decoder_layers=1024"]


@pytest.mark.slow
def test_a_config_too_large_for_the_machine_is_refused_before_the_workers(tmp_path):
    """Both workers would start and wait, silent, until --worker_timeout_s: exit 2 at once with
    the estimate (both releases' parameters, AdamW moments, gradients) and the memory there
    is; nothing written."""
    report = tmp_path / "r.json"
    start = time.monotonic()
    err = refused(
        maxtext(*HUGE, f"--json={report}", timeout=30),
        errors.EXIT_USAGE,
        f"--maxtext {PP4} (both releases' workers) needs at least ",
        "2 x (parameters ",
        "of memory is available; use smaller sizes (or pass --nomemory_check",
    )
    assert time.monotonic() - start < 15 and not report.exists(), err


@pytest.mark.slow
@needs_envs
def test_the_dry_run_shows_the_estimate_and_nomemory_check_lets_it_through():
    result = maxtext(*HUGE, "--nomemory_check", "--dry_run")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert "; memory at least " in result.stdout.decode()
    named = maxtext("model_name=llama2-7b", "--dry_run")
    assert named.returncode == 0, named.stderr.decode()[-2000:]
    assert "memory not estimated (model_name=llama2-7b" in named.stdout.decode()


def test_the_estimate_counts_the_parameters_the_twins_count_for_the_same_shapes():
    """pp4's MaxText keys and the twins' config of the same dimensions: the same parameters
    (MaxText's llama2 decoder and the twins' have the same weights), and the same bound."""
    config = gate_config.load(PP4, [])
    twins = load_config(
        TINY,
        [
            "ici_pipeline_parallelism=4", "num_pipeline_repeats=1",
            "num_pipeline_microbatches=4", "base_num_decoder_layers=4",
            "base_num_kv_heads=4", "vocab_size=128",
        ],
    )  # fmt: skip
    assert gate_memory.parameter_count(config.keys) == memory.parameter_count(twins)
    found = gate_memory.estimate(config)
    assert found is not None and found.copies == 2
    assert found.parameters == memory.estimate(twins).parameters
    assert not gate_memory.large(found)
    llama2_7b = gate_config.load(
        PP4,
        [
            "base_emb_dim=4096", "base_mlp_dim=11008", "vocab_size=32000", "head_dim=128",
            "base_num_query_heads=32", "base_num_kv_heads=32", "base_num_decoder_layers=32",
        ],
    )  # fmt: skip
    seven = gate_memory.parameter_count(llama2_7b.keys)
    assert 6.7e9 < seven < 6.8e9  # llama2-7b: 6.74e9
    assert gate_memory.large(gate_memory.estimate(llama2_7b))


def test_a_long_call_of_a_release_is_said(capsys):
    gate_config.still_running("nnx", "own_weights", 61.4)
    assert capsys.readouterr().err == (
        "[parity] the nnx side (MaxText 0.2.5): own_weights still running after 61s\n"
    )


# ------------------------------------------------------------------ flags the gate refuses


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--golden=GOLDEN", "--update_golden"])
def test_golden_is_refused_under_maxtext_before_anything_starts(flag, tmp_path):
    """The golden sharding reports are the twins': refused, not silently ignored, and the
    golden folder is not created."""
    golden = tmp_path / "golden"
    refused(
        maxtext(flag.replace("GOLDEN", str(golden)), "--checks=init", timeout=30),
        errors.EXIT_USAGE,
        "--golden/--update_golden: golden sharding reports are the twins' (parity CONFIG), "
        "not with --maxtext",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_checkpoint_check_refuses_no_steps_to_checkpoint():
    refused(
        maxtext("--checks=checkpoint", "--steps=0", timeout=30),
        errors.EXIT_USAGE,
        "--steps=0: the checkpoint check trains at least one step before it checkpoints",
    )


@pytest.mark.slow
@needs_envs
@pytest.mark.parametrize(("flags", "steps"), [([], 3), (["--steps=2"], 2)])
def test_the_checkpoint_check_trains_the_steps_asked(flags, steps):
    """--steps is the checkpoint check's too: 0.2.3's train.py trains that many steps before
    it checkpoints (3 when not given); the plan says so."""
    result = maxtext("--checks=checkpoint,init", *flags, "--dry_run")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert f"checkpoint after {steps} steps of 0.2.3's train.py" in result.stdout.decode()


# ------------------------------------------------------------------ paths: the caller's


@pytest.mark.slow
def test_a_relative_interpreter_is_read_from_the_callers_directory():
    """`--linen_python=RELATIVE` names an interpreter from where `parity` runs (this one, which
    has no MaxText): found and asked, refused for what it is (exit 2, before any worker), not
    passed on as a path that names nothing where the worker starts."""
    import importlib.util

    if importlib.util.find_spec("maxtext") is not None:
        pytest.skip("this interpreter has MaxText installed")
    relative = os.path.relpath(sys.executable, REPO)
    refused(
        maxtext(f"--linen_python={relative}", "--dry_run", timeout=30, cwd=REPO),
        errors.EXIT_USAGE,
        f"--linen_python={relative}: has no MaxText installed (No module named 'maxtext')",
    )


@needs_envs
@pytest.mark.slow
def test_the_checkpoint_check_from_the_checkout_with_relative_interpreters(tmp_path, monkeypatch):
    """The issue's command as a user runs it from the checkout: relative interpreter paths,
    `--steps=1` for the checkpoint check, which says each stage while MaxText's train.py runs;
    exit 0, and no worker's or the check's temporary directory left behind."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    result = run(
        "parity", "--maxtext", "configs/maxtext/pp4.yml", "--checks=checkpoint", "--steps=1",
        "--linen_python=.venv-maxtext-0.2.3/bin/python",
        "--nnx_python=.venv-maxtext-0.2.5/bin/python",
        timeout=900, cwd=REPO,
    )  # fmt: skip
    err = result.stderr.decode()
    assert result.returncode == 0, err[-3000:]
    assert "checkpoint: 0.2.3's train.py trains 1 step, checkpointing the last" in err
    assert "checkpoint: step 1 on each release's train.py" in err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ --force over a MaxText root

CONFIG = f"--config={TINY}"
TWIN_KEYS = [
    "ici_pipeline_parallelism=4", "num_pipeline_repeats=1", "num_pipeline_microbatches=4",
    "base_num_decoder_layers=4", "base_num_kv_heads=4", "vocab_size=128",
]  # fmt: skip


@pytest.fixture(scope="module")
def twins_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("surface") / "twins"
    assert migrate_in_process("init", CONFIG, "--framework=nnx", str(path), *TWIN_KEYS) == 0
    return path


def to_maxtext(src, dst, *flags: str) -> int:
    return migrate_in_process(
        "convert", CONFIG, "--from=nnx", "--to=maxtext", *flags, str(src), str(dst), *TWIN_KEYS
    )


@pytest.mark.slow
def test_force_replaces_a_maxtext_root_migrate_wrote(twins_checkpoint, tmp_path):
    """`--to=maxtext` writes a checkpoints root; without --force a second run is refused (exit
    2), with it the root is replaced: the marker names what the tool wrote there."""
    root = tmp_path / "root"
    assert to_maxtext(twins_checkpoint, root) == 0
    steps = json.loads((root / destination.ROOT_MARKER).read_text())["steps"]
    assert len(steps) == 1
    assert sorted(p.name for p in root.iterdir()) == sorted([*steps, destination.ROOT_MARKER])
    again = run("migrate", "convert", CONFIG, "--from=nnx", "--to=maxtext",
                str(twins_checkpoint), str(root), *TWIN_KEYS, timeout=60)  # fmt: skip
    refused(again, errors.EXIT_USAGE, f"{root}: already exists; pass --force to replace it")
    (root / steps[0] / "left-by-the-first-run").write_text("inside what the tool wrote")
    assert to_maxtext(twins_checkpoint, root, "--force") == 0
    assert not (root / steps[0] / "left-by-the-first-run").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["root"]  # no staging, no old copy left


@pytest.mark.slow
@pytest.mark.parametrize("case", ["a-step-maxtext-added", "a-file-of-yours", "no-marker"])
def test_force_never_replaces_a_maxtext_root_beyond_what_migrate_wrote(
    case, twins_checkpoint, tmp_path
):
    """A step MaxText's train.py added after the conversion, a file of the user's, a root
    without the marker (MaxText's own): refused even with --force, exit 2, one line, nothing
    changed."""
    root = tmp_path / "root"
    assert to_maxtext(twins_checkpoint, root) == 0
    if case == "a-step-maxtext-added":
        (step,) = json.loads((root / destination.ROOT_MARKER).read_text())["steps"]
        shutil.copytree(root / step, root / "7")
        fragment = "holds entries this tool did not write (7)"
    elif case == "a-file-of-yours":
        (root / "notes.txt").write_text("keep me")
        fragment = "holds entries this tool did not write (notes.txt)"
    else:
        (root / destination.ROOT_MARKER).unlink()
        fragment = "is not a checkpoint this tool wrote"
    before = snapshot(tmp_path)
    result = run("migrate", "convert", CONFIG, "--from=nnx", "--to=maxtext", "--force",
                 str(twins_checkpoint), str(root), *TWIN_KEYS, timeout=60)  # fmt: skip
    refused(result, errors.EXIT_USAGE, str(root), fragment, "not replacing it, even with --force")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ environments, installed


def environments_command(*args: str):
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "parity.maxtext.build_envs", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@needs_envs
def test_a_built_environment_is_left_as_it_is():
    """`python -m parity.maxtext.build_envs` (what `make maxtext-envs` runs): on a release's
    built environment it installs nothing again (its stamps unchanged) and prints its
    interpreter, the one the gate finds by default."""
    from parity.maxtext import build_envs

    venv = build_envs.venv_path("0.2.3", REPO)
    stamps = {p: p.stat().st_mtime_ns for p in (venv / ".installed", venv / ".imports-checked")}
    done = environments_command("--dir", str(REPO), "0.2.3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        done.stdout.strip() == str(venv / "bin" / "python") == gate_config.default_python("linen")
    )
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


@pytest.mark.slow
def test_an_unknown_release_is_refused():
    done = environments_command("--dir", str(REPO), "0.9.9")
    assert done.returncode == 2 and "not a release this project maps" in done.stderr


MOE = ("decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=128")


@pytest.mark.slow
def test_an_moe_config_on_the_megablox_kernel_is_refused_naming_the_keys_that_fix_it():
    """MaxText's MoE layers default to its megablox kernel, which the CPU cannot run: refused
    before any worker starts, the keys of the dense path named; with them the config passes."""
    refused(
        maxtext(*MOE, "--dry_run"), 2, "megablox MoE kernel", "megablox=false sparse_matmul=false"
    )
    dense = gate_config.load(PP4, [*MOE, "megablox=false", "sparse_matmul=false"])
    assert dense.keys["num_experts"] == 4


SPLIT = (
    "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "base_num_decoder_layers=8",
    "num_pipeline_microbatches=8", "pipeline_fsdp_ag_once=true",
)  # fmt: skip


@pytest.mark.slow
def test_a_microbatch_that_cannot_split_over_fsdp_is_refused_before_the_workers():
    """One sequence a microbatch over fsdp 4: both releases stop in a `shard_map` after the
    first checks; refused in seconds, the keys named. Four sequences a microbatch split."""
    refused(maxtext(*SPLIT, "--dry_run"), 2, "num_pipeline_microbatches=8", "fsdp")
    fits = gate_config.load(PP4, [*SPLIT, "per_device_batch_size=4"])
    assert fits.keys["per_device_batch_size"] == 4
    for shipped in sorted((REPO / "configs" / "maxtext").glob("*.yml")):
        if shipped.stem != "base":
            gate_config.load(shipped, [])  # every shipped shape splits
