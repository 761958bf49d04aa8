"""Compile-time cost of the twins' train steps, from abstract inputs: no weight is allocated.

Parameters and optimizer state are `jax.ShapeDtypeStruct`s carrying the shardings the train
step is pinned to, so the 7B config lowers and compiles on simulated CPU devices; and the
collectives of the compiled pipeline loops. The pipeline's work is `parity.decoder.efficiency`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from migrate.common import optim, sharding
from migrate.config.contract import Config
from parity.analysis import hlo
from parity.analysis.compiled_cost import DIRECTIONS, CompiledCost
from parity.decoder import twins
from parity.engine import compiles


def with_shardings(shardings: Any, abstract: Any) -> Any:
    """`abstract` (a tree of ShapeDtypeStructs, in boxes or Variables) with each leaf carrying
    the sharding at its place in `shardings` (a prefix tree: one sharding per box/Variable)."""
    return jax.tree.map(
        lambda s, subtree: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), subtree
        ),
        shardings,
        abstract,
    )


def abstract_batch(cfg: Config, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """A train step's batch (`train_batch_size` rows: every accumulated batch)."""
    shape = (cfg.train_batch_size, cfg.max_target_length)
    batch_sharding = sharding.batch_sharding(cfg, mesh)
    return {
        k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
        for k in ("inputs", "targets")
    }


def abstract_train_state(cfg: Config, mesh: Mesh, framework: str) -> tuple[Any, Any]:
    """(params, optimizer state) of one twin as ShapeDtypeStructs carrying the shardings its
    train step is pinned to: boxed Linen params, or an NNX Param state."""
    if framework == "linen":
        abstract = twins.linen_abstract_variables(cfg, mesh)["params"]
        param_shardings, opt_state_shardings = twins.linen_train_shardings(cfg, mesh)
    else:
        _, abstract = twins.nnx_abstract(cfg, mesh)
        param_shardings, opt_state_shardings = twins.nnx_train_shardings(cfg, mesh)
    with nnx.use_eager_sharding(False):
        params = with_shardings(param_shardings, abstract)
        opt_state = jax.eval_shape(optim.make_optimizer(cfg).init, params)
        return params, with_shardings(opt_state_shardings, opt_state)


def lower_train_step(cfg: Config, mesh: Mesh, framework: str) -> jax.stages.Lowered:
    """The twin's jitted train step (the one the `train` check runs, its shardings pinned)
    lowered for `mesh` from ShapeDtypeStructs: no weight is allocated."""
    params, opt_state = abstract_train_state(cfg, mesh, framework)
    fns = twins.linen_train_fns if framework == "linen" else twins.nnx_train_fns
    return fns(cfg, mesh)[0].lower(params, opt_state, abstract_batch(cfg, mesh))


def compile_train_step(
    cfg: Config, mesh: Mesh, framework: str, lowered: jax.stages.Lowered | None = None
) -> CompiledCost:
    """Lower and compile the whole train step (forward, backward, optimizer) abstractly: the
    same jitted step the `train` check runs, with its pinned shardings, hence the same program
    (compiled once: `compiles.compile_once`), with the partitioner's warnings known: compiled
    by the compiler, or read from the persistent cache beside the record of its compile's
    warnings (the compile time then says it was a read). `lowered`: the
    step already lowered for real weights (not traced again)."""
    if lowered is None:
        params, opt_state = abstract_train_state(cfg, mesh, framework)
        fns = twins.linen_train_fns if framework == "linen" else twins.nnx_train_fns
        lowered = fns(cfg, mesh)[0].lower(params, opt_state, abstract_batch(cfg, mesh))
    compiled, shared = compiles.compile_once(lowered, warnings=True)
    source = compiled.describe() + (", shared with the checks that ran it" if shared else "")
    return CompiledCost.of(compiled.executable, compiled.seconds, source, compiled.remats)


def remat_records(linen_cost, nnx_cost) -> list[dict]:
    """One record per twin: the reshards its compile made the SPMD partitioner replicate
    ("involuntary full rematerialization": the whole tensor on every device), each with its
    tensor, both shardings and bytes. Any one fails."""
    records = []
    for framework, found in (("linen", linen_cost.remats), ("nnx", nnx_cost.remats)):
        records.append(
            {
                "tensor": f"partitioner: involuntary rematerialisations ({framework})",
                framework: len(found),
                "minimum": 0,
                "remats": [
                    {
                        "operation": r.operation,
                        "shape": f"{r.dtype}[{','.join(map(str, r.shape))}]",
                        "bytes": r.bytes,
                        "from": r.source,
                        "to": r.target,
                    }
                    for r in found
                ],
                "max_rel": float(len(found)),
                "passed": not found,
            }
        )
    return records


# ------------------------------------------------------------------ loop-body collectives


def loop_body_minimum(cfg: Config, per_slice: bool = False) -> dict[str, dict[str, int]]:
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
    - `pipeline_fsdp_ag_per_repeat` splits the loop into R blocks of M iterations (a loop
      over repeats around the iteration loop) and a drain: the fsdp all-gather of each
      block's weight window moves into the repeat loop's body, once per block (within a
      stage); the iteration body is the same, so the same one rotation per iteration.
    - Backward: each forward step's transpose. The rotation's is the opposite rotation, one
      permute (`schedule.permutation`); the buffer's reads and writes transpose to local
      writes and reads; weight gradients accumulate on the stage that owns the weights.

    Collectives within a stage (over data, fsdp or tensor) are the layers' own, the same a
    non-pipelined layer issues; they are reported, and bounded only where the config
    removes them (`pipeline_fsdp_ag_once`, `pipeline_fsdp_ag_per_repeat`: no all-gather over
    fsdp in the iteration loop; per repeat, at least one in the repeat loop's body).
    A config without a pipeline (S == 1) or with the loop unrolled has no loop body: empty.

    `per_slice`: a TPU program compiled per slice (`--topology` with several slices) moves the
    rotation's hops between slices by a transfer of their own (`hlo.Collective.dcn`): the
    rotation is then one permute within the slice (where stages share a slice) and one
    transfer between slices.
    """
    if not cfg.using_pipeline or not cfg.scan_pipeline_iterations:
        return {}
    permutes = 1
    if per_slice and cfg.dcn_pipeline_parallelism > 1:
        permutes = int(cfg.ici_pipeline_parallelism > 1) + 1
    rotation = {kind: 0 for kind in hlo.COLLECTIVES} | {"collective-permute": permutes}
    return {direction: dict(rotation) for direction in DIRECTIONS}


def outside_loop_counts(cost: CompiledCost, mesh_shape: dict[str, int]) -> dict[str, dict]:
    """Collectives outside the loops that cross the stage axis, per direction and kind. With
    the embedding, final norm, logits and loss split over stages, these are the reshards into
    the pipeline (a gather over stages) and out of it (from stage 0's rows to every stage),
    their transposes, the pipeline input's gradient leaving stage 0, and the tables' FSDP
    gathers and gradient reductions over stages."""
    counts = {d: dict.fromkeys(hlo.COLLECTIVES, 0) for d in DIRECTIONS}
    for direction, collective in cost.outside_loops:
        if "stage" in collective.mesh_axes(mesh_shape):
            counts[direction][collective.kind] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class LoopBodyCounts:
    """Collectives per pipeline-loop body and kind, by whether they cross the stage axis,
    with the names of the stage-crossing instructions (to name an excess)."""

    across_stages: dict[str, dict[str, int]]  # direction -> kind -> count
    within_stages: dict[str, dict[str, int]]
    fsdp_all_gathers: dict[str, int]  # direction -> all-gathers whose groups span fsdp
    across_names: dict[str, dict[str, list[str]]]  # direction -> kind -> instruction names
    loops_found: dict[str, int]  # direction -> pipeline loops found
    # `pipeline_fsdp_ag_per_repeat`: direction -> fsdp all-gathers of the repeat loop's body
    # outside its iteration loop (once per repeat)
    repeat_fsdp_all_gathers: dict[str, int] = dataclasses.field(default_factory=dict)


def _gathers_over_fsdp(collectives, mesh_shape: dict[str, int]) -> int:
    return sum(c.kind == "all-gather" and "fsdp" in c.mesh_axes(mesh_shape) for c in collectives)


def batch_loops(cost: CompiledCost, cfg: Config) -> tuple[hlo.Loop, ...]:
    """The outermost loops of one pass over a batch: the program's own, or, where a train step
    accumulates gradients over k batches, the loops inside the accumulation loop (k trips)."""
    steps = cfg.gradient_accumulation_steps
    if steps == 1:
        return cost.loops
    return tuple(inner for loop in cost.loops if loop.trip_count == steps for inner in loop.inner)


def pipeline_loops(cost: CompiledCost, cfg: Config) -> list[tuple[hlo.Loop, hlo.Loop | None]]:
    """(iteration loop, the repeat loop around it or None): the outermost loops of a pass
    over a batch (`batch_loops`) that run `cfg.num_iterations` times, or with
    `pipeline_fsdp_ag_per_repeat` the loops of M iterations inside those of R blocks (the
    drain, d*(S-1) iterations on the last window, is not counted: its body is the same
    iteration)."""
    loops = batch_loops(cost, cfg)
    if not cfg.pipeline_fsdp_ag_per_repeat:
        return [(loop, None) for loop in loops if loop.trip_count == cfg.num_iterations]
    return [
        (inner, loop)
        for loop in loops
        if loop.trip_count == cfg.num_repeats
        for inner in loop.inner
        if inner.trip_count == cfg.num_microbatches
    ]


def loop_body_counts(cost: CompiledCost, cfg: Config, mesh_shape: dict[str, int]) -> LoopBodyCounts:
    """Count the collectives of the pipeline's iteration loops (`pipeline_loops`), forward and
    backward, against the mesh's axes; and those of the repeat loops around them."""
    across = {d: dict.fromkeys(hlo.COLLECTIVES, 0) for d in DIRECTIONS}
    within = {d: dict.fromkeys(hlo.COLLECTIVES, 0) for d in DIRECTIONS}
    fsdp_gathers = dict.fromkeys(DIRECTIONS, 0)
    repeat_gathers = dict.fromkeys(DIRECTIONS, 0)
    names = {d: {kind: [] for kind in hlo.COLLECTIVES} for d in DIRECTIONS}
    found = dict.fromkeys(DIRECTIONS, 0)
    for loop, repeat_loop in pipeline_loops(cost, cfg):
        direction = (repeat_loop or loop).direction
        found[direction] += 1
        if repeat_loop is not None:
            own = repeat_loop.own_collectives()
            repeat_gathers[direction] += _gathers_over_fsdp(own, mesh_shape)
        for collective in loop.collectives:
            spanned = collective.mesh_axes(mesh_shape)
            if "stage" in spanned:
                across[direction][collective.kind] += 1
                names[direction][collective.kind].append(collective.name)
            else:
                within[direction][collective.kind] += 1
        fsdp_gathers[direction] += _gathers_over_fsdp(loop.collectives, mesh_shape)
    return LoopBodyCounts(across, within, fsdp_gathers, names, found, repeat_gathers)
