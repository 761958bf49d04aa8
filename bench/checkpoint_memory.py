"""Peak resident memory of an on-disk checkpoint conversion, relative to the checkpoint's size.

One fresh subprocess writes a Linen checkpoint with random weights and moments, of a decoder
widened by `key=value` overrides to a few hundred MB (parameters plus AdamW moments).
Then one fresh subprocess per row imports everything, builds the mesh, resets its peak
(`/proc/self/clear_refs`), runs the operation, and reports `VmHWM` growth over the RSS just
before it (`/proc/self/status`), once with glibc as it comes and once as the `migrate` command
runs it (`cli.return_freed_memory`: a fixed 1 MiB mmap threshold). A restore-only row shows what
holding one copy of the checkpoint costs; "one copy on its mesh" counts every device's shards.
Everything runs on 8 simulated CPU devices, whose "device" memory is this process's memory, so
the figure covers host and device alike.

    PYTHONPATH=. python bench/checkpoint_memory.py [--dir DIR] [key=value ...]
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
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama2-tiny.yml"
# ~42M parameters: 168 MB of float32 weights, 504 MB with the two AdamW moments.
OVERRIDES = (
    "base_emb_dim=512",
    "base_mlp_dim=2048",
    "base_num_query_heads=8",
    "base_num_kv_heads=8",
    "head_dim=64",
    "vocab_size=8192",
)
RESTAGED = {"ici_pipeline_parallelism": 2, "num_pipeline_repeats": 4}
# row -> (what it does, convert_checkpoint keyword arguments or None for restore only)
ROWS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "restore": ("restore only (one copy, the floor)", None),
    "nnx": ("convert linen -> nnx", {"target": "nnx"}),
    "restage": ("convert linen -> nnx, S=4 R=2 -> S=2 R=4", {"target": "nnx", "changes": RESTAGED}),
    "reference": ("convert linen -> linen, pipeline -> reference", {"layout": "reference"}),
    "verify": ("convert linen -> nnx --verify", {"target": "nnx", "verify": True}),
}
MiB = 2**20
# glibc as it comes, and as the `migrate` command sets it (`cli.return_freed_memory`).
ALLOCATORS = {"default": "glibc default", "cli": "as `migrate` runs (mmap threshold 1 MiB)"}


def status_kib(field: str) -> int:
    """`VmRSS` or `VmHWM` of this process, in KiB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def reset_peak() -> None:
    """Set `VmHWM` back to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def footprint(spec, mesh) -> int:
    """Bytes of one copy of `spec`'s checkpoint resident on `mesh`: every device's shards, so
    a weight replicated over the stage axis counts once per stage."""
    import jax
    import numpy as np

    from migrate.checkpoints import train_state

    template = train_state.abstract_state(spec, mesh)
    leaves = jax.tree.leaves(train_state.to_pure((template.params, template.opt_state)))
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize * mesh.devices.size
        for x in leaves
    )


def config(overrides: Sequence[str]):
    from migrate.config.loading import load_config

    return load_config(CONFIG, overrides)


def write_source(path: str, overrides: Sequence[str]) -> dict[str, Any]:
    """Child: a Linen checkpoint at `path` with random weights and moments (realistic bytes on
    disk, unlike zero moments), step 1000."""
    import jax
    import numpy as np

    from migrate.checkpoints import checkpoint_io, train_state
    from migrate.common import sharding

    cfg = config(overrides)
    spec = train_state.Spec("linen", "pipeline", cfg)
    mesh = sharding.make_mesh(cfg)
    template = train_state.abstract_state(spec, mesh)
    rng = np.random.default_rng(0)

    def fill(x):
        if not x.shape:
            return jax.device_put(np.asarray(1000, x.dtype), x.sharding)
        value = rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype)
        return jax.device_put(np.abs(value) * 1e-3, x.sharding)

    trees = (template.params, template.opt_state)
    params, opt_state = train_state.from_pure(trees, jax.tree.map(fill, train_state.to_pure(trees)))
    state = train_state.TrainState(params, opt_state, 1000)
    checkpoint_io.save(path, spec, state)
    leaves = jax.tree.leaves(train_state.to_pure((params, opt_state)))
    disk = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    nbytes = sum(x.nbytes for x in leaves)
    return {"arrays": len(leaves), "nbytes": nbytes, "disk_bytes": disk}


def measure(
    row: str, src: str, work: str, allocator: str, overrides: Sequence[str]
) -> dict[str, Any]:
    """Child: one row's operation, with the peak RSS growth it causes."""
    import jax

    from migrate import cli
    from migrate.checkpoints import checkpoint_io, train_state
    from migrate.checkpoints import commands as checkpoint
    from migrate.common import sharding

    if allocator == "cli":
        cli.return_freed_memory()  # what the `migrate` command does first
    cfg = config(overrides)
    jax.devices()  # start the runtime before the baseline
    _, kwargs = ROWS[row]
    dst = Path(work) / row
    shutil.rmtree(dst, ignore_errors=True)
    before = status_kib("VmRSS")
    reset_peak()
    start = time.perf_counter()
    if kwargs is None:
        spec = train_state.Spec("linen", "pipeline", cfg)
        mesh = sharding.make_mesh(cfg)
        state = checkpoint_io.restore(src, spec, mesh)
        leaves = jax.tree.leaves(train_state.to_pure((state.params, state.opt_state)))
        resident = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
        assert resident == footprint(spec, mesh)
    else:
        kwargs = {"source": "linen", "target": "linen", **kwargs}
        outcome = checkpoint.convert_checkpoint(src, dst, cfg, **kwargs)
        assert not outcome.differences, outcome.differences
        spec = outcome.target
        resident = footprint(spec, sharding.make_mesh(spec.cfg))
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    shutil.rmtree(dst, ignore_errors=True)
    growth = (peak - before) * 1024
    return {"row": row, "growth_bytes": growth, "seconds": seconds, "resident_bytes": resident}


def child(overrides: Sequence[str], *args: str) -> dict[str, Any]:
    """Run this script's `--child` mode in a fresh interpreter; its last stdout line is JSON."""
    argv = [sys.executable, __file__, *overrides, "--child", *args]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(source: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per row and allocator setting, peak growth in MiB, as a multiple of the
    checkpoint's bytes, and as a multiple of one copy of the result resident on its mesh."""
    header = "| operation | one copy on its mesh, MiB |"
    for label in ALLOCATORS.values():
        header += f" peak MiB, {label} | x checkpoint | x one copy |"
    lines = [header + " wall s |", "| --- |" + " ---: |" * (3 * len(ALLOCATORS) + 2)]
    for r in rows:
        resident = r["default"]["resident_bytes"]
        cells = [ROWS[r["row"]][0], f"{resident / MiB:,.0f}"]
        for allocator in ALLOCATORS:
            growth = r[allocator]["growth_bytes"]
            cells += [
                f"{growth / MiB:,.0f}",
                f"{growth / source['nbytes']:.2f}",
                f"{growth / resident:.2f}",
            ]
        cells.append(f"{r['cli']['seconds']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    head = (
        f"checkpoint: {source['arrays']} arrays, {source['nbytes'] / MiB:,.0f} MiB "
        f"(parameters and AdamW moments), {source['disk_bytes'] / MiB:,.0f} MiB on disk"
    )
    return head + "\n\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parent: write the source, measure each row in its own process, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", default=list(OVERRIDES))
    args = parser.parse_args(argv)
    if args.child:
        mode, *rest = args.child
        if mode == "source":
            print(json.dumps(write_source(rest[0], args.overrides)))
        else:
            print(json.dumps(measure(mode, *rest, args.overrides)))
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "source"
    shutil.rmtree(src, ignore_errors=True)
    try:
        source = child(args.overrides, "source", str(src))
        rows = []
        for row in ROWS:
            measured = {
                allocator: child(args.overrides, row, str(src), str(work), allocator)
                for allocator in ALLOCATORS
            }
            rows.append({"row": row, **measured})
            print(f"  {row}: done", file=sys.stderr, flush=True)
        print(f"overrides: {' '.join(args.overrides)}\n")
        print(table(source, rows))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
