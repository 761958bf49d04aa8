"""Renderers for check results: terminal table and JSON. Only this module prints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from migrate.config import Config

JSON_SCHEMA_VERSION = 1


def render_table(results: Sequence[Any], cfg: Config, console: Console | None = None) -> None:
    """check | verdict | worst error | tolerance | where."""
    console = console or Console()
    table = Table(title=f"parity: {cfg.model_name}")
    for column in ("check", "verdict", "worst error", "tolerance", "where"):
        table.add_column(column)
    for r in results:
        verdict = "[green]PASS[/green]" if r.passed else "[bold red]FAIL[/bold red]"
        table.add_row(r.name, verdict, f"{r.metric}={r.value:.3g}", f"{r.tolerance:.3g}", r.where)
    console.print(table)
    for r in results:
        if r.message:
            console.print(f"  {r.name}: {r.message}")


def to_json(results: Sequence[Any], cfg: Config) -> dict[str, Any]:
    """The versioned machine-readable report."""
    return {
        "version": JSON_SCHEMA_VERSION,
        "config": cfg.model_name,
        "passed": all(r.passed for r in results),
        "checks": [
            {
                "name": r.name,
                "passed": r.passed,
                "worst": {
                    "metric": r.metric,
                    "value": r.value,
                    "tolerance": r.tolerance,
                    "where": r.where,
                },
                "message": r.message,
                "details": list(r.details),
            }
            for r in results
        ],
    }


def write_json(results: Sequence[Any], cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(results, cfg), indent=2, sort_keys=True) + "\n")


__all__ = ["JSON_SCHEMA_VERSION", "render_table", "to_json", "write_json"]
