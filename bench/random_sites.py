"""Power of the `random` check against one missing dropout in a whole model, at the outputs
alone against per submodule output (parity/engine/randomness.py, `site_records`).

The pair is docs/examples/whole_model.py (dropout after the embedding, after each block's
attention and inside each MLP); the bug is block 1 without its attention dropout. Each side
draws its own keys; the seed moves both (Linen's through `compare_modules(seed=)`, NNX's
through its `nnx.Rngs`). Per run: the smallest p-value times the number of tests (the
Bonferroni-adjusted evidence; the check fails below `ALPHA`), over the output tests alone and
over every test.

    PYTHONPATH=. python bench/random_sites.py [--seeds 3] [--draws 128]
"""

from __future__ import annotations

import os
import re
import sys

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "examples")
)

import argparse  # noqa: E402

import whole_model as wm  # noqa: E402

from parity.engine.randomness import ALPHA  # noqa: E402
from parity.pairs import Call, Randomness, compare_modules  # noqa: E402


def adjusted(records: list[dict]) -> float:
    """The smallest p-value times the number of tests."""
    tested = [r["p_value"] for r in records if "p_value" in r]
    return min(tested) * len(tested) if tested else 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--draws", type=int, default=128)
    args = parser.parse_args()
    train = Call(
        (wm.tokens(),),
        linen={"deterministic": False},
        nnx_attributes={"deterministic": False},
        randomness=Randomness(draws=args.draws),
        name="train",
    )
    print(f"draws {args.draws}, significance {ALPHA:g}; smallest p x tests")
    print("port              seed  outputs only  every site  named")
    for label, bug in (("correct", {}), ("missing dropout", {"drop_attn": False})):
        for seed in range(args.seeds):
            port = wm.nnx_model(seed=seed, **bug)
            (result,) = compare_modules(
                wm.LinenModel(), port, [train], checks=["random"], seed=seed
            )
            details = [d for d in result.details if "p_value" in d]
            outputs = [d for d in details if d["tensor"].startswith("train/outputs")]
            print(
                f"{label:16}  {seed:4}  {adjusted(outputs):12.3g}  {adjusted(details):10.3g}  "
                f"{result.where if not result.passed else '-'}"
            )


if __name__ == "__main__":
    main()
