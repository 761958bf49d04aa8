"""Compile-time cost of the twins' train steps, from abstract inputs: no weight is allocated.

Parameters and optimizer state are `jax.ShapeDtypeStruct`s carrying their shardings, so the 7B
config lowers and compiles on simulated CPU devices. XLA's cost analysis counts a while-loop
body once, whatever its trip count; the pipeline-efficiency measurement therefore compiles
unrolled forms (Python loops) of both the pipeline and the non-pipelined layer stack.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from migrate import axes, convert, optim, sharding
from migrate.config import Config
from migrate.linen import decoder as linen_decoder
from migrate.linen import layers as linen_layers
from migrate.linen import pipeline as linen_pipeline
from parity import hlo, runs


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """Per-device memory (bytes), cost and collectives of one compiled program."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    flops: float
    bytes_accessed: float
    collectives: dict[str, int]
    compile_seconds: float
    program: str  # hlo.program_fingerprint of the optimised module
    loops: tuple[hlo.Loop, ...] = ()  # outermost while loops, with their bodies' collectives

    @classmethod
    def of(cls, compiled, compile_seconds: float) -> CompiledCost:
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        text = compiled.as_text()
        return cls(
            argument_bytes=int(memory.argument_size_in_bytes),
            output_bytes=int(memory.output_size_in_bytes),
            temp_bytes=int(memory.temp_size_in_bytes),
            generated_code_bytes=int(memory.generated_code_size_in_bytes),
            flops=float(cost.get("flops", 0.0)),
            bytes_accessed=float(cost.get("bytes accessed", 0.0)),
            collectives=hlo.collective_counts(text),
            compile_seconds=compile_seconds,
            program=hlo.program_fingerprint(text),
            loops=tuple(hlo.loops(text)),
        )


def _with_sharding(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _abstract_opt_state(tx, params: Any, mesh: Mesh) -> Any:
    """The optimizer state of `params` as ShapeDtypeStructs: every moment sharded like its
    parameter, everything else (step counts) replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda leaf, param: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param.sharding),
        jax.eval_shape(tx.init, params),
        params,
        transform_non_params=lambda leaf: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=replicated
        ),
    )


def abstract_batch(cfg: Config, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    batch_sharding = sharding.named_sharding(
        axes.BATCH_LENGTH_EMBED[:2], mesh, cfg.logical_axis_rules
    )
    shape = (cfg.global_batch_size, cfg.max_target_length)
    return {
        k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
        for k in ("inputs", "targets")
    }


def abstract_linen_params(cfg: Config, mesh: Mesh) -> Any:
    """Boxed Linen params whose values are sharded ShapeDtypeStructs."""
    abstract = runs.linen_abstract_variables(cfg, mesh)
    shardings = linen_decoder.param_shardings(abstract, mesh, cfg)
    arrays, names = convert.strip_boxes(abstract)
    arrays = _with_sharding(arrays, nn.meta.unbox(shardings))
    return convert.restore_boxes(arrays, names)["params"]


def abstract_nnx_params(cfg: Config, mesh: Mesh) -> nnx.State:
    """NNX Param state whose values are sharded ShapeDtypeStructs."""
    _, abstract = runs.nnx_abstract(cfg, mesh)

    def shard(variable: nnx.Variable) -> nnx.Variable:
        value = variable.get_value()
        names = convert.nnx_names(variable) or ()
        spec = sharding.named_sharding(names, mesh, cfg.logical_axis_rules)
        return variable.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=spec))

    with nnx.use_eager_sharding(False):
        return jax.tree.map(shard, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def compile_train_step(cfg: Config, mesh: Mesh, framework: str) -> CompiledCost:
    """Lower and compile the whole train step (forward, backward, optimizer) abstractly."""
    tx = optim.make_optimizer(cfg)
    if framework == "linen":
        params = abstract_linen_params(cfg, mesh)
        step, _ = runs.linen_train_fns(cfg, mesh)
    else:
        params = abstract_nnx_params(cfg, mesh)
        step, _ = runs.nnx_train_fns(cfg, mesh)
    opt_state = _abstract_opt_state(tx, params, mesh)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, abstract_batch(cfg, mesh)).compile()
    return CompiledCost.of(compiled, time.perf_counter() - start)


# ------------------------------------------------------------------ pipeline efficiency


@dataclasses.dataclass(frozen=True)
class PipelineEfficiency:
    """Compiled FLOPs of the layer stack: pipeline against the plain decoder layers."""

    pipeline_flops: float  # all devices, unrolled iterations
    reference_flops: float  # useful work: each layer once on the full batch
    measured_overhead: float
    theoretical_overhead: float

    @property
    def relative_error(self) -> float:
        return abs(self.measured_overhead / self.theoretical_overhead - 1.0)


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def pipeline_efficiency(cfg: Config, mesh: Mesh) -> PipelineEfficiency:
    """Measured `pipeline work / useful work` against `(M*R + d*(S-1)) / (M*R)`.

    Both sides are compiled forward-only and unrolled (XLA counts a loop body once): the
    pipeline with a Python loop over iterations and separate in-stage layers, the reference as
    a Python loop over the N decoder layers. Per-device FLOPs are scaled to all devices; the
    reference's replication over the stage axis is not counted as work.
    """
    cfg = cfg.replace(
        scan_pipeline_iterations=False,
        scan_layers_per_stage=False,
        set_remat_policy_on_pipeline_iterations=False,
    )
    variables = runs.linen_abstract_variables(cfg, mesh)
    pipe_params = variables["params"]["pipeline"]
    x = jax.ShapeDtypeStruct(
        (cfg.global_batch_size, cfg.max_target_length, cfg.base_emb_dim), jnp.dtype(cfg.dtype)
    )
    positions = jax.ShapeDtypeStruct(x.shape[:2], jnp.int32)
    pipe = linen_pipeline.Pipeline(cfg, mesh)
    pipeline_flops = _flops(
        lambda p, x, pos: pipe.apply({"params": p}, x, pos), pipe_params, x, positions
    )

    layer = linen_layers.DecoderLayer(cfg, mesh)
    ref_layers = jax.eval_shape(lambda v: convert.linen_pipeline_to_reference(v, cfg), variables)[
        "params"
    ]["layers"]
    per_layer = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), nn.meta.unbox(ref_layers)
    )

    def stack(stacked_params, x, pos):
        for i in range(cfg.base_num_decoder_layers):
            x = layer.apply({"params": jax.tree.map(lambda w, i=i: w[i], stacked_params)}, x, pos)
        return x

    stacked = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((cfg.base_num_decoder_layers, *a.shape), a.dtype), per_layer
    )
    reference_per_device = _flops(stack, stacked, x, positions)
    # The reference splits the batch over data x fsdp (and heads over tensor) but repeats
    # every layer on each of the S stage-axis replicas: only one replica's work is useful.
    pipeline_total = pipeline_flops * cfg.num_devices
    reference_total = reference_per_device * cfg.num_devices / cfg.num_stages
    return PipelineEfficiency(
        pipeline_total,
        reference_total,
        pipeline_total / reference_total,
        cfg.pipeline_flop_overhead,
    )


# ------------------------------------------------------------------ loop-body collectives

DIRECTIONS = ("forward", "backward")


def loop_body_minimum(cfg: Config) -> dict[str, dict[str, int]]:
    """Collectives across the `stage` mesh axis that one pipeline iteration needs, per loop
    body (forward, backward) and kind: what the compile check allows, and why.

    Per iteration, the only data that must cross stages is every stage's output moving to its
    right-hand neighbour: one collective-permute over the stage ring. Everything else is
    placed so that it stays on the stage that uses it:
    - Bookkeeping (microbatch, repeat, bubble mask of each stage; which microbatch the last
      stage finishes) is computed on every device from the iteration counter and the stage
      index; read out of a stage-sharded array it would cost a permute and an all-reduce.
    - Inputs, circular storage (R > 1) and finished outputs live in one buffer sharded over
      stages, stage 0's row holding them. The rotation wraps the last stage's output around
      to stage 0, which stores it there: no transfer beyond the rotation, whether the output
      is needed again one iteration later (M == S*d) or after waiting (M > S*d, circular
      storage). The finished outputs leave stage 0 once, after the loop.
    - Forwarding delay d = 2 delays the rotated outputs by one iteration on the receiving
      stage (a local carry): still one rotation.
    - Scanned layers per stage and `pipeline_fsdp_ag_once` change what happens within a
      stage (a nested loop; the fsdp all-gather hoisted before the loop), not across stages.
    - Backward: each forward step's transpose. The rotation's is the opposite rotation, one
      permute (`schedule.permutation`); the buffer's reads and writes transpose to local
      writes and reads; weight gradients accumulate on the stage that owns the weights.

    Collectives within a stage (over data, fsdp or tensor) are the layers' own, the same a
    non-pipelined layer issues; they are reported, and bounded only where the config
    removes them (`pipeline_fsdp_ag_once`: no all-gather over fsdp in the loop).
    A config without a pipeline (S == 1) or with the loop unrolled has no loop body: empty.
    """
    if not cfg.using_pipeline or not cfg.scan_pipeline_iterations:
        return {}
    rotation = {kind: 0 for kind in hlo.COLLECTIVES} | {"collective-permute": 1}
    return {direction: dict(rotation) for direction in DIRECTIONS}


@dataclasses.dataclass(frozen=True)
class LoopBodyCounts:
    """Collectives per pipeline-loop body and kind, by whether they cross the stage axis,
    with the names of the stage-crossing instructions (to name an excess)."""

    across_stages: dict[str, dict[str, int]]  # direction -> kind -> count
    within_stages: dict[str, dict[str, int]]
    fsdp_all_gathers: dict[str, int]  # direction -> all-gathers whose groups span fsdp
    across_names: dict[str, dict[str, list[str]]]  # direction -> kind -> instruction names
    loops_found: dict[str, int]  # direction -> pipeline loops found


def loop_body_counts(cost: CompiledCost, cfg: Config, mesh_shape: dict[str, int]) -> LoopBodyCounts:
    """Count the collectives of the pipeline's iteration loops (the outermost loops that run
    `cfg.num_iterations` times), forward and backward, against the mesh's axes."""
    across = {d: dict.fromkeys(hlo.COLLECTIVES, 0) for d in DIRECTIONS}
    within = {d: dict.fromkeys(hlo.COLLECTIVES, 0) for d in DIRECTIONS}
    fsdp_gathers = dict.fromkeys(DIRECTIONS, 0)
    names = {d: {kind: [] for kind in hlo.COLLECTIVES} for d in DIRECTIONS}
    found = dict.fromkeys(DIRECTIONS, 0)
    for loop in cost.loops:
        if loop.trip_count != cfg.num_iterations:
            continue
        found[loop.direction] += 1
        for collective in loop.collectives:
            spanned = collective.mesh_axes(mesh_shape)
            if "stage" in spanned:
                across[loop.direction][collective.kind] += 1
                names[loop.direction][collective.kind].append(collective.name)
            else:
                within[loop.direction][collective.kind] += 1
            if collective.kind == "all-gather" and "fsdp" in spanned:
                fsdp_gathers[loop.direction] += 1
    return LoopBodyCounts(across, within, fsdp_gathers, names, found)
