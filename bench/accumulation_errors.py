"""Measured worst error of an accumulating train step against one step on the whole batch,
per shipped tiny config, over seeds and accumulation counts: what the `train` check's
accumulation records hold to the reshaped tier (`DecoderPair.accumulation_records`,
`parity/analysis/compare.py`). Per part: loss, gradient norm, AdamW's moments after the step
(`mu`: the clipped gradients scaled, `nu`: their squares scaled).

    PYTHONPATH=. python bench/accumulation_errors.py [--seeds 0 1 2] [--steps 2 4]
        [--configs NAME ...]

Runs on 16 simulated CPU devices (the 4-axis config needs them; 8-device meshes use the first 8).
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=16".strip()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from migrate.config.loading import load_config  # noqa: E402
from parity.analysis import compare  # noqa: E402
from parity.decoder.session import DecoderPair  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# Dense configs only: with experts the load-balancing loss is per batch (not compared).
CONFIGS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("llama2-tiny*.yml")))
PARTS = ("loss", "grad_norm", "mu", "nu")  # AdamW's moments: the gradients, their squares


def measure(name: str, seeds: list[int], counts: list[int]) -> dict[str, float]:
    row = dict.fromkeys(PARTS, 0.0)
    for k in counts:
        for seed in seeds:
            cfg = load_config(
                CONFIG_DIR / f"{name}.yml", [f"gradient_accumulation_steps={k}", f"seed={seed}"]
            )
            for record in DecoderPair(cfg).accumulation_records():
                path = record["tensor"].split("step 0/")[1].split("/")
                part = next((p for p in path if p in PARTS), None)
                if part is not None:  # the step count: an integer, always equal
                    row[part] = max(row[part], record["max_rel"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    print(f"| config | tier | {' | '.join(PARTS)} |")
    print(f"| --- | --- |{' ---: |' * len(PARTS)}")
    for name in args.configs:
        row = measure(name, args.seeds, args.steps)
        tier = compare.reshaped_tolerance(load_config(CONFIG_DIR / f"{name}.yml"))
        cells = " | ".join(f"{row[p]:.3g}" for p in PARTS)
        print(f"| {name} | {tier.max_rel:.3g} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
