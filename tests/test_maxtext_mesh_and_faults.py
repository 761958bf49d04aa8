"""MaxText's mesh as MaxText sizes it (a -1 axis filled from the slice's devices, MaxText's own
defaults for the axes a config leaves out), and a release's own exception told apart from a
fault of this tool, from a worker's traceback. Pure Python: no JAX, no worker."""

from __future__ import annotations

import pytest

from migrate.errors import BadInput
from parity.maxtext import gate_config, release_fault
from parity.maxtext.mesh import resolve_mesh
from parity.remote.client import WorkerError

# ------------------------------------------------------------------ the mesh


@pytest.mark.parametrize(
    ("keys", "per_slice", "slices", "filled"),
    [
        # MaxText's default ici_fsdp_parallelism=-1 takes the devices the other axes leave
        ({"ici_pipeline_parallelism": 4}, 8, 1, {"ici_fsdp_parallelism": 2}),
        (
            {"ici_tensor_parallelism": 2, "ici_fsdp_parallelism": -1},
            8,
            1,
            {"ici_fsdp_parallelism": 4},
        ),
        # a -1 elsewhere, fsdp given
        (
            {"ici_fsdp_parallelism": 2, "ici_data_parallelism": -1},
            8,
            1,
            {"ici_data_parallelism": 4, "ici_fsdp_parallelism": 2},
        ),
        # MaxText's train-compile case test_pipeline_subset: 64 devices a slice of v5p-128
        (
            {"ici_expert_parallelism": 16, "dcn_pipeline_parallelism": 8},
            64,
            8,
            {"ici_fsdp_parallelism": 4, "dcn_data_parallelism": 1},
        ),
        # a DCN -1 takes the slices left
        (
            {"dcn_data_parallelism": -1, "dcn_pipeline_parallelism": 2},
            4,
            8,
            {"dcn_data_parallelism": 4},
        ),
    ],
)
def test_a_minus_one_axis_is_filled_as_maxtext_fills_it(keys, per_slice, slices, filled):
    mesh = resolve_mesh(keys, per_slice, slices)
    assert {k: mesh[k] for k in filled} == filled
    assert all(v >= 1 for v in mesh.values())
    assert -1 not in mesh.values()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"ici_fsdp_parallelism": -1, "ici_data_parallelism": -1},
            "ici_fsdp_parallelism=-1, ici_data_parallelism=-1: MaxText fills at most one ICI axis",
        ),
        (
            {"ici_tensor_parallelism": 3},
            "ici_fsdp_parallelism=-1: the other ICI axes multiply to 3, which does not divide the "
            "8 devices of a slice",
        ),
        (
            {"dcn_data_parallelism": -1, "dcn_fsdp_parallelism": -1},
            "MaxText fills at most one DCN axis with the slices left",
        ),
    ],
)
def test_a_mesh_maxtext_cannot_fill_is_refused_with_both_numbers(keys, message):
    with pytest.raises(BadInput, match=message.replace("(", r"\(")):
        resolve_mesh(keys, 8, 1, "c.yml")


def test_a_config_is_resolved_against_the_simulated_cpu_or_the_tpu_slice(tmp_path, monkeypatch):
    """On the CPU a -1 takes the simulated devices (XLA_FLAGS' count) and the workers are given
    the filled axis; on a TPU slice the slice's devices, and the keys keep the -1 for the
    release's own train_compile to fill. Both show the resolved mesh."""
    config = tmp_path / "c.yml"
    config.write_text(
        "maxtext:\n  vocab_size: 128\n  per_device_batch_size: 1\n  max_target_length: 16\n"
        "  ici_pipeline_parallelism: 2\n  ici_fsdp_parallelism: -1\n"
    )
    (tmp_path / "base.yml").write_text("maxtext: {}\n")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    cpu = gate_config.load(config, [])
    assert cpu.num_devices == 8 and cpu.keys["ici_fsdp_parallelism"] == 4
    assert cpu.mesh["ici_fsdp_parallelism"] == 4 and "ici_fsdp_parallelism" in cpu.filled
    assert "(mesh fsdp 4 x pipeline 2; ici_fsdp_parallelism=-1 -> 4)" in cpu.describe()
    tpu = gate_config.load(config, [], topology="v5p-32")  # 16 devices a slice
    assert tpu.num_devices == 16 and tpu.keys["ici_fsdp_parallelism"] == -1
    assert tpu.mesh["ici_fsdp_parallelism"] == 8
    # the -1 a config leaves to MaxText's default is filled the same way
    config.write_text(config.read_text().replace("  ici_fsdp_parallelism: -1\n", ""))
    assert gate_config.load(config, []).keys["ici_fsdp_parallelism"] == 4


# ------------------------------------------------------------------ a release's own exception


def traceback_of(*frames: str, error: str = "TypeError: f() missing 1 required argument") -> str:
    lines = ["Traceback (most recent call last):"]
    for frame in frames:
        path, line, function = frame.split(":")
        lines += [f'  File "{path}", line {line}, in {function}', "    code()"]
    return "\n".join([*lines, error])


SITE = "/venv/lib/python3.12/site-packages"
WORKER = "/tmp/parity-worker-x/packages/parity/remote/worker.py:180:op_start"
FACTORY = "/tmp/parity-worker-x/packages/parity/maxtext/decoder_factory.py:650:make"


def worker_error(side: str, detail: str, where: str = "model") -> WorkerError:
    message = detail.splitlines()[-1].split(": ", 1)[1]
    return WorkerError(
        side, {"where": where, "type": "TypeError", "message": message, "detail": detail}
    )


def test_the_releases_own_code_raising_is_its_fault_named_by_file_and_line():
    """Past the libraries (flax raised, called by MaxText), MaxText's frame is the place."""
    detail = traceback_of(
        WORKER,
        FACTORY,
        f"{SITE}/maxtext/layers/decoders.py:612:get_pipeline_stage_module",
        f"{SITE}/maxtext/layers/nnx_wrappers.py:457:__call__",
        f"{SITE}/flax/linen/module.py:700:_call_wrapped_method",
    )
    fault = release_fault.of(worker_error("linen", detail), "linen")
    assert fault is not None
    assert (fault.release, fault.file, fault.line) == (
        "0.2.3",
        "maxtext/layers/nnx_wrappers.py",
        457,
    )
    assert fault.describe() == (
        "maxtext 0.2.3 (the linen side) raises TypeError in its own "
        "maxtext/layers/nnx_wrappers.py:457 (__call__): f() missing 1 required argument"
    )


@pytest.mark.parametrize(
    "frames",
    [
        # this project's code raised (a jax call of ours, under a MaxText frame): our fault
        (
            WORKER,
            f"{SITE}/maxtext/layers/pipeline.py:100:run",
            FACTORY,
            f"{SITE}/jax/_src/api.py:1:f",
        ),
        # nothing of MaxText's on the stack
        (WORKER, FACTORY),
    ],
)
def test_this_projects_code_raising_is_never_the_releases_fault(frames):
    assert release_fault.of(worker_error("nnx", traceback_of(*frames)), "nnx") is None


def test_a_lost_or_misused_worker_is_never_the_releases_fault():
    detail = traceback_of(f"{SITE}/maxtext/layers/pipeline.py:100:run")
    assert release_fault.of(worker_error("nnx", detail, where="worker"), "nnx") is None
    assert release_fault.of(ValueError("x"), "nnx") is None


def faults(**sides: release_fault.ReleaseFault) -> release_fault.Faults:
    completed = [s for s in ("linen", "nnx") if s not in sides]
    return release_fault.Faults("building its decoder", sides, completed)


FAULT = {
    side: release_fault.ReleaseFault(side, "TypeError", "maxtext/x.py", 3, "f", "boom")
    for side in ("linen", "nnx")
}


def test_the_nnx_release_alone_failing_is_a_migration_regression():
    found = faults(nnx=FAULT["nnx"])
    assert found.bad_input() is None
    result = found.result("build")
    assert result.status == "failed" and not result.passed
    (record,) = result.details
    assert record["other_release"] == "maxtext 0.2.3 (the linen side) completes it"
    assert record["raised_at"] == "maxtext/x.py:3 (f)" and record["error"] == "TypeError: boom"


@pytest.mark.parametrize(
    ("sides", "start"),
    [
        ({"linen": FAULT["linen"]}, "the Linen release refuses the config (building its decoder)"),
        (FAULT, "both releases refuse the config (building its decoder)"),
    ],
)
def test_the_linen_release_failing_is_bad_input_in_one_line(sides, start):
    found = faults(**sides)
    line = found.bad_input()
    assert line is not None and line.startswith(start) and "\n" not in line
    assert "maxtext 0.2.3 (the linen side) raises TypeError in its own maxtext/x.py:3" in line
    assert found.result("compile").status == "bad_input"


def test_a_mesh_across_slices_is_refused_on_the_cpu_and_compiled_for_a_tpu(tmp_path):
    """Both releases refuse DCN axes on one host ("only one slice available") after their
    workers start: refused before, naming `--topology`, which compiles it for slices."""
    config = tmp_path / "c.yml"
    config.write_text(
        "maxtext:\n  vocab_size: 128\n  per_device_batch_size: 1\n  max_target_length: 16\n"
        "  ici_pipeline_parallelism: 2\n  ici_fsdp_parallelism: 2\n  dcn_pipeline_parallelism: 2\n"
    )
    (tmp_path / "base.yml").write_text("maxtext: {}\n")
    with pytest.raises(BadInput, match="dcn_pipeline_parallelism=2: MaxText lays DCN axes across"):
        gate_config.load(config, [])
    on_slices = gate_config.load(config, [], topology="v5e-4")
    assert on_slices.mesh["dcn_pipeline_parallelism"] == 2 and on_slices.num_devices == 4
