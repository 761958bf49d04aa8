"""The gate's own wall time, two checkouts side by side: `parity CONFIG --checks=all` of a
baseline checkout (`--baseline`, e.g. main) and of this one, interleaved in one process tree on
the same machine: cold (`--compilation_cache_dir=''`, no persistent cache), fresh (a new empty
persistent cache) and warm (the cache that side's fresh run of the round wrote); and the 7B
`--checks=compile`, cold.

    PYTHONPATH=. python bench/gate_speed.py --baseline /work/main [--rounds 1]

Every run is a subprocess with `JAX_LOG_COMPILES=1`: compilations are counted from JAX's own
log lines (`Finished XLA compilation of NAME`, one per backend compile, persistent-cache reads
included), the same way for both checkouts. On a shared machine only the ratios of
interleaved runs mean anything; the compilation counts are exact regardless.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MODES = ("cold", "fresh", "warm")
COMPILED = re.compile(r"Finished XLA compilation of (.+?) in ([\d.]+) sec")


def run(checkout: Path, config: str, checks: str, cache_dir: str) -> dict:
    """One `parity` run of `checkout`: wall seconds, exit status, compilations, and the
    seconds JAX logged for them."""
    env = dict(os.environ, PYTHONPATH=str(checkout), JAX_LOG_COMPILES="1")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    command = [sys.executable, "-m", "parity.cli", config, f"--checks={checks}"]
    command.append(f"--compilation_cache_dir={cache_dir}")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    compiles = COMPILED.findall(done.stderr)
    return {
        "wall": wall,
        "status": done.returncode,
        "compilations": len(compiles),
        "compile_seconds": sum(float(s) for _, s in compiles),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to beat")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--config", default="configs/llama2-tiny.yml")
    parser.add_argument("--skip_7b", action="store_true")
    args = parser.parse_args()
    sides = {"baseline": args.baseline.resolve(), "branch": HERE}
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="gate-speed-") as root:
        for round_index in range(args.rounds):
            # Alternate which side goes first, so that neither always runs after the other.
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            caches = {side: tempfile.mkdtemp(dir=root) for side in order}
            for mode in MODES:
                for side in order:
                    # fresh: a new, empty cache; the warm run reads what it wrote
                    cache = "" if mode == "cold" else caches[side]
                    found = run(sides[side], args.config, "all", cache)
                    results.setdefault((side, mode), []).append(found)
                    print(f"round {round_index} {mode:4s} {side:8s} {_line(found)}", flush=True)
            if not args.skip_7b:
                for side in order:
                    found = run(sides[side], "configs/llama2-7b.yml", "compile", "")
                    results.setdefault((side, "7b"), []).append(found)
                    print(f"round {round_index} 7b   {side:8s} {_line(found)}", flush=True)
    print("\n| run | baseline | branch | branch / baseline |\n| --- | --- | --- | --- |")
    for mode in (*MODES, "7b"):
        if ("branch", mode) not in results:
            continue
        base, branch = (_median(results[side, mode]) for side in ("baseline", "branch"))
        print(
            f"| {mode} wall | {base['wall']:.1f} s | {branch['wall']:.1f} s | "
            f"{branch['wall'] / base['wall']:.2f} |"
        )
        print(
            f"| {mode} compilations | {base['compilations']:.0f} ({base['compile_seconds']:.1f} s)"
            f" | {branch['compilations']:.0f} ({branch['compile_seconds']:.1f} s) | "
            f"{branch['compile_seconds'] / max(base['compile_seconds'], 1e-9):.2f} (seconds) |"
        )
    failed = [k for k, runs in results.items() if any(r["status"] != 0 for r in runs)]
    if failed:
        print(f"runs that did not exit 0: {failed}", file=sys.stderr)
    return 1 if failed else 0


def _line(found: dict) -> str:
    return (
        f"exit {found['status']}, {found['wall']:.1f} s wall, {found['compilations']} "
        f"compilations ({found['compile_seconds']:.1f} s)"
    )


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


if __name__ == "__main__":
    sys.exit(main())
