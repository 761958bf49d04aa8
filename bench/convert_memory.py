"""Peak resident memory and wall time of the Linen <-> NNX weight converters on a >= 2 GiB tree.

Each measurement runs in a fresh subprocess: it builds a tree of float32 arrays (Linen
`{'params': ...}` of `LogicallyPartitioned` boxes, and an abstract NNX target of
`nnx.Param(ShapeDtypeStruct, out_sharding=names)`), then times `convert.linen_to_nnx` or
`convert.nnx_to_linen` (checked against an abstract Linen target). Peak RSS growth over the
pre-conversion RSS is read from `VmHWM` after resetting it (`/proc/self/clear_refs`), and
cross-checked by a thread sampling `VmRSS`. The converters move arrays, so growth should be a
tiny fraction of the tree's bytes; the script also checks that every output array is the very
object that went in. A control row copies every array instead, to show what a copy reports.

    PYTHONPATH=. python bench/convert_memory.py [--repeats 3]
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from migrate.checkpoints import convert  # noqa: E402

MiB = 2**20
NAMES = ("embed", "mlp")
# case -> (leaf count, leaf shape); both 2 GiB of float32.
CASES: dict[str, tuple[int, tuple[int, int]]] = {
    "16 x 128 MiB": (16, (4096, 8192)),
    "2048 x 1 MiB": (2048, (512, 512)),
}
# `copy (control)` copies every array: it shows what the instrument reports for a real copy.
DIRECTIONS = ("linen_to_nnx", "nnx_to_linen", "copy (control)")


def status_kib(field: str) -> int:
    """A `/proc/self/status` field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak() -> None:
    """Reset VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class RssSampler(threading.Thread):
    """Samples VmRSS every `interval` seconds until `stop()`; `peak_kib` is the largest."""

    def __init__(self, interval: float = 5e-4) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak_kib, self._done = interval, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak_kib = max(self.peak_kib, status_kib("VmRSS"))
            time.sleep(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak_kib


def paths(count: int) -> list[tuple[str, str]]:
    """Nested paths `block_{i // 8}/dense_{i % 8}`, so that the tree has depth."""
    return [(f"block_{i // 8}", f"dense_{i % 8}") for i in range(count)]


def linen_tree(count: int, shape: tuple[int, int]) -> dict[str, Any]:
    """Linen variables of `count` boxed float32 arrays, each filled (every page touched)."""
    params: dict[str, Any] = {}
    for i, (block, dense) in enumerate(paths(count)):
        value = jnp.full(shape, float(i), jnp.float32)
        params.setdefault(block, {})[dense] = {"kernel": nn.LogicallyPartitioned(value, NAMES)}
    return {"params": jax.block_until_ready(params)}


def abstract_linen(count: int, shape: tuple[int, int]) -> dict[str, Any]:
    """The same Linen tree with `ShapeDtypeStruct` values (as `jax.eval_shape(init)` gives)."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    params: dict[str, Any] = {}
    for block, dense in paths(count):
        params.setdefault(block, {})[dense] = {"kernel": nn.LogicallyPartitioned(spec, NAMES)}
    return {"params": params}


def abstract_nnx(count: int, shape: tuple[int, int]) -> nnx.State:
    """An abstract NNX State of Params with the same paths, shapes and logical names."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state(
            {(b, d, "kernel"): nnx.Param(spec, out_sharding=NAMES) for b, d in paths(count)}
        )


def array_ids(tree: Any) -> set[int]:
    """ids of the arrays in a Linen tree or an NNX State."""
    if isinstance(tree, nnx.State):
        return {id(v.get_value()) for _, v in nnx.to_flat_state(tree)}
    return {id(x) for x in jax.tree.leaves(nn.meta.unbox(tree))}


def measure(case: str, direction: str, repeats: int) -> dict[str, Any]:
    """Child process: build the tree, run one converter `repeats` times, report peak growth."""
    count, shape = CASES[case]
    start_kib = status_kib("VmRSS")
    variables = linen_tree(count, shape)
    tree_bytes = sum(x.nbytes for x in jax.tree.leaves(nn.meta.unbox(variables)))
    built_kib = status_kib("VmRSS")
    target = abstract_nnx(count, shape)
    convert_fn: Callable[[], Any]
    source: Any = variables
    if direction == "linen_to_nnx":
        convert_fn = lambda: convert.linen_to_nnx(variables, target)
    elif direction == "copy (control)":
        convert_fn = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, variables))
    else:
        source = convert.linen_to_nnx(variables, target)
        linen_target = abstract_linen(count, shape)
        del variables
        convert_fn = lambda: convert.nnx_to_linen(source, target=linen_target)
    source_ids = array_ids(source)
    growth, sampled, seconds, moved = [], [], [], True
    for _ in range(repeats):
        gc.collect()
        before = status_kib("VmRSS")
        reset_peak()
        sampler = RssSampler()
        sampler.start()
        t0 = time.perf_counter()
        out = convert_fn()
        seconds.append(time.perf_counter() - t0)
        sampled.append(max(sampler.stop() - before, 0))
        growth.append(status_kib("VmHWM") - before)
        moved = moved and array_ids(out) == source_ids
        del out
    return {
        "case": case,
        "direction": direction,
        "tree_bytes": tree_bytes,
        "build_growth_bytes": (built_kib - start_kib) * 1024,
        "peak_growth_bytes": max(growth) * 1024,
        "sampled_growth_bytes": max(sampled) * 1024,
        "wall_ms": 1e3 * statistics.median(seconds),
        "moved": moved,
    }


def run_child(case: str, direction: str, repeats: int) -> dict[str, Any]:
    """`measure` in a fresh interpreter; its result is the last stdout line, as JSON."""
    argv = [sys.executable, __file__, "--child", case, direction, "--repeats", str(repeats)]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: Sequence[dict[str, Any]], repeats: int) -> str:
    """The rows as a markdown table."""
    columns = (
        "tree",
        "direction",
        "tree MiB",
        "RSS growth building the tree, MiB",
        f"peak RSS growth converting, KiB (VmHWM, max of {repeats})",
        "% of tree",
        "sampled VmRSS growth, KiB",
        f"wall ms (median of {repeats})",
        "same array objects out",
    )
    lines = ["| " + " | ".join(columns) + " |", "| --- | --- |" + " ---: |" * 6 + " --- |"]
    for r in rows:
        cells = (
            r["case"],
            f"`{r['direction']}`",
            f"{r['tree_bytes'] / MiB:,.0f}",
            f"{r['build_growth_bytes'] / MiB:,.0f}",
            f"{r['peak_growth_bytes'] / 1024:,.0f}",
            f"{100 * r['peak_growth_bytes'] / r['tree_bytes']:.3f}",
            f"{r['sampled_growth_bytes'] / 1024:,.0f}",
            f"{r['wall_ms']:,.1f}",
            "yes" if r["moved"] else ("no" if "control" in r["direction"] else "NO"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parent: one child per (tree, direction), then the table. Child: one measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "DIRECTION"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args.repeats)))
        return
    rows = []
    for case in CASES:
        for direction in DIRECTIONS:
            rows.append(run_child(case, direction, args.repeats))
            print(f"  {case} / {direction}: done", flush=True)
    print(table(rows, args.repeats))


if __name__ == "__main__":
    main()
