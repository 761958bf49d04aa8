"""Renderers for check results: terminal table, JSON, JUnit XML, plot. Only this prints.

The JSON schema is versioned (`JSON_SCHEMA_VERSION`) and documented in docs/report-schema.md.
Text from configs and errors is printed as it is where it can be encoded and escaped where it
cannot (`printable`); file names derived from a config (`file_stem`) stay inside their folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from migrate import errors

JSON_SCHEMA_VERSION = 1
VERDICTS = {
    "passed": "[green]PASS[/green]",
    "skipped": "[dim]SKIP[/dim]",
    "failed": "[bold red]FAIL[/bold red]",
    "bad_input": "[bold magenta]ERROR[/bold magenta]",
    "errored": "[bold magenta]ERROR[/bold magenta]",
}


def printable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates from undecodable bytes)
    backslash-escaped, so that printing or writing it never raises."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def file_stem(name: str) -> str:
    """`name` as one safe file name: characters other than letters, digits, `.`, `_`, `+`
    and `-` become `_`, and it never starts with a dot (`../x` -> `_.._x`)."""
    stem = re.sub(r"[^A-Za-z0-9._+-]", "_", name)[:200] or "_"
    return f"_{stem}" if stem.startswith(".") else stem


def golden_path(directory: str | Path, model_name: str) -> Path:
    """The golden sharding report of `model_name` in `directory`, always directly inside it."""
    path = Path(directory) / f"{file_stem(model_name)}.sharding.json"
    assert path.parent == Path(directory), path
    return path


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.3g}"


def _measured(r: Any) -> tuple[str, str]:
    """The worst-error and tolerance cells: `-` for a skipped check (it measured nothing)."""
    if r.status == "skipped":
        return "-", "-"
    return f"{r.metric}={_fmt(r.value)}", _fmt(r.tolerance)


# Neither a terminal nor COLUMNS (a CI log): this wide; rich reads COLUMNS, else the terminal.
LOG_WIDTH = 120
WHERE = 4  # the "where" column
MIN_WHERE = 24  # its width however narrow the console: a path part fits
EXIT_OF_STATUS = {
    "passed": errors.EXIT_PASS,
    "skipped": errors.EXIT_PASS,
    "failed": errors.EXIT_FAIL,
    "bad_input": errors.EXIT_USAGE,
    "errored": errors.EXIT_INTERNAL,
}
COST_CAPTION = (
    "compiles: XLA compilations (cached: read from the cache); seconds: compile/run/compare"
)


def console_for_stdout() -> Console:
    """stdout's console: `COLUMNS` wide when set, else the terminal's width (`LOG_WIDTH` when
    stdout is not a terminal)."""
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return Console()
    return Console(width=LOG_WIDTH)


def verdict_line(results: Sequence[Any], reports_status: int = errors.EXIT_PASS) -> str:
    """The run in one line: `PASS: 9 checks` (`, 1 skipped`), or the checks that did not pass
    by kind and the exit status (`FAIL: grads, train (exit 1)`); `reports_status`: a report
    that could not be written (its exit status) after the checks passed."""
    status = max([EXIT_OF_STATUS[r.status] for r in results], default=errors.EXIT_PASS)
    failed = [r.name for r in results if r.status == "failed"]
    broken = [r.name for r in results if r.status in ("bad_input", "errored")]
    parts = [f"FAIL: {', '.join(failed)}"] if failed else []
    parts += [f"ERROR: {', '.join(broken)}"] if broken else []
    if not parts:
        skipped = sum(r.status == "skipped" for r in results)
        counted = f"{len(results)} check{'s' if len(results) != 1 else ''}"
        parts = [f"PASS: {counted}" + (f", {skipped} skipped" if skipped else "")]
    if reports_status > status:
        parts.append("a report was not written")
        status = reports_status
    line = "; ".join(parts)
    return line if status == errors.EXIT_PASS else f"{line} (exit {status})"


def wrap_path(text: str, width: int) -> str:
    """`text` in lines of at most `width` characters, broken after a `/` or a space, so that a
    tensor path stays readable (`.../mlp/` then `wo/kernel`); only a part longer than `width`
    is cut inside."""
    lines, line = [], ""
    for part in re.split(r"(?<=[/\s])", text):
        if line and len(line) + len(part.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += part
        while len(line.rstrip()) > width:
            lines.append(line[:width])
            line = line[width:]
    if line.strip() or not lines:
        lines.append(line.rstrip())
    return "\n".join(lines)


def render_table(
    results: Sequence[Any],
    name: str,
    console: Console | None = None,
    costs: Sequence[dict[str, Any]] | None = None,
    verdict: bool = True,
) -> None:
    """check | verdict | worst error | tolerance | where (failing rows only) (| compiles |
    seconds, with `costs`: one `compiles.Cost.as_json()` per result, and a total row); then
    each check's note, then (`verdict`) the verdict line. As wide as the console: the "where"
    column takes the room left and breaks a path only after a `/`; a console too narrow for
    the cost columns gets the total cost as a line instead."""
    console = console or console_for_stdout()
    table = _table(results, name, console.width, costs)
    if table is None:  # too narrow for the cost columns
        table = _table(results, name, console.width, None)
        total = total_cost(costs or [])
        cells = _cost_cells(total)
        console.print(table)
        console.print(f"cost: {cells[0]} compiles, {cells[1]} s compile/run/compare", markup=False)
    else:
        console.print(table)
    for r in results:
        if r.message:
            console.print(printable(f"  {r.name}: {r.message}"), soft_wrap=True, markup=False)
    if verdict:
        console.print(verdict_line(results), markup=False, highlight=False)


def _table(
    results: Sequence[Any], name: str, width: int, costs: Sequence[dict[str, Any]] | None
) -> Table | None:
    """The verdict table `width` columns wide; None when the cost columns leave "where" less
    than `MIN_WHERE`."""
    rows: list[list[str]] = []
    for i, r in enumerate(results):
        where = "" if r.status in ("passed", "skipped") else r.where
        cost = [] if costs is None else _cost_cells(costs[i])
        rows.append([r.name, r.status, *_measured(r), where, *cost])
    if costs is not None:
        rows.append(["total", "", "", "", "", *_cost_cells(total_cost(costs))])
    headers = ["check", "verdict", "worst error", "tolerance", "where"]
    headers += ["compiles", "seconds"] if costs is not None else []
    cells = [[printable(c) for c in row] for row in rows]
    for row in cells:
        row[1] = Text.from_markup(VERDICTS[row[1]]).plain if row[1] else ""
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(headers)]
    # Each column adds two spaces of padding and a border, the table one border more.
    room = width - (sum(widths) - widths[WHERE]) - 3 * len(headers) - 1
    if costs is not None and room < MIN_WHERE:
        return None
    table = Table(title=Text(printable(f"parity: {name}")))
    for j, header in enumerate(headers):
        right = costs is not None and j > WHERE
        table.add_column(header, no_wrap=True, justify="right" if right else "left")
    for row, (_, status, *_) in zip(cells, rows, strict=True):
        row[WHERE] = wrap_path(row[WHERE], max(room, MIN_WHERE))
        verdict_cell = Text.from_markup(VERDICTS[status]) if status else Text("")
        table.add_row(*(verdict_cell if j == 1 else Text(c) for j, c in enumerate(row)))
    if costs is not None:
        table.caption = COST_CAPTION
    return table


def _cost_cells(cost: dict[str, Any]) -> list[str]:
    reads = f" ({cost['cache_reads']} cached)" if cost["cache_reads"] else ""
    seconds = (cost["compile_seconds"], cost["run_seconds"], cost["compare_seconds"])
    return [f"{cost['compilations']}{reads}", "/".join(f"{x:.1f}" for x in seconds)]


def total_cost(costs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sum of per-check costs (`compiles.Cost.as_json()`), programs concatenated."""
    total: dict[str, Any] = {"programs": []}
    for cost in costs:
        for key, value in cost.items():
            total[key] = total.get(key, 0) + value if key != "programs" else total[key] + value
    return total


def to_json(
    results: Sequence[Any],
    name: str,
    costs: Sequence[dict[str, Any]] | None = None,
    facts: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The versioned machine-readable report; with `costs` (one `compiles.Cost.as_json()` per
    result), each check's `cost` and the run's total; `facts`: top-level fields of the run
    (`--maxtext`: the `sides`)."""
    report = {
        "version": JSON_SCHEMA_VERSION,
        "config": name,
        "passed": all(r.passed for r in results),
        "checks": [
            {
                "name": r.name,
                "passed": r.passed,
                "status": r.status,
                "worst": {
                    "metric": r.metric,
                    "value": r.value,
                    "tolerance": r.tolerance,
                    "where": r.where,
                },
                "message": r.message,
                "details": list(r.details),
                "steps": list(r.steps),
            }
            for r in results
        ],
    }
    report.update(facts or {})
    if costs is not None:
        for check, cost in zip(report["checks"], costs, strict=True):
            check["cost"] = cost
        report["cost"] = total_cost(costs)
    return report


def write_json(
    results: Sequence[Any],
    name: str,
    path: str | Path,
    costs: Sequence[dict[str, Any]] | None = None,
    facts: Mapping[str, Any] | None = None,
) -> None:
    report = to_json(results, name, costs, facts)
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")


def write_junit(
    results: Sequence[Any], name: str, path: str | Path, durations: Sequence[float] | None = None
) -> None:
    """One testsuite per config, one testcase per check; failures carry the worst error."""
    durations = list(durations or [0.0] * len(results))
    root = ET.Element("testsuites")
    suite = ET.SubElement(
        root,
        "testsuite",
        name=f"parity.{name}",
        tests=str(len(results)),
        failures=str(sum(r.status == "failed" for r in results)),
        errors=str(sum(r.status in ("bad_input", "errored") for r in results)),
        skipped=str(sum(r.status == "skipped" for r in results)),
        time=f"{sum(durations):.3f}",
    )
    for r, seconds in zip(results, durations, strict=True):
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"parity.{name}",
            name=r.name,
            time=f"{seconds:.3f}",
        )
        if r.status == "failed":
            failure = ET.SubElement(
                case,
                "failure",
                message=printable(
                    f"{r.metric}={_fmt(r.value)} > tolerance {_fmt(r.tolerance)} at {r.where}"
                ),
            )
            failing = [d for d in r.details if not d.get("passed", True)][:20]
            failure.text = printable(
                "\n".join([r.message, *(json.dumps(d, default=str) for d in failing)])
            )
        elif r.status == "skipped":
            ET.SubElement(case, "skipped", message=printable(r.message[:2000]))
        elif r.status != "passed":  # the check could not run: a JUnit error, not a failure
            ET.SubElement(case, "error", message=printable(r.message[:2000]), type=r.status)
    tree = ET.ElementTree(root)
    ET.indent(tree)
    tree.write(path, encoding="unicode", xml_declaration=True)


# `--plot`'s formats by file extension (matplotlib's writers for them); no extension: PNG.
PLOT_FORMATS = {"png": "png", "jpg": "jpeg", "jpeg": "jpeg", "svg": "svg", "pdf": "pdf"}


def plot_format(path: str | Path) -> str | None:
    """The format `path` names by its extension (`PLOT_FORMATS`; none: png), or None."""
    suffix = Path(path).suffix.lower().removeprefix(".")
    return PLOT_FORMATS.get(suffix) if suffix else "png"


def write_plot(results: Sequence[Any], name: str, path: str | Path) -> bool:
    """The train check's per-step losses and errors as an image in the format its extension
    names (`plot_format`); False when there is no train run."""
    train = next((r for r in results if r.name == "train" and r.steps), None)
    if train is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [s["step"] for s in train.steps]
    fig, (loss_ax, err_ax) = plt.subplots(1, 2, figsize=(10, 4))
    loss_ax.plot(steps, [s["loss_linen"] for s in train.steps], "o-", label="Linen")
    loss_ax.plot(steps, [s["loss_nnx"] for s in train.steps], "x--", label="NNX")
    loss_ax.set(title="training loss", xlabel="step", ylabel="loss")
    loss_ax.legend()
    # Exact agreement is 0, which a log axis cannot show: floor it at the smallest float32.
    floor = 1e-45
    err_ax.semilogy(steps, [max(s["max_rel"], floor) for s in train.steps], "o-")
    err_ax.axhline(max(train.tolerance, floor), color="red", linestyle=":", label="tolerance")
    err_ax.set(title="max relative error, NNX vs Linen (0 plotted at 1e-45)", xlabel="step")
    err_ax.legend()
    for ax in (loss_ax, err_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(printable(f"parity train: {name}"))
    fig.tight_layout()
    fig.savefig(path, dpi=100, format=plot_format(path) or "png")  # exactly `path`
    plt.close(fig)
    return True


def print_golden_differences(differences: list[str]) -> None:
    """The `golden` check's differences, one line each, under the verdict table's run."""
    for line in differences:
        print(printable(f"  golden {line}"))


# ------------------------------------------------------------------ plain text

MAX_LISTED = 10  # failing records listed per check by `text_report`


def _describe(record: dict) -> str:
    """One failing record, both sides labelled."""
    if "linen" in record:
        text = f"Linen {record['linen']} vs NNX {record['nnx']}"
        if "p_value" in record:
            text += f" (p={record['p_value']:.2g})"
        return text + (f" ({record['note']})" if "note" in record else "")
    if "summary" in record:
        return record["summary"]
    if "note" in record:
        return record["note"]
    text = (
        f"NNX vs Linen max_rel={_fmt(record['max_rel'])} max_abs={_fmt(record['max_abs'])} "
        f"mismatches={record['mismatches']}"
    )
    if record.get("nonfinite"):
        text += f" nonfinite={record['nonfinite']}"
    return text + (f" dtype {record['dtype']}" if "dtype" in record else "")


def text_report(results: Sequence[Any], title: str = "parity", verbose: bool = False) -> str:
    """Plain-text report: one verdict line per check ("where" on those that did not pass),
    then the failing records (each with both sides), then the notes (`verbose`: every
    error's whole text, tracebacks), then the run's verdict line (`verdict_line`)."""
    failed = [r for r in results if not r.passed]
    verdict = f"FAIL ({len(failed)} of {len(results)} checks)" if failed else "PASS"
    rows = [("check", "verdict", "worst", "tolerance", "where")] + [
        (
            r.name,
            {"passed": "PASS", "skipped": "SKIP", "failed": "FAIL"}.get(r.status, "ERROR"),
            *_measured(r),
            "" if r.status in ("passed", "skipped") else r.where,
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{title}: {verdict}"]
    for row in rows:
        cells = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
        lines.append(f"  {cells}  {row[4]}".rstrip())
    for r in failed:
        label = "FAIL" if r.status == "failed" else "ERROR"
        failing = [d for d in r.details if not d.get("passed", True)]
        for record in failing[:MAX_LISTED]:
            lines.append(f"  {r.name} {label} {record['tensor']}: {_describe(record)}")
        if len(failing) > MAX_LISTED:
            lines.append(f"  {r.name}: ... and {len(failing) - MAX_LISTED} more failing")
    lines += _notes(results, verbose)
    if verbose:
        for r in results:
            for record in r.details:
                if "error" in record:
                    lines += [f"{r.name}: {record['tensor']}:", str(record["error"])]
    lines.append(verdict_line(results))
    return "\n".join(lines)


def _notes(results: Sequence[Any], verbose: bool) -> list[str]:
    """Each check's note: its first line (a line ending in `:` with the next one), the rest
    only when `verbose`; an error another check already gave is referred to, not repeated."""
    notes, seen, hidden = [], {}, False
    for r in results:
        if not r.message:
            continue
        if r.metric == "error" and r.message in seen:
            notes.append(f"  {r.name}: as {seen[r.message]}")
            continue
        seen[r.message] = r.name
        text = r.message.strip().splitlines()
        shown = text[0]
        rest = text[1:]
        if shown.endswith(":") and rest:
            shown, rest = f"{shown} {rest[0].strip(' -')}", rest[1:]
        if verbose:
            notes += [f"  {r.name}: {shown}", *(f"    {line}" for line in rest)]
        else:
            more = f" (+{len(rest)} more)" if rest else ""
            notes.append(f"  {r.name}: {shown}{more}")
        hidden |= bool(rest)
    if not notes:
        return []
    hidden |= any("error" in d for r in results for d in r.details)
    footer = ["(format_report(..., verbose=True) shows the rest: every line, tracebacks)"]
    return ["notes:", *notes, *(footer if hidden and not verbose else [])]
