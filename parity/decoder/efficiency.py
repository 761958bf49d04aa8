"""Pipeline efficiency: the matmul work the compiled pipeline performs against the useful work.

The pipeline is compiled as the config runs it (its iterations and in-stage layers scanned or
not), forward only, and its work is read off the compiled HLO with every loop body counted once
per iteration (`parity.analysis.work.executed`; XLA's own cost analysis counts a body once,
whatever its trip count). The useful work is one plain decoder layer, compiled once and counted
for each of the N identical layers; the layers after a pipelined subset are a Python loop,
compiled as it runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from migrate.checkpoints import convert
from migrate.common import axes, packing, placement, sharding
from migrate.config.contract import Config
from migrate.config.rules import MESH_AXES
from migrate.linen import decoder as linen_decoder
from migrate.linen import layers as linen_layers
from migrate.linen import pipeline as linen_pipeline
from parity.analysis import work
from parity.decoder import twins
from parity.decoder.cost import with_shardings


@dataclasses.dataclass(frozen=True)
class PipelineEfficiency:
    """The pipelined layer stack's work against the plain decoder layers', in FLOPs summed over
    devices. Matmul (dot) FLOPs are what the schedule's theory describes; the rest is
    elementwise work (norms, softmax, and the loop's masking, rotation and buffer updates)."""

    pipeline_dot_flops: float  # performed: per-device dots of the compiled pipeline x devices
    reference_dot_flops: float  # useful: every layer once on the full batch (one device)
    pipeline_flops: float  # everything the pipeline performs (XLA's FLOP rules x devices)
    reference_flops: float  # everything the reference layers perform
    theoretical_overhead: float  # (M*R + d*(S-1)) / (M*R); `placement.work_overhead` (subset)

    @property
    def measured_overhead(self) -> float:
        return self.pipeline_dot_flops / self.reference_dot_flops

    @property
    def relative_error(self) -> float:
        return abs(self.measured_overhead / self.theoretical_overhead - 1.0)

    @property
    def loop_elementwise_overhead(self) -> float:
        """The pipeline's elementwise FLOPs beyond the layers' own (the reference's, times the
        schedule's stage visits), as a fraction of the pipeline's matmul work."""
        pipeline_elementwise = self.pipeline_flops - self.pipeline_dot_flops
        layers_elementwise = (self.reference_flops - self.reference_dot_flops) * (
            self.theoretical_overhead
        )
        return (pipeline_elementwise - layers_elementwise) / self.pipeline_dot_flops


_HLO_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compiled_flops(fn, *args) -> tuple[float, float]:
    """(all FLOPs, matmul FLOPs) per device that `fn` compiled for `args` performs, its loops
    run to their trip counts."""
    # Never run: its work is read from the optimised HLO, which the LLVM backend's effort does
    # not change (the same FLOPs measured on every shipped config), and it compiles faster
    # without it.
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=_HLO_ONLY)
    performed = work.executed(compiled.as_text())
    return performed.flops, performed.dot_flops


def _one_device_mesh() -> Mesh:
    """The config's mesh axes, each of size 1, on one local device: a program compiled on it
    does exactly the work it describes, with no partitioning or replication."""
    device = np.array(jax.local_devices()[:1], dtype=object).reshape((1,) * len(MESH_AXES))
    return Mesh(device, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def pipeline_efficiency(cfg: Config, mesh: Mesh) -> PipelineEfficiency:
    """Matmul work the pipeline performs against the useful work (cached per computation)."""
    return _pipeline_efficiency(twins.compute_config(cfg), mesh)


@functools.cache
def _pipeline_efficiency(cfg: Config, mesh: Mesh) -> PipelineEfficiency:
    """Matmul work the pipeline performs against the useful work, `(M*R + d*(S-1)) / (M*R)`.

    Both sides are compiled forward-only; a loop body counts once per iteration. The pipeline,
    its loops as the config has them, is compiled on the config's mesh with its weights and
    input sharded as declared; its per-device matmul FLOPs times the device count are the work
    it performs, so matmuls replicated over a mesh axis count once per replica. The useful
    work is the plain decoder layers (N times one, identical layers) on the full batch,
    compiled on one device. With a pipelined subset the layers after the pipeline (a Python
    loop) are compiled on the config's mesh on the batch they run on, split over stages as
    well, and their work is added to the pipeline's: useful work once, with no bubbles
    (`placement.work_overhead`).
    """
    cfg = cfg.replace(set_remat_policy_on_pipeline_iterations=False)
    variables = twins.linen_abstract_variables(cfg, mesh)
    weights = with_shardings(  # boxed: `pipeline_fsdp_ag_once` reads the logical names
        linen_decoder.param_shardings(variables, mesh, cfg)["params"]["pipeline"],
        variables["params"]["pipeline"],
    )
    x, positions = _abstract_activations(cfg, mesh, axes.BATCH_LENGTH_EMBED)
    pipe = linen_pipeline.Pipeline(cfg, mesh)
    pipeline_flops, pipeline_dots = _compiled_flops(
        lambda w, x, pos: pipe.apply({"params": w}, x, pos)[0], weights, x, positions
    )

    if placement.has_layers_after_pipeline(cfg):
        after_flops, after_dots = _after_pipeline_flops(cfg, mesh, variables)
        pipeline_flops, pipeline_dots = pipeline_flops + after_flops, pipeline_dots + after_dots

    # The useful work: the N identical plain layers, each a compiled copy of one (a program
    # of N unrolled layers does N times the work of one in matmul FLOPs, measured on the
    # eleven shipped tiny configs that fit 8 devices; its trace and compile cost N times more).
    one_device = _one_device_mesh()
    layer = linen_layers.DecoderLayer(cfg, one_device)
    reference_layers = nn.meta.unbox(
        jax.eval_shape(lambda v: convert.linen_pipeline_to_reference(v, cfg), variables)
    )["params"]["layers"]
    stacked = {a.shape[0] for a in jax.tree.leaves(reference_layers)}
    assert stacked == {cfg.base_num_decoder_layers}, (stacked, cfg.base_num_decoder_layers)
    one_layer_params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), reference_layers
    )

    def plain_layer(layer_params, x, pos):
        return layer.apply({"params": layer_params}, x, pos.index, pos.segment)[0]

    layer_flops, layer_dots = _compiled_flops(
        plain_layer,
        one_layer_params,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), positions),
    )
    reference_flops = layer_flops * cfg.base_num_decoder_layers
    reference_dots = layer_dots * cfg.base_num_decoder_layers
    return PipelineEfficiency(
        pipeline_dot_flops=pipeline_dots * cfg.num_devices,
        reference_dot_flops=reference_dots,
        pipeline_flops=pipeline_flops * cfg.num_devices,
        reference_flops=reference_flops,
        theoretical_overhead=placement.work_overhead(cfg),
    )


def _after_pipeline_flops(cfg: Config, mesh: Mesh, variables: Any) -> tuple[float, float]:
    """(all FLOPs, matmul FLOPs) per device of the layers after the pipeline (a Python loop), on
    the batch split over stages too (`sharding.after_pipeline_config`), weights as declared."""
    after_cfg = sharding.after_pipeline_config(cfg)
    stacked = variables["params"][axes.LAYERS_AFTER_PIPELINE]["layers"]
    shardings = linen_decoder.param_shardings(variables, mesh, cfg)["params"]
    weights = with_shardings(shardings[axes.LAYERS_AFTER_PIPELINE]["layers"], stacked)
    weights = nn.meta.unbox(weights)
    x, positions = _abstract_activations(cfg, mesh, axes.LOGITS_BATCH_LENGTH_EMBED)
    layer = linen_layers.DecoderLayer(after_cfg, mesh)

    def after(stacked_params, x, pos):
        for k in range(cfg.num_layers_after_pipeline):
            params = {"params": jax.tree.map(lambda w, k=k: w[k], stacked_params)}
            # (x, the layer's load-balancing loss)
            x, _ = layer.apply(params, x, pos.index, pos.segment)
        return x

    return _compiled_flops(after, weights, x, positions)


def _abstract_activations(cfg: Config, mesh: Mesh, names: tuple[str, ...]):
    """The full batch's activations `[B, T, E]` and `Positions` (`[B, T]` each; segment ids
    with `packing`), abstract, sharded as the logical `names` (batch, length, embed) say."""
    rules = cfg.logical_axis_rules
    shape = (cfg.global_batch_size, cfg.max_target_length, cfg.base_emb_dim)
    x = jax.ShapeDtypeStruct(
        shape, jnp.dtype(cfg.dtype), sharding=sharding.named_sharding(names, mesh, rules)
    )
    index = jax.ShapeDtypeStruct(
        shape[:2], jnp.int32, sharding=sharding.named_sharding(names[:2], mesh, rules)
    )
    return x, packing.Positions(index, index if cfg.packing else None)
