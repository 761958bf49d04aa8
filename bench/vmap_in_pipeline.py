"""`jax.vmap` over merged state vs `nnx.vmap` over the stage module in the pipeline loop.

Builds the NNX decoder twice: once as is (`Pipeline.run_stages`: `jax.vmap` of
`nnx.merge(graphdef, stage_weights)`), once with `NnxVmapPipeline`, whose `run_stages` merges
the stacked stage module once and applies it with `nnx.vmap(spmd_axis_name='stage')`. For each
config it lowers and compiles the jitted forward+backward (value_and_grad of the token-mean
cross entropy) of both, checks that loss, logits and gradients are bit-identical, and prints
compile time, compiled temp memory and step time as a markdown table.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \
        python bench/vmap_in_pipeline.py [--compiles 3] [--steps 20]
"""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from migrate.common import loss, sharding  # noqa: E402
from migrate.config.contract import Config  # noqa: E402
from migrate.config.loading import load_config  # noqa: E402
from migrate.nnx import decoder as nnx_decoder  # noqa: E402
from migrate.nnx.pipeline import Pipeline  # noqa: E402
from parity.decoder.data import synthetic_batch  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama2-tiny.yml"
MEDIUM = (
    "base_emb_dim=512",
    "base_mlp_dim=1024",
    "head_dim=64",
    "base_num_query_heads=8",
    "base_num_kv_heads=8",
)
CASES: dict[str, tuple[str, ...]] = {"llama2-tiny": (), "llama2-tiny medium": MEDIUM}


class NnxVmapPipeline(Pipeline):
    """`Pipeline` whose stages run under `nnx.vmap` over the merged stage module."""

    def run_stages(self, graphdef, weights, stage_inputs, stage_positions, repeat_ids):
        """Select each stage's repeat (R > 1), merge once, `nnx.vmap` the module over stages."""
        if self.config.num_repeats > 1:
            # [R, S, ...] -> [S, ...]: stage s takes repeat repeat_ids[s], as `w[repeat]` does.
            weights = jax.vmap(
                lambda w, r: jax.tree.map(lambda a: a[r], w),
                in_axes=(1, 0),
                spmd_axis_name="stage",
            )(weights, repeat_ids)
        stages = nnx.merge(graphdef, weights)
        apply = nnx.vmap(
            lambda module, x, pos: module(x, pos), in_axes=(0, 0, 0), spmd_axis_name="stage"
        )
        return apply(stages, stage_inputs, stage_positions)


VARIANTS: dict[str, type[Pipeline]] = {"jax.vmap": Pipeline, "nnx.vmap": NnxVmapPipeline}


def make_step(cfg: Config, mesh: Mesh, pipeline_cls: type[Pipeline]) -> Callable:
    """A fresh jitted `(params, batch) -> ((loss, logits), grads)` (as `parity.decoder.twins`)."""
    with mock.patch.object(nnx_decoder, "Pipeline", pipeline_cls), nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: nnx_decoder.Decoder(cfg, mesh, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def loss_fn(params, batch):
        logits, _ = nnx.merge(graphdef, params)(batch["inputs"])
        return loss.cross_entropy_loss(logits, batch["targets"]), logits

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def compile_once(cfg: Config, mesh: Mesh, cls: type[Pipeline], args) -> tuple[Any, ...]:
    """(lowered, compiled, lower s, compile s), JAX's in-memory caches cleared first."""
    jax.clear_caches()
    step = make_step(cfg, mesh, cls)
    start = time.perf_counter()
    lowered = step.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return lowered, compiled, lowered_at - start, time.perf_counter() - lowered_at


def hlo_program(compiled) -> str:
    """Optimized HLO without source metadata (file/function tables, `metadata={...}`)."""
    text = compiled.as_text()
    text = text[text.index("\n%") :]
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def step_ms(compiled: dict[str, Any], args, steps: int) -> dict[str, float]:
    """Median wall ms per variant over `steps` runs after one warm-up (each has already run
    once, for the bit-identity check); variants interleaved so background load hits both."""
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for i in range(steps + 1):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if i >= 1:
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def bit_identical(a: Any, b: Any) -> tuple[bool, int]:
    """(every leaf of two host trees equal bit for bit, number of leaves compared)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False, 0
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    same = all(
        x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        for x, y in ((np.asarray(x), np.asarray(y)) for x, y in pairs)
    )
    return same, len(pairs)


def bench_case(name: str, cfg: Config, compiles: int, steps: int) -> list[dict[str, Any]]:
    """One table row per variant for `cfg`."""
    mesh = sharding.make_mesh(cfg)
    params = nnx.state(nnx_decoder.init_model(cfg, mesh), nnx.Param)
    args = (params, synthetic_batch(cfg, mesh))
    rows, compiled, results, programs = {}, {}, {}, {}
    for variant, cls in VARIANTS.items():
        runs = [compile_once(cfg, mesh, cls, args) for _ in range(compiles)]
        lowered, compiled[variant] = runs[-1][:2]
        results[variant] = jax.device_get(compiled[variant](*args))
        programs[variant] = (lowered.as_text(), hlo_program(compiled[variant]))
        rows[variant] = {
            "config": name,
            "variant": variant,
            "lower_s": statistics.median(r[2] for r in runs),
            "compile_s": statistics.median(r[3] for r in runs),
            "temp_bytes": compiled[variant].memory_analysis().temp_size_in_bytes,
        }
        print(f"  {name} / {variant}: compiled", flush=True)
    same, count = bit_identical(*results.values())
    same_hlo = [a == b for a, b in zip(*programs.values(), strict=True)]
    for variant, ms in step_ms(compiled, args, steps).items():
        rows[variant]["step_ms"] = ms
        rows[variant]["identical"] = f"{'yes' if same else 'NO'} ({count} leaves)"
        rows[variant]["same_program"] = " / ".join("yes" if x else "no" for x in same_hlo)
    return list(rows.values())


def table(rows: Sequence[dict[str, Any]], compiles: int, steps: int) -> str:
    """The rows as a markdown table."""
    columns = (
        "config",
        "variant",
        f"trace+lower s (median of {compiles})",
        f"compile s (median of {compiles})",
        "temp bytes",
        f"step ms (median of {steps})",
        "loss, logits, grads bit-identical",
        "same StableHLO / optimized HLO",
    )
    lines = ["| " + " | ".join(columns) + " |", "| --- | --- |" + " ---: |" * 4 + " --- | --- |"]
    for r in rows:
        cells = (
            r["config"],
            r["variant"],
            f"{r['lower_s']:.2f}",
            f"{r['compile_s']:.2f}",
            f"{r['temp_bytes']:,}",
            f"{r['step_ms']:.1f}",
            r["identical"],
            r["same_program"],
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Benchmark both variants on every case and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiles", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__}, flax {flax.__version__}, {jax.device_count()} x {device.platform}"
    )
    rows = []
    for name, overrides in CASES.items():
        cfg = load_config(CONFIG, overrides)
        rows += bench_case(name, cfg, args.compiles, args.steps)
    print(table(rows, args.compiles, args.steps))


if __name__ == "__main__":
    main()
