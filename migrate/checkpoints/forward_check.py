"""`migrate convert --verify_forward`: the parity `forward` check on the converted weights,
run by the harness's own command in a subprocess (`migrate` never imports `parity`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from migrate import errors


def problems(
    path: Path,
    spec: Any,
    *,
    config: str,
    overrides: Sequence[str] = (),
    verbose: bool = False,
    say: Callable[[str], None] = print,
) -> list[str]:
    """The parity `forward` check (Linen and NNX logits and loss, both weight sources) on the
    weights of the checkpoint at `path`; problems, or none when it passes.

    It runs as `parity CONFIG --checks=forward --checkpoint=PATH` in a subprocess (the same
    interpreter), the config taking the checkpoint's recorded layout keys."""
    del spec  # the checkpoint's own `meta` says what it holds
    with tempfile.TemporaryDirectory(prefix="migrate-verify-") as scratch:
        report = Path(scratch) / "forward.json"
        command = [
            sys.executable,
            "-m",
            "parity.cli",
            str(config),
            *overrides,
            "--checks=forward",
            f"--checkpoint={path}",
            f"--json={report}",
            *(["--verbose"] if verbose else []),
        ]
        finished = subprocess.run(command, capture_output=True, text=True)
        status = finished.returncode
        result = _forward_result(report) if report.exists() else None
    verdicts = {errors.EXIT_PASS: "PASS", errors.EXIT_FAIL: "FAIL"}
    say(f"forward check on the converted weights: {verdicts.get(status, f'exit {status}')}")
    if status == errors.EXIT_PASS:
        return []
    if status == errors.EXIT_FAIL and result is not None:
        return [
            f"forward check: {result['where']}: {result['metric']} {result['value']:.3g} > "
            f"tolerance {result['tolerance']:.3g} {result['message']}".strip()
        ]
    last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
    why = f"--verify_forward: the parity forward check could not run (exit {status}): {last}"
    if status == errors.EXIT_USAGE:
        raise errors.BadInput(why)
    # A crash or a lost worker of the child is not a verdict on the weights, nor bad input.
    raise RuntimeError(why)


def _forward_result(report: Path) -> dict[str, Any] | None:
    checks = json.loads(report.read_text())["checks"]
    forward = next((c for c in checks if c["name"] == "forward"), None)
    return None if forward is None else {**forward["worst"], "message": forward["message"]}
