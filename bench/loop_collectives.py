"""Collectives per pipeline-loop body (forward / backward) of each config's compiled train step,
across stages against `parity.decoder.cost.loop_body_minimum` and within stages, with temp memory:
the table in docs/performance.md.

    PYTHONPATH=. .venv/bin/python bench/loop_collectives.py [CONFIG ...]
    PYTHONPATH=. .venv/bin/python bench/loop_collectives.py --hlo_dir DIR CONFIG ...

With `--hlo_dir`, each config's optimised HLO is read from `DIR/CONFIG.hlo` (for example one
written by an older tree) instead of compiled.
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
    "llama2-tiny",
    "llama2-tiny-delay",
    "llama2-tiny-scan",
    "llama2-tiny-agonce",
    "llama2-tiny-agrepeat",
    "llama2-7b",
)


def cell(counts: dict[str, dict[str, int]]) -> str:
    """`kind fwd/bwd` for every kind present in either direction."""
    parts = [
        f"{kind} {counts['forward'][kind]}/{counts['backward'][kind]}"
        for kind in hlo.COLLECTIVES
        if counts["forward"][kind] or counts["backward"][kind]
    ]
    return ", ".join(parts) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=CONFIGS)
    parser.add_argument("--hlo_dir", default=None)
    parser.add_argument("--framework", choices=("linen", "nnx"), default="nnx")
    args = parser.parse_args()
    print("| config | across stages, fwd/bwd | minimum | within stages, fwd/bwd | temp |")
    print("| --- | --- | --- | --- | ---: |")
    for name in args.configs:
        cfg = load_config(CONFIG_DIR / f"{name}.yml")
        mesh = sharding.make_mesh(cfg)
        if args.hlo_dir:
            text = (Path(args.hlo_dir) / f"{name}.hlo").read_text()
            compiled = cost.CompiledCost(0, 0, 0, 0, 0.0, 0.0, {}, 0.0, "", tuple(hlo.loops(text)))
            temp = "-"
        else:
            compiled = cost.compile_train_step(cfg, mesh, args.framework)
            temp = f"{compiled.temp_bytes:,}"
        counts = cost.loop_body_counts(compiled, cfg, dict(mesh.shape))
        minimum = cost.loop_body_minimum(cfg)
        print(
            f"| {name} | {cell(counts.across_stages)} | {cell(minimum) if minimum else '-'} | "
            f"{cell(counts.within_stages)} | {temp} |"
        )


if __name__ == "__main__":
    main()
