"""NNX against Linen, side by side in one run: train-step time, compile time, compiled memory
and FLOPs, and per-call dispatch overhead (`nnx.jit` on the module against the functional
`jax.jit` over split state).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \
        python bench/step_time.py [--steps 30] [--medium_steps 4] [--rounds 3]

Steps of the two twins alternate, so both see the same machine load; each figure is the median
over `--rounds` rounds of `--steps` steps, and the spread (max/min of the round medians) is the
noise the ratios should be read against.
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from migrate.common import sharding  # noqa: E402
from migrate.config.loading import load_config  # noqa: E402
from migrate.nnx import decoder as nnx_decoder  # noqa: E402
from parity.decoder import cost, twins  # noqa: E402
from parity.decoder.session import DecoderPair  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama2-tiny.yml"
CONFIGS = {
    "tiny": (),
    "medium": (
        "base_emb_dim=512",
        "base_mlp_dim=1024",
        "head_dim=64",
        "base_num_query_heads=8",
        "base_num_kv_heads=8",
    ),
}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _median_and_spread(samples: list[list[float]]) -> tuple[float, float]:
    medians = [statistics.median(s) for s in samples]
    return statistics.median(medians), max(medians) / min(medians)


def step_times(session: DecoderPair, steps: int, rounds: int) -> dict[str, tuple]:
    """Median train-step seconds per twin, stepping alternately from the same weights."""
    trainers = {
        fw: session.side(fw).trainer(session.weights(fw, "linen")) for fw in ("linen", "nnx")
    }
    state = {fw: [t.params, t.opt_state, t.step] for fw, t in trainers.items()}
    samples: dict[str, list[list[float]]] = {"linen": [], "nnx": []}
    for fw in state:  # warm-up
        params, opt, step = state[fw]
        state[fw][:2] = jax.block_until_ready(step(params, opt, session.train_batch))[:2]
    for _ in range(rounds):
        per_round: dict[str, list[float]] = {"linen": [], "nnx": []}
        for _ in range(steps):
            for fw in ("linen", "nnx"):
                params, opt, step = state[fw]
                start = time.perf_counter()
                params, opt, _ = jax.block_until_ready(step(params, opt, session.train_batch))
                per_round[fw].append(time.perf_counter() - start)
                state[fw][:2] = params, opt
        for fw in samples:
            samples[fw].append(per_round[fw])
    return {fw: _median_and_spread(s) for fw, s in samples.items()}


def dispatch_overhead(session: DecoderPair, calls: int, rounds: int) -> dict[str, tuple]:
    """Host seconds per call of the same forward, `nnx.jit` on the module against `jax.jit`
    on split state: calls are issued back to back without waiting (asynchronous dispatch), so
    the time is what Python and the dispatcher spend, not the computation."""
    cfg, mesh = session.cfg, session.mesh
    model = nnx_decoder.init_model(cfg, mesh)
    graphdef, params = nnx.split(model)
    tokens = session.train_batch["inputs"]
    functional = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    module_jit = nnx.jit(lambda m, t: m(t))
    fns = {
        "jax.jit(split state)": lambda: functional(params, tokens),
        "nnx.jit(module)": lambda: module_jit(model, tokens),
    }
    samples: dict[str, list[list[float]]] = {name: [] for name in fns}
    for fn in fns.values():
        _timed(fn)
    for _ in range(rounds):
        for name, fn in fns.items():
            per_call = []
            for _ in range(calls):
                start = time.perf_counter()
                out = fn()
                per_call.append(time.perf_counter() - start)
            jax.block_until_ready(out)
            samples[name].append(per_call)
    return {name: _median_and_spread(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--medium_steps", type=int, default=4, help="steps per round, medium")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="tiny,medium")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} devices, {os.cpu_count()} CPU cores\n")
    print("| config | metric | Linen | NNX | NNX/Linen | noise (max/min of round medians) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for name in args.configs.split(","):
        cfg = load_config(CONFIG, CONFIGS[name])
        mesh = sharding.make_mesh(cfg)
        session = DecoderPair(cfg)
        compiled = {fw: cost.compile_train_step(cfg, mesh, fw) for fw in ("linen", "nnx")}
        for field, unit in (
            ("compile_seconds", "s"),
            ("temp_bytes", "B"),
            ("flops", ""),
            ("argument_bytes", "B"),
        ):
            a, b = getattr(compiled["linen"], field), getattr(compiled["nnx"], field)
            print(f"| {name} | {field} | {a:.4g}{unit} | {b:.4g}{unit} | {b / a:.3f} | |")
        same = compiled["linen"].program == compiled["nnx"].program
        print(
            f"| {name} | optimised program fingerprint | {compiled['linen'].program} | "
            f"{compiled['nnx'].program} | {'same' if same else 'DIFFERENT'} | |"
        )
        times = step_times(
            session, args.steps if name == "tiny" else args.medium_steps, args.rounds
        )
        (a, na), (b, nb) = times["linen"], times["nnx"]
        print(
            f"| {name} | train step ms (median) | {a * 1e3:.2f} | {b * 1e3:.2f} | "
            f"{b / a:.3f} | Linen {na:.3f}, NNX {nb:.3f} |"
        )
        if name == "tiny":
            calls = dispatch_overhead(session, args.steps, args.rounds)
            (a, na), (b, nb) = calls["jax.jit(split state)"], calls["nnx.jit(module)"]
            print(
                f"| {name} | host ms per call: jax.jit(state) vs nnx.jit(module) | "
                f"{a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} | {na:.3f}, {nb:.3f} |"
            )
        del session
        twins.clear_nnx_caches()


if __name__ == "__main__":
    main()
