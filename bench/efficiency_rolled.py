"""The efficiency check's two ways of counting the pipeline's work, side by side per shipped
config: the rolled program the config runs, each loop body counted once per iteration
(`parity.analysis.work.executed`, what the check does), against an unrolled copy (a Python loop
over iterations and in-stage layers) read with XLA's own cost analysis (what it did before).

    PYTHONPATH=. python bench/efficiency_rolled.py [--configs NAME ...]

Prints, per config: the seconds each way took (compile and count, the reference layers
included), whether the matmul FLOPs agree to the FLOP, both measured overheads and both loop
elementwise fractions. Runs on 16 simulated CPU devices (the 4-axis config needs them).
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=16".strip()

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from migrate.common import sharding  # noqa: E402
from migrate.config.loading import load_config  # noqa: E402
from parity.analysis import work  # noqa: E402
from parity.decoder import efficiency, twins  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*-tiny*.yml")))


def _xla_counted(fn, *args) -> tuple[float, float]:
    """(XLA's cost-analysis FLOPs, matmul FLOPs) of a loop-free program, per device."""
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=efficiency._HLO_ONLY)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]), work.executed(compiled.as_text()).dot_flops


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    args = parser.parse_args()
    jax.config.update("jax_compilation_cache_dir", "")  # both ways compile for real
    print(
        "| config | rolled s | unrolled s | matmul FLOPs equal | overhead "
        "| elementwise (rolled / unrolled) |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for name in args.configs:
        cfg = load_config(CONFIG_DIR / f"{name}.yml")
        if not cfg.using_pipeline:
            continue
        if not (cfg.scan_pipeline_iterations or cfg.scan_layers_per_stage):
            print(f"| {name} | (no loop to roll: the config runs the pipeline unrolled) |")
            continue
        mesh = sharding.make_mesh(cfg)
        rolled, rolled_s = _timed(efficiency.pipeline_efficiency, cfg, mesh)
        unrolled_cfg = twins.compute_config(cfg).replace(
            scan_pipeline_iterations=False, scan_layers_per_stage=False
        )
        counting, efficiency._compiled_flops = efficiency._compiled_flops, _xla_counted
        try:
            unrolled, unrolled_s = _timed(efficiency._pipeline_efficiency, unrolled_cfg, mesh)
        finally:
            efficiency._compiled_flops = counting
        equal = (rolled.pipeline_dot_flops, rolled.reference_dot_flops) == (
            unrolled.pipeline_dot_flops,
            unrolled.reference_dot_flops,
        )
        print(
            f"| {name} | {rolled_s:.1f} | {unrolled_s:.1f} | {equal} | "
            f"{rolled.measured_overhead:.4f} / {unrolled.measured_overhead:.4f} | "
            f"{rolled.loop_elementwise_overhead:.2%} / {unrolled.loop_elementwise_overhead:.2%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
