"""The report files of a `parity` run: checked before any check runs, written after the last.

A path that cannot be written (a directory, a parent that is a file, a read-only folder, a
broken link, a folder that takes no new file such as /proc) is refused up front with exit 2;
missing parent folders are created then. An existing golden file is read and checked up front
too; a missing one is refused where one is required (`require_golden`), else noted. A report
that still cannot be written at the end is named on stderr and gives exit 2; the verdict table
is already on stdout, the verdict line follows. The golden file's name comes from the model
name made a safe file name (`report.file_stem`). No JAX here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from migrate import errors
from migrate.config import safe_load
from migrate.errors import EXIT_PASS, BadInput
from migrate.runtime import cli_support
from parity.reports import report

MAX_GOLDEN_BYTES = 64 << 20


def read_golden(path: Path) -> dict[str, Any]:
    """A golden sharding report: parameter -> {names, shape, spec}; anything else is BadInput."""
    data = safe_load.load_json_file(path, MAX_GOLDEN_BYTES, "golden file")
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise BadInput(
            f"golden file {path}: not a golden sharding report (a mapping of parameter -> "
            "names, shape, spec); rerun with --update_golden to rewrite it"
        )
    return data


def _golden_missing(flag_value: str, path: Path) -> BadInput:
    return BadInput(
        f"--golden={flag_value}: no golden file {path} (a missing golden file is an error "
        "under CI=true and with --require_golden); write it once with --update_golden and "
        "commit it"
    )


def _progress(message: str) -> None:
    print(f"[parity] {message}", file=sys.stderr, flush=True)


class Outputs:
    """The requested report paths (None where not requested), checked on construction."""

    def __init__(
        self,
        json: str | None,
        junit: str | None,
        plot: str | None,
        golden: str | None,
        update_golden: bool,
        model_name: str,
        require_golden: bool = False,
    ) -> None:
        check = cli_support.check_output_file
        self.json = check(json, "--json") if json else None
        self.junit = check(junit, "--junit") if junit else None
        self.plot = check(plot, "--plot") if plot else None
        if self.plot and importlib.util.find_spec("matplotlib") is None:
            raise BadInput("--plot needs matplotlib: install the package's `plot` extra")
        self.golden: Path | None = None
        self.golden_data: dict[str, Any] | None = None
        self.golden_missing = False  # no golden file: this run writes the first one
        if golden:
            self.golden = report.golden_path(golden, model_name)
            found = self.golden.exists() or self.golden.is_symlink()
            missing = not found and not update_golden
            if missing and require_golden and not Path(golden).exists():
                raise _golden_missing(golden, self.golden)  # before its folder is made
            cli_support.ensure_directory(Path(golden), "--golden")
            if not update_golden and found:
                self.golden_data = read_golden(self.golden)
            elif self.golden.is_dir():
                raise BadInput(f"--golden: {self.golden} is a directory")
            elif missing and require_golden:
                raise _golden_missing(golden, self.golden)
            self.golden_missing = missing

    def write(
        self,
        results: Sequence[Any],
        name: str,
        costs: Sequence[dict[str, Any]],
        facts: dict[str, Any] | None = None,
    ) -> int:
        """Each requested report (`costs`: per result, `compiles.Cost.as_json()`; `facts`: the
        JSON report's top-level fields of the run); the exit status of those that could not be
        written (named on stderr), EXIT_PASS when all were."""
        status = EXIT_PASS
        durations = [cost["wall_seconds"] for cost in costs]
        writers = (
            ("--json", self.json, lambda p: report.write_json(results, name, p, costs, facts)),
            ("--junit", self.junit, lambda p: report.write_junit(results, name, p, durations)),
            ("--plot", self.plot, lambda p: report.write_plot(results, name, p)),
        )
        for flag, path, write in writers:
            if path is None:
                continue
            try:
                if write(path) is False:
                    _progress(f"{flag}: no train check ran, nothing to plot")
            except Exception as e:
                code, _, message = errors.classify(e)
                status = max(status, code)
                cli_support.error_line(
                    "parity", f"{flag}: the report {path} was not written ({message})"
                )
        return status

    def write_golden(self, current: dict[str, Any]) -> None:
        """The golden sharding report, written where `--golden` names it (sorted JSON)."""
        assert self.golden is not None
        self.golden.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
        _progress(f"golden sharding report written: {self.golden}")
