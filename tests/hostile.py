"""Helpers for the bad-input tests: the commands as a user runs them, the exit-code contract's
assertions, and a snapshot of a directory to prove that nothing outside the destination was
removed or changed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
TINY = str(CONFIGS / "llama2-tiny.yml")


def command(program: str) -> list[str]:
    """The installed console script (module form when not installed)."""
    script = Path(sys.executable).parent / program
    module = {"parity": "parity.cli", "migrate": "migrate.cli"}[program]
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def run(
    program: str,
    *args: str | bytes,
    timeout: float = 60,
    cwd: Path | str = REPO,
    preexec_fn=None,
) -> subprocess.CompletedProcess:
    """`program ARGS` in a subprocess (killed at `timeout`: a hang fails the test)."""
    return subprocess.run(
        [*command(program), *args],
        cwd=cwd,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=preexec_fn,
    )


def refused(result: subprocess.CompletedProcess, status: int, *fragments: str) -> str:
    """Assert `status`, one `PROGRAM: error:` line naming each fragment, no traceback; returns
    stderr."""
    err = result.stderr.decode("utf-8", "backslashreplace")
    assert result.returncode == status, f"exit {result.returncode}, wanted {status}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if MESSAGE.match(line)]
    assert len(lines) == 1, err[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert len(err) < 20_000, f"stderr of {len(err)} characters"
    return err


MESSAGE = re.compile(r"(parity|migrate): (error|internal error|interrupted): ")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (symlinks not followed) -> the SHA-256 of its bytes, or its kind."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = f"symlink -> {os.readlink(path)}"
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """`directory` unwritable for this process: mode 0o555, and for root (who ignores modes)
    the immutable attribute; skips the test where neither works."""
    import pytest

    mode = directory.stat().st_mode
    directory.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable:
        done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
        if done.returncode:
            directory.chmod(mode)
            pytest.skip(f"running as root and chattr +i fails here: {done.stderr!r}")
    try:
        assert not os.access(directory, os.W_OK)
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(mode)


def unreadable(path: Path) -> None:
    """Make the file `path` unreadable for this process: mode 0o000, or for root (who ignores
    modes) a link to /proc/self/mem, whose reading fails with EIO."""
    if os.geteuid() == 0:
        path.unlink(missing_ok=True)
        path.symlink_to("/proc/self/mem")
    else:
        path.chmod(0)


def config_dir(tmp_path: Path, model_yaml: str | bytes, name: str = "model.yml") -> Path:
    """A config folder: the shipped base.yml and `model_yaml`; returns the model YAML's path."""
    folder = tmp_path / "configs"
    folder.mkdir(exist_ok=True)
    (folder / "base.yml").write_bytes((CONFIGS / "base.yml").read_bytes())
    path = folder / name
    path.write_bytes(model_yaml if isinstance(model_yaml, bytes) else model_yaml.encode())
    return path
