"""The three ways the pipeline all-gathers its stage weights over fsdp, side by side: per
iteration (the default), once per run (`pipeline_fsdp_ag_once`) and once per circular repeat
(`pipeline_fsdp_ag_per_repeat`), each compiled as the whole train step (the `compile` check's
`parity.decoder.cost.compile_train_step`, abstract: nothing allocated). The table in
docs/performance.md.

    PYTHONPATH=. .venv/bin/python bench/ag_modes.py [CONFIG[:key=value,...] ...]

Per device: temp and peak memory; all-gathers over fsdp as instructions in the iteration loop's
body (forward/backward), in the repeat loop's body outside it, outside every loop, and as
executions per step (instructions times the trip counts of the loops around them); the
collective instructions of the program by kind.
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from migrate.common import sharding  # noqa: E402
from migrate.config.loading import load_config  # noqa: E402
from parity.analysis import hlo  # noqa: E402
from parity.decoder import cost  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = (
    "llama2-tiny-agrepeat",
    # 7B shapes with R = 8 (L = 1) and R = 4 (L = 2, scanned): the window holds 2 of R repeats.
    "llama2-7b:num_pipeline_repeats=8,num_layers_per_pipeline_stage=1",
    "llama2-7b:num_pipeline_repeats=4,num_layers_per_pipeline_stage=2",
)
MODES = {
    "per iteration": ("pipeline_fsdp_ag_once=false", "pipeline_fsdp_ag_per_repeat=false"),
    "once": ("pipeline_fsdp_ag_once=true", "pipeline_fsdp_ag_per_repeat=false"),
    "per repeat": ("pipeline_fsdp_ag_once=false", "pipeline_fsdp_ag_per_repeat=true"),
}


def is_fsdp_gather(collective: hlo.Collective, mesh_shape: dict[str, int]) -> bool:
    return collective.kind == "all-gather" and "fsdp" in collective.mesh_axes(mesh_shape)


def executed(loop: hlo.Loop, mesh_shape: dict[str, int], outer: int = 1) -> int:
    """fsdp all-gathers `loop` runs: its own per trip, its inner loops' per their trips."""
    trips = outer * (loop.trip_count or 1)
    own = sum(is_fsdp_gather(c, mesh_shape) for c in loop.own_collectives())
    return trips * own + sum(executed(inner, mesh_shape, trips) for inner in loop.inner)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=CONFIGS)
    parser.add_argument("--framework", choices=("linen", "nnx"), default="nnx")
    args = parser.parse_args()
    print(
        "| config | mode | temp | peak | fsdp all-gathers: iteration body fwd/bwd | "
        "repeat body fwd/bwd | outside loops | executed per step | collectives "
        "(ag, rs, ar, cp, a2a) | compile |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for spec in args.configs:
        name, _, extra = spec.partition(":")
        overrides = tuple(o for o in extra.split(",") if o)
        for mode, mode_overrides in MODES.items():
            cfg = load_config(CONFIG_DIR / f"{name}.yml", (*overrides, *mode_overrides))
            mesh = sharding.make_mesh(cfg)
            shape = dict(mesh.shape)
            compiled = cost.compile_train_step(cfg, mesh, args.framework)
            counts = cost.loop_body_counts(compiled, cfg, shape)
            outside = sum(is_fsdp_gather(c, shape) for _, c in compiled.outside_loops)
            runs = outside + sum(executed(loop, shape) for loop in compiled.loops)
            body = counts.fsdp_all_gathers
            repeat = counts.repeat_fsdp_all_gathers
            kinds = ", ".join(str(compiled.collectives.get(k, 0)) for k in hlo.COLLECTIVES)
            label = name + (f" ({', '.join(overrides)})" if overrides else "")
            print(
                f"| {label} | {mode} | {gib(compiled.temp_bytes)} | {gib(compiled.peak_bytes)} | "
                f"{body['forward']}/{body['backward']} | "
                + (
                    f"{repeat['forward']}/{repeat['backward']}"
                    if cfg.pipeline_fsdp_ag_per_repeat
                    else "-"
                )
                + f" | {outside} | {runs} | {kinds} | {compiled.compile_seconds:.0f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
