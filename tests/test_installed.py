"""The gate as users install it: the wheel built from this checkout, installed into a fresh
venv outside it (this stack's pins), run from a folder of the user's that holds nothing of the
project: `parity` on a config of theirs with no `base.yml` beside it (the shipped base), a
shipped config by name, `migrate init` and `convert`, and `assert_parity` on a small pair in a
test file of their own under pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import session_root

pytestmark = [pytest.mark.slow, pytest.mark.compat]  # installed under each stack's pins

REPO = Path(__file__).resolve().parent.parent
PINS = REPO / "constraints" / f"py{sys.version_info.major}{sys.version_info.minor}.txt"
USER_CONFIG = """\
model_name: my-decoder
base_num_decoder_layers: 4
ici_pipeline_parallelism: 2
num_pipeline_microbatches: 4
"""
USER_TEST = """\
import flax.linen as nn
import jax
from flax import nnx

from parity.testing import assert_parity


class LinenScale(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("scale", nn.initializers.ones, (x.shape[-1],))


class NNXScale(nnx.Module):
    def __init__(self, features, rngs):
        self.scale = nnx.Param(jax.numpy.ones((features,)))

    def __call__(self, x):
        return x * self.scale[...]


def test_my_port():
    assert_parity(LinenScale(), NNXScale(4, nnx.Rngs(0)), jax.numpy.ones((2, 4)))
"""


def user_environment(*dropped: str) -> dict[str, str]:
    """This environment as a user's shell has it: no PYTHONPATH or VIRTUAL_ENV of the suite's
    (nor `dropped`), 8 simulated devices."""
    gone = ("PYTHONPATH", "VIRTUAL_ENV", *dropped)
    env = {k: v for k, v in os.environ.items() if k not in gone}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return env


def run(
    venv: Path, *args: str, cwd: Path, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=cwd,
        env=env or user_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this checkout (and pytest) installed under the pins: built
    once per session, whatever the pytest-xdist workers (the first to take the lock builds it
    in the session's shared temporary root; the others use it)."""
    from filelock import FileLock

    where = session_root(tmp_path_factory) / "installed"
    venv, done = where / "venv", where / "built"
    with FileLock(f"{where}.lock"):
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)  # a build that did not finish
            _build(where, venv)
            done.touch()
    return venv


def _build(where: Path, venv: Path) -> None:
    wheels, source = where / "wheels", where / "source"
    # Built from a copy: an in-tree build would leave build/ and egg-info in the checkout.
    generated = (".git", ".venv*", ".jax_cache", "build", "*.egg-info", "__pycache__")
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*generated))
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "-w",
        str(wheels),
        str(source),
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(PINS)]
    subprocess.run([*pip, str(wheel), "pytest"], check=True, capture_output=True, timeout=900)


def test_a_user_config_without_a_base_beside_it_runs_on_the_shipped_base(installed, tmp_path):
    (tmp_path / "my.yml").write_text(USER_CONFIG)
    done = run(installed, "parity", "my.yml", "--checks=forward", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shipped = "migrate/config/shipped/base.yml"
    assert "[parity] config my.yml over " in done.stderr and shipped in done.stderr
    assert "site-packages" in done.stderr and str(REPO) not in done.stderr
    assert "PASS" in done.stdout


def test_a_base_beside_the_config_wins(installed, tmp_path):
    (tmp_path / "my.yml").write_text(USER_CONFIG)
    shipped = (REPO / "configs" / "base.yml").read_text()
    (tmp_path / "base.yml").write_text(shipped.replace("vocab_size:", "vocab_size: 512 #"))
    done = run(installed, "parity", "my.yml", "--dry_run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[parity] config my.yml over base.yml" in done.stderr


def test_a_shipped_config_runs_by_name(installed, tmp_path):
    done = run(installed, "parity", "llama2-tiny", "--checks=roundtrip", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "llama2-tiny.yml over" in done.stderr and "PASS" in done.stdout


def test_migrate_init_and_convert_run_installed(installed, tmp_path):
    init = ["migrate", "init", "--config=llama2-tiny", "--framework=linen", "ckpt/linen"]
    done = run(installed, *init, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    convert = ["migrate", "convert", "--config=llama2-tiny", "--from=linen", "--to=nnx"]
    done = run(installed, *convert, "--verify", "ckpt/linen", "ckpt/nnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ckpt" / "nnx").is_dir()


def test_assert_parity_in_a_users_own_test_file(installed, tmp_path):
    (tmp_path / "test_my_port.py").write_text(textwrap.dedent(USER_TEST))
    done = run(installed, "python", "-m", "pytest", "-q", "test_my_port.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout


def workflow() -> dict:
    """The GitHub Actions workflow docs/ci.md shows (its first ```yaml block)."""
    import yaml

    text = (REPO / "docs" / "ci.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_the_ci_workflow_caches_where_parity_compiles_and_gates_as_written(installed, tmp_path):
    """docs/ci.md's workflow: its cache is the folder `parity` compiles through by default, and
    its gate step, run as written (bash, the installed `parity` on the path) on the user's
    config, exits 0 and leaves both reports."""
    steps = {
        step.get("name", step.get("uses")): step for step in workflow()["jobs"]["parity"]["steps"]
    }
    cached = steps["Restore the compiled programs"]["with"]["path"]
    default = run(
        installed,
        "python",
        "-c",
        "from parity import cli; print(cli.FLAGS['compilation_cache_dir'].default)",
        cwd=installed,  # not the user's folder: `python -c` imports from the working directory
        env=user_environment("JAX_COMPILATION_CACHE_DIR"),
    )
    assert Path(cached).expanduser() == Path(default.stdout.strip()), default.stderr[-2000:]
    assert steps["Install the gate"]["run"].startswith("pip install ")
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "my-decoder.yml").write_text(USER_CONFIG)
    env = user_environment()
    env["PATH"] = f"{installed / 'bin'}{os.pathsep}{env['PATH']}"
    script = steps["Gate the migration"]["run"].replace(
        "parity gate/", "parity --checks=forward gate/"
    )
    done = subprocess.run(
        ["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "reports" / "parity.xml").is_file()
    assert (tmp_path / "reports" / "parity.json").is_file()
