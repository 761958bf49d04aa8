"""One of the project's pipeline twins: forward+backward, compiled and timed, for the side-by-side
benchmark against MaxText (`bench/pipeline_vs_maxtext.py` starts it; `bench/maxtext/serve.py`
is the protocol).

    PYTHONPATH=. .venv/bin/python bench/pipeline_worker.py --framework nnx --steps 20

The shapes and the loss are the MaxText worker's (`bench/maxtext/pipeline_worker.py`): llama2
decoder layers, float32, `highest` matmul precision, the iteration body checkpointed saving only
its input and the layer inputs, loss `sum(outputs**2)`, gradients for weights and inputs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--framework", choices=("linen", "nnx"), default="nnx")
parser.add_argument("--stages", type=int, default=4)
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--layers_per_stage", type=int, default=1)
parser.add_argument("--emb", type=int, default=64)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--kv_heads", type=int, default=2)
parser.add_argument("--head_dim", type=int, default=16)
parser.add_argument("--mlp", type=int, default=128)
parser.add_argument("--vocab", type=int, default=256)
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--per_device_batch", type=int, default=4)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--hlo", default=None, help="write the optimised HLO here")
args = parser.parse_args()

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={args.stages}".strip()
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "maxtext")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from serve import compile_and_report, serve, timed_compile  # noqa: E402

from migrate.common import packing, sharding  # noqa: E402
from migrate.config.loading import load_config  # noqa: E402
from migrate.linen import decoder as linen_decoder  # noqa: E402
from migrate.linen import pipeline as linen_pipeline  # noqa: E402
from migrate.nnx import decoder as nnx_decoder  # noqa: E402
from migrate.nnx import pipeline as nnx_pipeline  # noqa: E402


def config():
    return load_config(
        ROOT / "configs" / "llama2-tiny.yml",
        (
            f"base_emb_dim={args.emb}",
            f"base_num_query_heads={args.heads}",
            f"base_num_kv_heads={args.kv_heads}",
            f"head_dim={args.head_dim}",
            f"base_mlp_dim={args.mlp}",
            f"vocab_size={args.vocab}",
            f"max_target_length={args.seq}",
            f"base_num_decoder_layers={args.stages * args.layers_per_stage}",
            f"num_layers_per_pipeline_stage={args.layers_per_stage}",
            f"ici_pipeline_parallelism={args.stages}",
            "ici_fsdp_parallelism=1",
            "ici_data_parallelism=1",
            f"num_pipeline_microbatches={args.microbatches}",
            "num_pipeline_repeats=1",
            f"per_device_batch_size={args.per_device_batch}",
            "dtype=float32",
            "weight_dtype=float32",
            "matmul_precision=highest",
            "remat_policy=full",
        ),
    )


def main() -> None:
    cfg = config()
    mesh = sharding.make_mesh(cfg)
    x = jax.device_put(
        jax.random.normal(
            jax.random.key(2), (cfg.global_batch_size, args.seq, args.emb), jnp.float32
        ),
        NamedSharding(mesh, PartitionSpec()),
    )
    positions = packing.Positions(jnp.broadcast_to(jnp.arange(args.seq), x.shape[:2]))
    if args.framework == "nnx":
        with nnx.use_eager_sharding(False):  # placed below, by the full stacked names
            model = nnx_pipeline.Pipeline(cfg, mesh, rngs=nnx.Rngs(params=0))
        graphdef, params = nnx.split(model)
        params = jax.device_put(params, nnx_decoder.param_shardings(params, mesh, cfg))

        def apply(params, x):
            return nnx.merge(graphdef, params)(x, positions)[0]  # (outputs, aux)
    else:
        model = linen_pipeline.Pipeline(cfg, mesh)
        variables = model.init(jax.random.key(0), x, positions)
        params = jax.device_put(
            variables["params"], linen_decoder.param_shardings(variables, mesh, cfg)["params"]
        )

        def apply(params, x):
            return model.apply({"params": params}, x, positions)[0]  # (outputs, aux)

    def loss(params, x):
        return jnp.sum(jnp.square(apply(params, x)))

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled, ready = compile_and_report(grad_fn.lower(params, x), args.hlo)
    ready |= {"side": args.framework, "jax": jax.__version__}
    serve(
        lambda: jax.block_until_ready(compiled(params, x)),
        lambda: timed_compile(lambda: grad_fn.lower(params, x)),
        args.steps,
        ready,
    )


if __name__ == "__main__":
    main()
