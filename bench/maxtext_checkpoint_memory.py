"""Peak resident memory of reading a MaxText checkpoint and converting it into the twins,
relative to the checkpoint's size (the MaxText rows of `bench/checkpoint_memory.py`).

A fresh subprocess writes the twins' Linen checkpoint of `checkpoint_memory.py` (random weights
and moments, ~42M parameters) and converts it into MaxText's on-disk layout (its scanned
stacking); then one fresh subprocess per row resets its peak, runs the operation and reports
`VmHWM` growth over the RSS just before it, as the `migrate` command runs (1 MiB mmap
threshold), on 8 simulated CPU devices (device memory is this process's memory).

    PYTHONPATH=. python bench/maxtext_checkpoint_memory.py [--dir DIR]
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_memory as base  # noqa: E402

ROWS = {
    "read": "read a MaxText checkpoint (host arrays, the floor)",
    "into": "convert maxtext -> nnx (pipeline S=4 R=2)",
    "into_verify": "convert maxtext -> nnx --verify",
}
MiB = 2**20


def write_source(work: Path) -> dict[str, Any]:
    """Child: the twins' checkpoint, then MaxText's layout of it under work/maxtext."""
    from migrate.checkpoints import maxtext_commands

    facts = base.write_source(str(work / "twins"), base.OVERRIDES)
    cfg = base.config(base.OVERRIDES)
    outcome = maxtext_commands.from_twins(work / "twins", work / "maxtext", cfg, how="scan")
    step = work / "maxtext" / str(outcome.step - 1)
    disk = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    return {**facts, "step_dir": str(step), "maxtext_disk_bytes": disk}


def measure(row: str, step_dir: str, work: str) -> dict[str, Any]:
    """Child: one row, its peak RSS growth and wall seconds."""
    import jax

    from migrate import cli
    from migrate.checkpoints import maxtext_commands, maxtext_layouts

    cli.return_freed_memory()
    cfg = base.config(base.OVERRIDES)
    jax.devices()
    dst = Path(work) / row
    shutil.rmtree(dst, ignore_errors=True)
    before = base.status_kib("VmRSS")
    base.reset_peak()
    start = time.perf_counter()
    if row == "read":
        flat = maxtext_layouts.read(step_dir)
        assert len(flat) == 39
    else:
        outcome = maxtext_commands.into_twins(
            step_dir, dst, cfg, "nnx", "pipeline", verify=row == "into_verify"
        )
        assert not outcome.differences, outcome.differences
    seconds = time.perf_counter() - start
    growth = (base.status_kib("VmHWM") - before) * 1024
    shutil.rmtree(dst, ignore_errors=True)
    return {"row": row, "growth_bytes": growth, "seconds": seconds}


def child(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        result = write_source(Path(rest[0])) if mode == "source" else measure(mode, *rest)
        print(json.dumps(result))
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="maxtext-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        source = child("source", str(work))
        size = source["maxtext_disk_bytes"] / MiB
        print(
            f"checkpoint: {source['arrays']} arrays, {source['nbytes'] / MiB:,.0f} MiB "
            f"(parameters and AdamW moments), MaxText layout {size:,.0f} MiB on disk\n"
        )
        print("| operation | peak MiB | x checkpoint | wall s |\n| --- | ---: | ---: | ---: |")
        for row, label in ROWS.items():
            r = child(row, source["step_dir"], str(work))
            growth = r["growth_bytes"]
            ratio = growth / source["nbytes"]
            print(f"| {label} | {growth / MiB:,.0f} | {ratio:.2f} | {r['seconds']:.1f} |")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
