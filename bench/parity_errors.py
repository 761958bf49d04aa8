"""Measured worst errors per tiny config: pipeline vs reference (per framework and part) and
NNX vs Linen (forward, grads), as a markdown table.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python bench/parity_errors.py
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from migrate.config import load_config  # noqa: E402
from parity import checks  # noqa: E402

CONFIGS = ("llama2-tiny", "llama2-tiny-scan", "llama2-tiny-delay", "llama2-tiny-agonce")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def worst(details, prefix: str) -> float:
    return max((d["max_rel"] for d in details if d["tensor"].startswith(prefix)), default=0.0)


def main() -> None:
    print(f"jax {jax.__version__}\n")
    print("| config | pipeline vs reference, max rel (logits / loss / grads), Linen | same, NNX "
          "| NNX vs Linen forward | NNX vs Linen grads |")
    print("| --- | --- | --- | ---: | ---: |")
    for name in CONFIGS:
        session = checks.Session(load_config(CONFIG_DIR / f"{name}.yml"))
        pipeline = checks.pipeline(session).details
        cells = []
        for fw in ("linen", "nnx"):
            cells.append(" / ".join(f"{worst(pipeline, f'{fw}/{part}'):.2e}"
                                    for part in ("logits", "loss", "grads")))
        forward, grads = checks.forward(session), checks.grads(session)
        print(f"| {name} | {cells[0]} | {cells[1]} | {forward.value:.1e} | {grads.value:.1e} |")


if __name__ == "__main__":
    main()
