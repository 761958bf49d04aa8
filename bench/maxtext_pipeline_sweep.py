"""The MaxText pipeline oracle over the pipeline space: each shape's `parity --maxtext ...
--checks=pipeline` (both releases, each against its own decoder without pipelining) and
`--against=twin --checks=forward,grads` (the NNX twin, which the twins' own `pipeline` check
holds to its reference, as a second oracle of 0.2.5; where the twins' map cannot carry the
shape or family, its one-line refusal is the row's entry).

    PYTHONPATH=. .venv/bin/python bench/maxtext_pipeline_sweep.py [--space=core|full|shipped]
        [--results=FILE] [--only=NAME,...] [--no-twin] [--markdown]

`core`: each axis of the space moved around S=4, R=2, M=8 (S in {2, 4, 8}, R in {1, 2, 4}, M in
{S, 2S, 4S}, L in {1, 2}) and every mode (the forwarding delay, ag once, ag per repeat, a
pipelined subset, `scan_layers_per_stage`, `scan_pipeline_iterations=false`, dcn stages);
`full`: the product of the four axes, then the modes; `shipped`: every shipped MaxText config
(`configs/maxtext/*.yml`, each family and shape) as it ships. Every shape is tiny
(docs/maxtext.md's `base.yml`: 64 wide, 16 tokens) on 8 simulated CPU devices; the batch per
device is M/S, the least that splits each microbatch over the data axes. The results file
(bench/results/maxtext_pipeline_sweep.json, or maxtext_shipped_oracle.json for `shipped`, with
the date, the machine and this command; `--only` replaces its shapes' rows and keeps the
others) is what docs/maxtext.md's tables are rendered from (`--markdown`).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "maxtext_pipeline_sweep.json"
SHIPPED_RESULTS = ROOT / "bench" / "results" / "maxtext_shipped_oracle.json"
DEVICES = 8


def shape(stages: int, repeats: int, microbatches: int, per_stage: int, **extra: object) -> dict:
    """MaxText keys of one pipelined shape (over configs/maxtext/base.yml)."""
    keys = {
        "ici_pipeline_parallelism": stages,
        "ici_fsdp_parallelism": DEVICES // stages,
        "num_pipeline_repeats": repeats,
        "num_pipeline_microbatches": microbatches,
        "num_layers_per_pipeline_stage": per_stage,
        "base_num_decoder_layers": stages * repeats * per_stage,
        "per_device_batch_size": max(microbatches // stages, 1),
    }
    return keys | extra


def name_of(keys: dict) -> str:
    if "config" in keys:
        return Path(keys["config"]).stem
    s, r = keys["ici_pipeline_parallelism"], keys["num_pipeline_repeats"]
    m, layers = keys["num_pipeline_microbatches"], keys["num_layers_per_pipeline_stage"]
    if "dcn_pipeline_parallelism" in keys:
        s = f"{s}x{keys['dcn_pipeline_parallelism']}dcn"
    name = f"S{s}-R{r}-M{m}-L{layers}"
    for key, short in MODE_NAMES.items():
        if key in keys:
            name += f"-{short}" if keys[key] is True else f"-{short}={keys[key]}"
    return name


MODE_NAMES = {
    "pipeline_delay_activation_forwarding": "delay",
    "pipeline_fsdp_ag_once": "agonce",
    "pipeline_fsdp_ag_per_repeat": "agrepeat",
    "pipeline_parallel_layers": "subset",
    "scan_layers_per_stage": "scanstage",
    "scan_pipeline_iterations": "scaniter",
}


def modes() -> list[dict]:
    """Every mode on the centre shape, and the per-repeat gathering across S and M."""
    return [
        shape(4, 2, 8, 1, pipeline_delay_activation_forwarding=True),
        shape(4, 1, 8, 1, pipeline_delay_activation_forwarding=True),
        shape(4, 1, 4, 1, pipeline_fsdp_ag_once=True),
        shape(4, 2, 8, 1, pipeline_fsdp_ag_once=True),
        shape(4, 2, 8, 1, pipeline_fsdp_ag_per_repeat=True),
        shape(4, 2, 4, 1, pipeline_fsdp_ag_per_repeat=True),
        shape(4, 2, 16, 1, pipeline_fsdp_ag_per_repeat=True),
        shape(2, 4, 4, 1, pipeline_fsdp_ag_per_repeat=True),
        shape(2, 2, 4, 1, pipeline_fsdp_ag_per_repeat=True),
        shape(8, 2, 16, 1, pipeline_fsdp_ag_per_repeat=True),
        {**shape(4, 1, 4, 1), "base_num_decoder_layers": 6, "pipeline_parallel_layers": 4},
        shape(4, 1, 4, 2, scan_layers_per_stage=True),
        shape(4, 2, 8, 1, scan_pipeline_iterations=False),
        {
            **shape(2, 2, 8, 1),
            "dcn_pipeline_parallelism": 2,
            "ici_fsdp_parallelism": 2,
            "base_num_decoder_layers": 8,
        },
    ]


SHIPPED = ROOT / "configs" / "maxtext"


def shipped() -> list[dict]:
    """Every shipped MaxText config (each family and pipeline shape), as it ships."""
    return [
        {"config": str(p.relative_to(ROOT))}
        for p in sorted(SHIPPED.glob("*.yml"))
        if p.name != "base.yml"
    ]


def space(which: str) -> list[dict]:
    if which == "shipped":
        return shipped()
    if which == "full":
        axes = itertools.product((2, 4, 8), (1, 2, 4), (1, 2, 4), (1, 2))
        base = [shape(s, r, s * m, layers) for s, r, m, layers in axes]
    else:
        base = [
            shape(s, r, m * s, layers)
            for s, r, m, layers in (
                (2, 1, 1, 1),
                (2, 2, 2, 1),
                (2, 4, 4, 1),
                (4, 1, 1, 1),
                (4, 2, 1, 1),
                (4, 2, 2, 1),
                (4, 4, 4, 1),
                (4, 1, 1, 2),
                (4, 2, 2, 2),
                (8, 1, 1, 1),
                (8, 2, 2, 1),
                (8, 1, 2, 1),
            )
        ]
    return base + modes()


def run(command: list[str], timeout: float) -> tuple[int, float, dict | None, str]:
    """(exit status, seconds, the JSON report or None, the last stderr line)."""
    with tempfile.TemporaryDirectory(prefix="sweep-") as directory:
        report = Path(directory) / "report.json"
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [*command, f"--json={report}"],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            status, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired as e:
            status, err = -1, f"timed out after {timeout:.0f}s {e.stderr or ''}"
        seconds = time.perf_counter() - start
        data = json.loads(report.read_text()) if report.is_file() else None
    last = [line for line in str(err).splitlines() if line.strip()]
    return status, seconds, data, (last[-1] if last else "")


def check_summary(data: dict | None, name: str) -> dict:
    """A check's verdict, worst error, where, and (pipeline) whose difference, from a report."""
    if data is None:
        return {}
    check = next((c for c in data["checks"] if c["name"] == name), None)
    if check is None:
        return {}
    out = {
        "status": check["status"],
        "worst": check["worst"]["value"],
        "where": check["worst"]["where"],
    }
    whose = [d for d in check.get("details", []) if d.get("tensor") == "whose difference"]
    if whose:
        out |= {"whose": whose[0]["whose"], "failing": whose[0]["failing_releases"]}
        out["parts_at"] = whose[0].get("parts_at", {})
        per_release: dict[str, float] = {}
        for record in check["details"]:
            if "release" in record and "first_parting" not in record:  # not the drill-down's
                release = record["release"]
                per_release[release] = max(per_release.get(release, 0.0), record["max_rel"])
        out["per_release"] = per_release
    return out


def parity_command(config: str) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "parity"), "--maxtext", config]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", choices=("core", "full", "shipped"), default="core")
    parser.add_argument(
        "--results", type=Path, help=f"default {RESULTS.name} (shipped: {SHIPPED_RESULTS.name})"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated shape names (their rows replace the results')"
    )
    parser.add_argument("--no-twin", action="store_true", help="skip --against=twin")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    parser.add_argument("--markdown", action="store_true", help="print the results' table")
    args = parser.parse_args()
    if args.results is None:
        args.results = SHIPPED_RESULTS if args.space == "shipped" else RESULTS
    if args.markdown:
        print(markdown(json.loads(args.results.read_text())))
        return
    shapes = space(args.space)
    if args.only:
        wanted = set(args.only.split(","))
        shapes = [k for k in shapes if name_of(k) in wanted]
    rows = []
    for keys in shapes:
        config = keys.get("config", "configs/maxtext/base.yml")
        overrides = [
            f"{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in keys.items()
            if k != "config"
        ]
        row: dict = {"shape": name_of(keys), "keys": keys}
        command = [*parity_command(config), *overrides, "--checks=pipeline"]
        status, seconds, data, last = run(command, args.timeout)
        row["oracle"] = {"exit": status, "seconds": round(seconds, 1), "message": last}
        row["oracle"] |= check_summary(data, "pipeline")
        if not args.no_twin:  # where the twins' map cannot carry the shape: its one-line refusal
            command = [
                *parity_command(config),
                *overrides,
                "--against=twin",
                "--checks=forward,grads",
            ]
            status, seconds, data, last = run(command, args.timeout)
            row["twin"] = {"exit": status, "seconds": round(seconds, 1), "message": last}
            for check in ("forward", "grads"):
                row["twin"][check] = check_summary(data, check)
        rows.append(row)
        print(json.dumps(row), flush=True)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for row in rows:
        row["date"] = now
    if args.only and args.results.is_file():  # the other shapes' rows kept, in the space's order
        order = [name_of(k) for k in space(args.space)]
        before = json.loads(args.results.read_text())
        kept = {row["shape"]: {"date": before["date"], **row} for row in before["rows"]}
        kept |= {row["shape"]: row for row in rows}
        rows = [kept[name] for name in order if name in kept]  # a shape the space lost: dropped
    results = {
        "date": now,
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.platform()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rows": rows,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


def _verdict(part: dict) -> str:
    if not part or "status" not in part:
        if not part:
            return "-"
        message = part.get("message", "").removeprefix("parity: error: ")
        message = message.removeprefix("parity: internal error: ")
        short = message if len(message) <= 160 else message[:157] + "..."
        return f"exit {part.get('exit', '?')}: {short}"
    if part["status"] == "skipped":
        return "skipped"
    return f"{'pass' if part['status'] == 'passed' else '**FAIL**'} {part['worst']:.3g}"


def markdown(results: dict) -> str:
    """The results as docs/maxtext.md's table."""
    dates = sorted(row.get("date", results["date"]) for row in results["rows"])
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    lines = [
        f"Measured {span} on {results['machine']}: `python bench/maxtext_pipeline_sweep.py"
        f"{' --space=shipped' if 'shipped' in results['command'] else ''}` (a row re-run with "
        "`--only` has its own date in the results file).",
        "",
        "| shape | 0.2.3 vs its reference | 0.2.5 vs its reference | whose | twin forward, grads "
        "| s |",
        "| --- | --- | --- | --- | --- | ---: |",
    ]
    for row in results["rows"]:
        oracle = row["oracle"]
        per = oracle.get("per_release", {})
        cells = []
        for release in ("0.2.3", "0.2.5"):
            if release not in per:  # no verdict per release: the run's one line, once
                whole = "per_release" not in oracle and not cells
                cells.append(_verdict(oracle) if whole else "(the same run)")
                continue
            failed = release in oracle.get("failing", [])
            cells.append(f"{'**FAIL**' if failed else 'pass'} {per[release]:.3g}")
        twin = row.get("twin")
        twin_cell = (
            "-"
            if twin is None
            else (
                ", ".join(_verdict(twin.get(c, {})) for c in ("forward", "grads"))
                if twin.get("forward")
                else _verdict(twin)
            )
        )
        seconds = oracle["seconds"] + (twin["seconds"] if twin else 0)
        whose = oracle.get("whose", "") if oracle.get("failing") else ""
        whose = whose.split(" (the difference")[0]
        places = {where.split(": ", 1)[-1] for where in oracle.get("parts_at", {}).values()}
        if places:
            whose += "; first parts at " + "; ".join(f"`{p}`" for p in sorted(places))
        cells = [f"`{row['shape']}`", *cells, whose, twin_cell, f"{seconds:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
