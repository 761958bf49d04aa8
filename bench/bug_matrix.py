"""The injected bugs of tests/test_injected_bugs.py on every shipped tiny config: is each caught
by its named check, at its place, wherever it applies? And do those checks stay quiet on the
clean twins over seeds 0-4?

    PYTHONPATH=. python bench/bug_matrix.py [--configs NAME ...] [--bugs NAME ...]
        [--seeds 0 1 2 3 4] [--json PATH] [--compilation_cache_dir DIR]
    PYTHONPATH=. python bench/bug_matrix.py --tables PATH    # the tables of a --json file

Each bug is one of `tests/test_injected_bugs.py`'s injectors (a monkeypatched edit of the NNX
twin), run through `parity CONFIG` in-process with only the checks it needs. Whether a bug
applies to a config is decided from the config alone (`not_applicable`), before anything runs.
Every config runs in its own worker process with exactly its mesh's simulated CPU devices
(llama2-tiny-4d needs 16), one config after another; prints markdown tables: bug x config (the
check that caught it and where, or MISSED), the clean runs per seed, and each check's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "configs"
CONFIGS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*-tiny*.yml")))
# The checks those bugs are named by, run clean on every config and seed: none may fail.
CLEAN_CHECKS = ("init", "bubbles", "program", "layers")


@dataclasses.dataclass(frozen=True)
class Bug:
    """An injector of tests/test_injected_bugs.py, the checks it runs with (and config
    overrides), the check that must catch it and the text that check's `where` must contain.
    Other checks that fail with it are reported beside it."""

    name: str
    checks: str
    catcher: str
    place: str
    overrides: tuple[str, ...] = ()


BUGS = (
    Bug("init_scale_wrong", "init", "init", "mlp/wo/kernel: log std ratio"),
    Bug("init_family_swapped", "init", "init", "kernel: kurtosis"),
    Bug("norm_scale_zeros", "init", "init", "scale: constant value"),
    Bug("stage_keys_reused", "init", "init", "distinct stacked slices"),
    Bug("bubbles_unmasked", "bubbles", "bubbles", "nnx/grads/params/pipeline"),
    Bug(
        "highest_precision_on_one_side",
        "program",
        "program",
        "pre-optimisation HLO: replaced",
        overrides=("matmul_precision=default",),
    ),
    Bug("mlp_constraint_dropped", "program", "program", "pre-optimisation HLO: only in Linen"),
    Bug("remat_policy_changed", "program", "program", "pre-optimisation HLO"),
    Bug("embedding_off_by_one", "forward,grads", "layers", "embedding"),
    Bug(
        "attention_probabilities_in_bfloat16", "forward,program", "program", "pre-optimisation HLO"
    ),
)
BY_NAME = {b.name: b for b in BUGS}


def not_applicable(bug: Bug, cfg) -> str | None:
    """Why `bug` cannot change `cfg`'s twin (so no check could catch it), or None: decided by
    the config's keys alone."""
    if bug.name in ("init_scale_wrong", "mlp_constraint_dropped") and cfg.num_experts > 1:
        return "num_experts > 1: the layers have a MoeBlock, no dense MLP"
    if bug.name in ("stage_keys_reused", "bubbles_unmasked") and not cfg.using_pipeline:
        return "no pipeline (S=1): no stage axis, no idle slots"
    if bug.name == "remat_policy_changed":
        if not (cfg.using_pipeline and cfg.set_remat_policy_on_pipeline_iterations):
            return "no remat policy on pipeline iterations"
        if cfg.remat_policy == "full":
            return "the config's policy already saves nothing"
    if bug.name == "highest_precision_on_one_side" and cfg.matmul_precision == "highest":
        return "matmul_precision highest: the config asks for HIGHEST itself"
    if bug.name == "attention_probabilities_in_bfloat16" and cfg.dtype == "bfloat16":
        return "dtype bfloat16: the probabilities are cast to bfloat16 already (the value dtype)"
    return None


# ------------------------------------------------------------------ worker (one config)


def _import_injectors():
    """tests/test_injected_bugs.py, imported without tests/conftest.py: that conftest pins
    8 simulated devices and asserts them, and this worker has its config's own count."""
    sys.modules.setdefault("conftest", types.SimpleNamespace(CONFIG_DIR=CONFIG_DIR))
    sys.path.insert(0, str(ROOT / "tests"))
    import test_injected_bugs

    return test_injected_bugs


def _run_cli(workdir: Path, *args: str) -> dict:
    """`parity` in-process (so monkeypatches apply): exit status, failing checks and where,
    and each check's wall time (from the JUnit report)."""
    import xml.etree.ElementTree as ET

    from parity import cli

    json_path, junit_path = workdir / "report.json", workdir / "report.xml"
    for path in (json_path, junit_path):
        path.unlink(missing_ok=True)
    argv = cli.FLAGS(["parity", *args, f"--json={json_path}", f"--junit={junit_path}"])
    start = time.perf_counter()
    try:
        status = cli.run(argv)
    finally:
        cli.FLAGS.unparse_flags()
    wall = time.perf_counter() - start
    report = json.loads(json_path.read_text()) if json_path.exists() else {"checks": []}
    seconds = {}
    if junit_path.exists():
        for case in ET.parse(junit_path).getroot().iter("testcase"):
            seconds[case.get("name")] = float(case.get("time"))
    return {
        "status": status,
        "failing": {c["name"]: c["worst"]["where"] for c in report["checks"] if not c["passed"]},
        "statuses": {c["name"]: c["status"] for c in report["checks"]},
        # Every failing record of a failing check (its `where` is only the first or worst).
        "records": {
            c["name"]: [d.get("tensor", "") for d in c["details"] if not d.get("passed", True)]
            for c in report["checks"]
            if not c["passed"]
        },
        "seconds": seconds,
        "wall": wall,
    }


def worker(name: str, bug_names: list[str], seeds: list[int], out: Path) -> None:
    import pytest

    from migrate.config.loading import load_config
    from parity.decoder import twins

    injectors = _import_injectors()
    config_path = str(CONFIG_DIR / f"{name}.yml")
    results: dict = {"config": name, "bugs": {}, "seeds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for seed in seeds:
            run = _run_cli(
                workdir, config_path, f"seed={seed}", f"--checks={','.join(CLEAN_CHECKS)}"
            )
            results["seeds"][seed] = run
            print(f"[bug_matrix] {name} seed {seed}: exit {run['status']}", file=sys.stderr)
        for bug_name in bug_names:
            bug = BY_NAME[bug_name]
            reason = not_applicable(bug, load_config(config_path, bug.overrides))
            if reason is not None:
                results["bugs"][bug_name] = {"n/a": reason}
                continue
            patch = pytest.MonkeyPatch()
            twins.clear_nnx_caches()  # the injected bug must be traced
            try:
                getattr(injectors, bug_name)(patch)
                run = _run_cli(workdir, config_path, *bug.overrides, f"--checks={bug.checks}")
            finally:
                patch.undo()
                twins.clear_nnx_caches()  # and must not leak into the next run
            results["bugs"][bug_name] = run
            print(
                f"[bug_matrix] {name} {bug_name}: exit {run['status']} {run['failing']}",
                file=sys.stderr,
            )
    out.write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------ the tables


def verdict(bug: Bug, run: dict) -> str:
    """'caught' (the named check failed, its `where` at the place), 'caught*' (its `where` names
    another failing record, and a failing record at the place is among its records), 'caught
    elsewhere' (the named check failed, no record at the place), 'MISSED', or 'ERROR' (the run
    did not end in a parity failure)."""
    if "n/a" in run:
        return "n/a"
    if run["status"] not in (0, 1) or {"bad_input", "errored"} & set(run["statuses"].values()):
        return f"ERROR (exit {run['status']})"
    where = run["failing"].get(bug.catcher)
    if where is None:
        return "MISSED"
    if bug.place in where:
        return "caught"
    records = run.get("records", {}).get(bug.catcher, [])
    return "caught*" if any(bug.place in r for r in records) else "caught elsewhere"


def _cell(bug: Bug, run: dict) -> str:
    if "n/a" in run:
        return "n/a"
    state = verdict(bug, run)
    seconds = run["seconds"].get(bug.catcher)
    timing = f" ({seconds:.1f} s)" if seconds is not None else ""
    if state.startswith("caught") and state != "caught elsewhere":
        return f"{bug.catcher}{state.removeprefix('caught')}{timing}"
    return f"**{state}**{timing}"


def tables(results: list[dict]) -> str:
    names = [r["config"] for r in results]
    short = [
        n.removeprefix("llama2-tiny").lstrip("-") or "tiny" for n in names
    ]  # mixtral-tiny stays
    bug_names = [b.name for b in BUGS if any(b.name in r["bugs"] for r in results)]
    lines = [
        "Bug x config: the check that caught it (its wall time in that run), or MISSED / n/a; "
        "*: its `where` names another failing record, the expected one fails too.",
        "",
        "| bug | " + " | ".join(short) + " |",
        "| --- |" + " --- |" * len(short),
    ]
    for bug_name in bug_names:
        bug = BY_NAME[bug_name]
        cells = [_cell(bug, r["bugs"][bug_name]) if bug_name in r["bugs"] else "-" for r in results]
        lines.append(f"| {bug_name} | " + " | ".join(cells) + " |")

    lines += [
        "",
        "Where each caught it (`where` of the named check; other checks that failed):",
        "",
    ]
    lines += ["| bug | config | where | also failed |", "| --- | --- | --- | --- |"]
    for bug_name in bug_names:
        bug = BY_NAME[bug_name]
        for result in results:
            run = result["bugs"].get(bug_name)
            if run is None:
                continue
            if "n/a" in run:
                lines.append(f"| {bug_name} | {result['config']} | n/a: {run['n/a']} | |")
                continue
            where = run["failing"].get(bug.catcher, verdict(bug, run))
            if verdict(bug, run) == "caught*":
                matched = [r for r in run["records"][bug.catcher] if bug.place in r]
                where += f" (also failing: {', '.join(matched[:2])})"
            others = ", ".join(f"{c}: {w}" for c, w in run["failing"].items() if c != bug.catcher)
            lines.append(f"| {bug_name} | {result['config']} | {_md(where)} | {_md(others)} |")

    seeds = sorted({int(s) for r in results for s in r["seeds"]})
    if seeds:
        lines += [
            "",
            f"Clean twins, checks {', '.join(CLEAN_CHECKS)}, seeds {seeds}; each check's wall "
            "time in the first run (cold: compiles) / the slowest of the later ones:",
            "",
            "| config | passed | " + " | ".join(f"{c} s" for c in CLEAN_CHECKS) + " |",
            "| --- | --- |" + " --- |" * len(CLEAN_CHECKS),
        ]
        for result in results:
            runs = [result["seeds"][s] for s in sorted(result["seeds"], key=int)]
            passed = sum(r["status"] == 0 for r in runs)
            failing = {c: w for r in runs for c, w in r["failing"].items()}
            times = []
            for check in CLEAN_CHECKS:
                values = [r["seconds"][check] for r in runs if check in r["seconds"]]
                later = f" / {max(values[1:]):.1f}" if len(values) > 1 else ""
                times.append(f"{values[0]:.1f}{later}" if values else "-")
            note = f" FALSE ALARM {failing}" if failing else ""
            lines.append(
                f"| {result['config']} | {passed}/{len(runs)}{note} | " + " | ".join(times) + " |"
            )
    return "\n".join(lines)


def _md(text: str) -> str:
    return re.sub(r"\|", "\\|", str(text))[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--bugs", nargs="+", default=[b.name for b in BUGS], choices=list(BY_NAME))
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument(
        "--compilation_cache_dir",
        help="persistent XLA cache for every run (default: a fresh one, so the first run of "
        "each program compiles cold)",
    )
    parser.add_argument(
        "--tables", type=Path, help="print the tables of a --json file; run nothing"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.bugs, args.seeds, args.out)
        return
    if args.tables:
        print(tables(json.loads(args.tables.read_text())))
        return

    from migrate.config.loading import load_config  # no JAX

    results = []
    fresh_cache = tempfile.TemporaryDirectory(prefix="bug_matrix_xla_")
    cache_dir = args.compilation_cache_dir or fresh_cache.name
    for name in args.configs:
        devices = load_config(CONFIG_DIR / f"{name}.yml").num_devices
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
        )
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=cache_dir)
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            argv = [sys.executable, __file__, "--worker", name, "--out", str(out)]
            argv += ["--bugs", *args.bugs, "--seeds", *map(str, args.seeds)]
            start = time.perf_counter()
            # The CLI's own tables go to stderr with the progress lines: stdout is the matrix.
            subprocess.run(argv, env=env, check=True, cwd=ROOT, stdout=sys.stderr)
            result = json.loads(out.read_text())
            result["worker_seconds"] = time.perf_counter() - start
            print(
                f"[bug_matrix] {name}: {result['worker_seconds']:.0f} s on {devices} devices",
                file=sys.stderr,
            )
            results.append(result)
    fresh_cache.cleanup()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(tables(results))


if __name__ == "__main__":
    main()
