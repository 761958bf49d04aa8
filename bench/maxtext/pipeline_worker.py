"""MaxText 0.2.5's `NNXPipeline` of llama2 decoder layers: forward+backward, compiled and timed.

Runs in MaxText's own virtual environment (`bench/maxtext/install.sh`), never in the project's:

    DECOUPLE_GCLOUD=TRUE bench/.venv-maxtext/bin/python bench/maxtext/pipeline_worker.py \
        --stages 4 --microbatches 4 --steps 20

It builds the pipeline the way MaxText's NNX decoder does (`NNXPipeline` with a stage factory
of `LlamaDecoderLayer`, MaxText's own config loader, mesh and logical rules), then speaks the
`serve.py` protocol. `bench/pipeline_vs_maxtext.py` starts it and interleaves its rounds with
the project's twins.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.stages}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import maxtext  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from maxtext.common.common_types import MODEL_MODE_TRAIN  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers.pipeline import NNXPipeline  # noqa: E402
from maxtext.models.llama2 import LlamaDecoderLayer  # noqa: E402
from serve import compile_and_report, serve, timed_compile  # noqa: E402


def maxtext_config():
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    overrides = {
        "run_name": "pipeline_bench",
        "jax_cache_dir": "",  # no persistent compilation cache: compile times are measured
        "base_output_directory": os.path.join(tempfile.gettempdir(), "maxtext_bench_output"),
        "hardware": "cpu",
        "skip_jax_distributed_system": True,
        "enable_checkpointing": False,
        "dtype": "float32",
        "weight_dtype": "float32",
        "matmul_precision": "highest",
        "decoder_block": "llama2",
        "attention": "dot_product",
        "base_emb_dim": args.emb,
        "base_num_query_heads": args.heads,
        "base_num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "base_mlp_dim": args.mlp,
        "base_num_decoder_layers": args.stages * args.layers_per_stage,
        "vocab_size": args.vocab,
        "max_target_length": args.seq,
        "per_device_batch_size": args.per_device_batch,
        "ici_pipeline_parallelism": args.stages,
        "ici_fsdp_parallelism": 1,
        "ici_data_parallelism": 1,
        "num_pipeline_microbatches": args.microbatches,
        "num_layers_per_pipeline_stage": args.layers_per_stage,
        "num_pipeline_repeats": 1,
        "scan_layers": True,
        "set_remat_policy_on_pipeline_iterations": True,
        "scan_pipeline_iterations": True,
        "dropout_rate": 0.0,
    }
    return pyconfig.initialize([None, base], **overrides)


def main() -> None:
    config = maxtext_config()
    # MaxText's mesh axes, every one of size 1 but `stage` (what its mesh builder gives for
    # this config; the builder's module pulls in checkpoint-conversion dependencies).
    shape = [args.stages if axis == "stage" else 1 for axis in config.mesh_axes]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), config.mesh_axes)
    rules = config.logical_axis_rules
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        pipeline = NNXPipeline(
            config=config,
            stage_factory=lambda rngs: LlamaDecoderLayer(
                config=config, model_mode=MODEL_MODE_TRAIN, mesh=mesh, rngs=rngs
            ),
            mesh=mesh,
            remat_policy=None,  # the iteration body saves only its input and the layer inputs
            rngs=nnx.Rngs(params=0, dropout=1),
        )
        graphdef, params, rest = nnx.split(pipeline, nnx.Param, ...)
        # Under the rules context, the specs come out already resolved to mesh axes.
        specs = nnx.get_partition_spec(params)
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        params = jax.device_put(params, shardings)

        batch = args.per_device_batch * args.stages
        x = jax.device_put(
            jax.random.normal(jax.random.key(2), (batch, args.seq, args.emb), jnp.float32),
            NamedSharding(mesh, PartitionSpec()),
        )
        positions = jnp.broadcast_to(jnp.arange(args.seq), (batch, args.seq))

        def loss(params, x, rest):
            model = nnx.merge(graphdef, params, rest)
            y = model(x, None, positions, True, MODEL_MODE_TRAIN)
            return jnp.sum(jnp.square(y))

        # `rest` (the dropout RNG counters the pipeline advances) is traced at the gradient's level
        # too, so that the pipeline may update it; its integer "gradient" is empty.
        grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), allow_int=True))
        compiled, ready = compile_and_report(grad_fn.lower(params, x, rest), args.hlo)
        ready |= {"side": "maxtext", "jax": jax.__version__}
        serve(
            lambda: jax.block_until_ready(compiled(params, x, rest)),
            lambda: timed_compile(lambda: grad_fn.lower(params, x, rest)),
            args.steps,
            ready,
        )


if __name__ == "__main__":
    main()
