"""The 7B train step against MaxText 0.2.5's own `train_compile`, on exactly our config's shape:
per-device arguments, temp, outputs, aliased (donated) and peak bytes, FLOPs (XLA's cost
analysis), collectives and compile time, side by side.

    bench/maxtext/install.sh maxtext.trainers.pre_train.train_compile   # once
    .venv/bin/python bench/train_compile_vs_maxtext.py --rounds 3

Every compile runs in a fresh process with 8 simulated CPU devices and no persistent
compilation cache, the sides in turn: MaxText's `train_compile` as shipped
(`bench/maxtext/train_compile_worker.py`, in MaxText's own environment, `compile_topology=a3`,
`DECOUPLE_GCLOUD=TRUE`) and each of our twins (`parity.decoder.cost.compile_train_step`, what
`parity configs/llama2-7b.yml --checks=compile` compiles). Memory, FLOPs and collectives are
the same every round; compile time is the median over rounds (jit, lower and compile).
`--maxtext_no_donation` adds MaxText with the train state's donation dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEVICES = 8
GIB = 2.0**30


def maxtext_overrides(cfg, topology: str | None = None) -> list[str]:
    """MaxText `key=value` overrides for exactly `cfg`'s shape (its keys are MaxText's); for a
    TPU slice (`topology`), MaxText's own name of it."""
    overrides = {
        "model_name": cfg.model_name,  # MaxText's llama2-7b has the same dimensions
        # a3: a GPU system whose devices are this process's (CPU) devices
        "compile_topology": topology or "a3",
        "compile_topology_num_slices": 1,
        "jax_cache_dir": "",  # no persistent compilation cache
        "enable_checkpointing": "false",
        "attention": "dot_product",
        "dcn_data_parallelism": 1,
    }
    for key in (
        "per_device_batch_size",
        "max_target_length",
        "dtype",
        "weight_dtype",
        "matmul_precision",
        "ici_data_parallelism",
        "ici_fsdp_parallelism",
        "ici_tensor_parallelism",
        "ici_pipeline_parallelism",
        "num_pipeline_microbatches",
        "num_pipeline_repeats",
        "num_layers_per_pipeline_stage",
        "scan_layers_per_stage",
        "pipeline_delay_activation_forwarding",
        "pipeline_fsdp_ag_once",
        "set_remat_policy_on_pipeline_iterations",
    ):
        value = getattr(cfg, key)
        overrides[key] = str(value).lower() if isinstance(value, bool) else value
    overrides["remat_policy"] = cfg.remat_policy  # MaxText's names and meanings
    return [f"{k}={v}" for k, v in overrides.items()]


def our_worker(config: str, framework: str, out: str, topology: str | None) -> None:
    """Compile one twin's train step (in this fresh process) and write its cost as JSON: for
    XLA:CPU's simulated devices, or XLA:TPU's for `topology` (`parity.tpu`)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from migrate.common import sharding
    from migrate.config import loading as config_lib
    from parity.decoder import cost

    cfg = config_lib.load_config(config)
    if topology:
        from parity.tpu import compile_devices, topologies, train_step

        mesh, _ = compile_devices.make_mesh(cfg, topologies.parse(topology), cfg.num_slices)
        lowered = cost.lower_train_step(cfg, mesh, framework)
        compiled = train_step.compile_step(lowered, framework).cost
        if isinstance(compiled, train_step.Overflow):
            raise SystemExit(f"{framework}: {compiled.message}")
    else:
        compiled = cost.compile_train_step(cfg, sharding.make_mesh(cfg), framework)
    fields = (
        "argument_bytes",
        "temp_bytes",
        "output_bytes",
        "alias_bytes",
        "flops",
        "compile_seconds",
        "collectives",
    )
    Path(out).write_text(json.dumps({f: getattr(compiled, f) for f in fields}))


def run_side(side: str, args, cfg, scratch: Path, maxtext_python: str) -> dict:
    out = str(scratch / f"{side}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("XLA_FLAGS", None)
    if side.startswith("maxtext"):
        command = [maxtext_python, str(ROOT / "bench/maxtext/train_compile_worker.py")]
        command += ["--out", out, "--devices", str(DEVICES)]
        command += ["--no_donation"] if side == "maxtext-no-donation" else []
        command += maxtext_overrides(cfg, args.topology)
        env["DECOUPLE_GCLOUD"] = "TRUE"
    else:
        command = [sys.executable, __file__, "--worker", side, "--out", out]
        command += ["--config", args.config]
        command += ["--topology", args.topology] if args.topology else []
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    log = scratch / f"{side}.log"
    with log.open("w") as stream:
        code = subprocess.call(command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"{side} failed (exit {code}); its output: {log}")
    result = json.loads(Path(out).read_text())
    if side.startswith("maxtext"):
        from parity.analysis import hlo

        result["collectives"] = hlo.collective_counts(Path(out + ".hlo").read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/llama2-7b.yml"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--maxtext_no_donation", action="store_true")
    parser.add_argument("--maxtext_venv", default=os.environ.get("MAXTEXT_VENV"))
    parser.add_argument(
        "--topology", help="a TPU slice (MaxText's name, e.g. v5p-16): both sides' XLA:TPU programs"
    )
    parser.add_argument("--worker", choices=("linen", "nnx"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        our_worker(args.config, args.worker, args.out, args.topology)
        return

    from migrate.config import loading as config_lib
    from parity.analysis import hlo

    cfg = config_lib.load_config(args.config)
    venv = Path(args.maxtext_venv or ROOT / "bench/.venv-maxtext")
    maxtext_python = str(venv / "bin/python")
    if not Path(maxtext_python).exists():
        raise SystemExit(f"no MaxText environment at {venv}: run bench/maxtext/install.sh first")
    sides = ["maxtext", "nnx", "linen"] + (["maxtext-no-donation"] * args.maxtext_no_donation)
    results: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = sides[round_ % len(sides) :] + sides[: round_ % len(sides)]
            for side in order:
                results[side].append(run_side(side, args, cfg, Path(scratch), maxtext_python))
                print(f"round {round_}: {side} done", file=sys.stderr, flush=True)

    where = f"XLA:TPU for {args.topology}" if args.topology else f"{DEVICES} simulated CPU devices"
    print(
        f"{cfg.model_name}: {where}, per device; compile time the median of {args.rounds} "
        "round(s)\n"
    )
    print(
        "| side | arguments | temp | outputs | aliased | peak | FLOPs | collectives "
        f"({', '.join(hlo.COLLECTIVES)}) | compile s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for side in sides:
        first = results[side][0]
        peak = (
            first["argument_bytes"]
            + first["temp_bytes"]
            + first["output_bytes"]
            - first["alias_bytes"]
        )
        collectives = ", ".join(str(first["collectives"][k]) for k in hlo.COLLECTIVES)
        compile_s = statistics.median(r["compile_seconds"] for r in results[side])
        print(
            f"| {side} | {first['argument_bytes'] / GIB:.2f} GiB | {first['temp_bytes'] / GIB:.2f}"
            f" GiB | {first['output_bytes'] / GIB:.2f} GiB | {first['alias_bytes'] / GIB:.2f} GiB"
            f" | {peak / GIB:.2f} GiB | {first['flops']:.4g} | {collectives} | {compile_s:.1f} |"
        )
    print("\nMaxText overrides: " + " ".join(maxtext_overrides(cfg, args.topology)))


if __name__ == "__main__":
    main()
