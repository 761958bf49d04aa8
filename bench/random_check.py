"""Calibration of the `random` check (parity/engine/randomness.py): the smallest p-value of
correct dropout ports over many seeds (how far they stay from the significance `ALPHA`), and
of seeded bugs (how far below it they fall).

Pairs: `nn.Dropout(0.5)` against `nnx.Dropout(0.5)` with its own `nnx.Rngs` stream, and the
Dense -> BatchNorm -> Dropout -> Dense block of tests/test_module_gate.py against its port;
each side draws its own keys (Linen `rngs={'dropout': key}`, NNX its streams), 128 draws.
The seed moves both sides' keys: Linen's through `compare_modules(seed=)`, NNX's through its
`nnx.Rngs` seed.

    PYTHONPATH=. python bench/random_check.py [--seeds 40]
"""

from __future__ import annotations

import os
import re
import sys

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402
from test_module_gate import STREAMS, DropoutBeforeNorm, LinenBlock, NNXBlock  # noqa: E402

from parity.engine.randomness import ALPHA  # noqa: E402
from parity.pairs import Call, Randomness, compare_modules  # noqa: E402

X = jax.random.normal(jax.random.key(1), (8, 8))
DROPOUT_CALLS = [
    Call((X,), linen={"deterministic": False}, randomness=Randomness(), name="train"),
]


def smallest(results) -> tuple[float, int]:
    """(smallest p-value, number of tests) of a `random` result."""
    tests = [d["p_value"] for d in results[0].details if "p_value" in d]
    return min(tests), len(tests)


def dropout(seed: int, rate: float = 0.5):
    port = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=seed + 1000))
    return compare_modules(nn.Dropout(0.5), port, DROPOUT_CALLS, checks=["random"], seed=seed)


def block(seed: int, cls=NNXBlock, **kwargs):
    port = cls(rngs=nnx.Rngs(seed + 1000), **kwargs)
    return compare_modules(LinenBlock(), port, STREAMS, checks=["random"], seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    seeds = range(parser.parse_args().seeds)
    print(f"significance ALPHA = {ALPHA:g} (Bonferroni over a check's tests)")
    print("| pair | seeds | smallest p-value x tests (correct: must stay >= ALPHA) |")
    print("| --- | --- | --- |")
    for name, run in (("nn.Dropout / nnx.Dropout", dropout), ("block / port", block)):
        scaled = []
        for seed in seeds:
            p, tests = smallest(run(seed))
            scaled.append(p * tests)
        median = sorted(scaled)[len(scaled) // 2]
        print(f"| {name} | {len(scaled)} | {min(scaled):.3g} (median {median:.3g}) |")
    print()
    print("| seeded bug | seeds | largest smallest-p-value (must be < ALPHA / tests) |")
    print("| --- | --- | --- |")
    bugs = {
        "Dropout rate 0.4 vs 0.5": lambda s: dropout(s, 0.4),
        "block: rate 0.5 vs 0.25": lambda s: block(s, rate=0.5),
        "block: dropout before the norm": lambda s: block(s, DropoutBeforeNorm),
    }
    for name, run in bugs.items():
        worst = max(smallest(run(seed))[0] for seed in seeds[:10])
        print(f"| {name} | {min(10, len(seeds))} | {worst:.3g} |")


if __name__ == "__main__":
    main()
