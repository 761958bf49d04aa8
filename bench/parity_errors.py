"""Measured worst errors per shipped tiny config, per check: pipeline vs reference per part
(logits, loss, grads, grad_norm; worst of Linen and NNX, over seeds), Linen vs NNX for every
twin check, and the efficiency check's matmul-overhead error. The tolerance tiers in
`parity/analysis/compare.py` are calibrated from this table (docs/configs.md).

    PYTHONPATH=. python bench/parity_errors.py [--seeds 0 1 2] [--configs NAME ...]
        [--variant 'llama2-tiny matmul_precision=default' ...]

Runs on 16 simulated CPU devices (the 4-axis config needs them; 8-device meshes use the first 8).
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=16".strip()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from migrate.config.loading import load_config  # noqa: E402
from parity.analysis import compare  # noqa: E402
from parity.decoder import checks as decoder_checks  # noqa: E402
from parity.decoder.session import DecoderPair  # noqa: E402
from parity.engine import run_loop  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("llama2-tiny*.yml")))
TWIN_CHECKS = ("roundtrip", "forward", "grads", "train", "layers")


def worst(details, prefix: str) -> float:
    return max((d["max_rel"] for d in details if d["tensor"].startswith(prefix)), default=0.0)


def pipeline_parts(session: DecoderPair) -> dict[str, float]:
    """Worst pipeline-vs-reference error per part, over both frameworks."""
    details = decoder_checks.pipeline(session).details
    return {
        part: max(worst(details, f"{fw}/{part}") for fw in ("linen", "nnx"))
        for part in decoder_checks.PIPELINE_PARTS
    }


def measure(
    name: str, overrides: list[str], seeds: list[int], pipeline_only: bool = False
) -> dict[str, float]:
    cfg = load_config(CONFIG_DIR / f"{name}.yml", overrides)
    row: dict[str, float] = {}
    for seed in seeds:
        session = DecoderPair(cfg.replace(seed=seed))
        for part, value in pipeline_parts(session).items():
            row[f"pipeline/{part}"] = max(row.get(f"pipeline/{part}", 0.0), value)
        if seed == seeds[0] and not pipeline_only:
            for check in TWIN_CHECKS:
                result = run_loop.call(session, check, steps=3)
                row[check] = result.value
            efficiency = decoder_checks.efficiency(session)
            row["efficiency"] = efficiency.value
            row["loop elementwise"] = (
                efficiency.details[0]["loop_elementwise_overhead"] if efficiency.details else 0.0
            )
    row["tier"] = compare.reshaped_tolerance(cfg).max_rel
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--variant", action="append", default=[], help="'CONFIG key=value ...'")
    parser.add_argument(
        "--pipeline_only",
        action="store_true",
        help="measure only pipeline vs reference (the twin and efficiency columns read 0)",
    )
    parser.add_argument(
        "--overrides", nargs="*", default=[], help="key=value applied to every config"
    )
    args = parser.parse_args()
    runs = [(name, list(args.overrides)) for name in args.configs]
    runs += [(v.split()[0], v.split()[1:]) for v in args.variant]
    print(f"jax {jax.__version__}, seeds {args.seeds}\n")
    parts = " | ".join(decoder_checks.PIPELINE_PARTS)
    twins = " | ".join(TWIN_CHECKS)
    print(
        f"| config | pipeline: {parts} | pipeline tier | {twins} | efficiency | loop elementwise |"
    )
    print("| --- |" + " ---: |" * (len(decoder_checks.PIPELINE_PARTS) + len(TWIN_CHECKS) + 3))
    for name, overrides in runs:
        row = measure(name, overrides, args.seeds, args.pipeline_only)
        cells = [f"{row[f'pipeline/{p}']:.2e}" for p in decoder_checks.PIPELINE_PARTS]
        cells += [f"{row['tier']:.2e}"]
        if args.pipeline_only:
            cells += ["-"] * (len(TWIN_CHECKS) + 2)
        else:
            cells += [f"{row[c]:.0e}" for c in TWIN_CHECKS]
            cells += [f"{row['efficiency']:.0e}", f"{row['loop elementwise']:.2%}"]
        print(f"| {' '.join([name, *overrides])} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
