"""NNX pipeline (the port): stages vmapped over the `stage` mesh axis, circular repeats.

Twin of `migrate/linen/pipeline.py`. The behaviour is docs/pipeline.md's. Weights are created once
by `nnx.vmap` under `nnx.split_rngs`, with `nnx.transform_metadata` adding the stacked axis names
(stage axis `layers`, repeat axis `circular_repeats`); the iteration loop is functional: split the
stage module once, then `jax.vmap(spmd_axis_name='stage')` over `nnx.merge(graphdef, w)`.

`jax.vmap` over merged state rather than `nnx.vmap` in the loop: see docs/performance.md for the
measured compile time and temp memory of both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding

from migrate.common import axes, dropout, packing, remat, schedule, sharding
from migrate.config.contract import Config
from migrate.nnx.layers import DecoderLayer, constrain


def stack_modules(
    create: Callable[[nnx.Rngs], nnx.Module], count: int, axis_name: str, rngs: nnx.Rngs
) -> nnx.Module:
    """`count` modules from `create`, weights stacked on a new leading axis `axis_name`.

    The axis name is added to every Variable's `out_sharding` by `nnx.transform_metadata`,
    which (unlike the older `transform_metadata=` keyword) works with graph updates off too.
    """

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0)
    @nnx.transform_metadata(in_axes=0, out_axes=0, partition=axis_name)
    def create_stacked(rngs: nnx.Rngs) -> nnx.Module:
        return create(rngs)

    return create_stacked(rngs)


def apply_layer(
    layer: nnx.Module, x: jax.Array, positions: packing.Positions
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer's `(x, aux)`: what `remat_layer` rematerialises. `positions` carry
    this layer's dropout keys (`dropout.at_layer`)."""
    return layer(x, positions.index, positions.segment, positions.dropout)


def remat_layer(policy: Callable | None) -> Callable:
    """`apply_layer` under `jax.checkpoint` with `policy` (None: `apply_layer` itself)."""
    if policy is None:
        return apply_layer
    return nnx.remat(apply_layer, policy=policy, prevent_cse=False)


def scan_layers(
    layer: nnx.Module,
    x: jax.Array,
    positions: packing.Positions,
    policy: Callable | None = None,
    trace: bool = False,
    first_layer: jax.Array | int = 0,
):
    """Apply the stacked `layer` once per slice of its leading weight axis, in order, each
    application rematerialised with `policy` (`remat_layer`): `(x, aux)`, aux the layers'
    load-balancing losses summed (carried through the scan); with `trace`, also every
    application's output, stacked (the drill-down compares them). Application i is global
    layer `first_layer + i`, whose index its dropout keys fold in."""
    call = remat_layer(policy)
    graphdef, state = nnx.split(layer)

    def body(carry, xs):
        layer_state, layer_id = xs
        pos = dropout.at_layer(positions, layer_id)
        y, aux = call(nnx.merge(graphdef, layer_state), carry[0], pos)
        return (y, carry[1] + aux), (y if trace else None)

    # Layer ids scanned only where they key dropout: without it the program is unchanged.
    length = jax.tree.leaves(state)[0].shape[0]
    layer_ids = None if positions.dropout is None else first_layer + jnp.arange(length)
    (x, aux), outputs = jax.lax.scan(body, (x, jnp.zeros(())), (state, layer_ids))
    return (x, aux, outputs) if trace else (x, aux)


# Activations move one stage right, the last stage's output wrapping around to stage 0: one
# collective-permute forward and, its transpose being the opposite rotation, one backward.
rotate_stages = schedule.permutation(
    lambda x: jnp.roll(x, 1, axis=0), lambda x: jnp.roll(x, -1, axis=0)
)


class StageLayers(nnx.Module):
    """The L decoder layers one stage runs per visit (scanned, or L separate modules)."""

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        if cfg.scan_layers_per_stage:
            self.layers = stack_modules(
                lambda r: DecoderLayer(cfg, self.mesh, rngs=r),
                cfg.layers_per_stage,
                axes.LAYERS_PER_STAGE,
                rngs,
            )
        else:
            for slot in range(cfg.layers_per_stage):
                setattr(self, f"layers_{slot}", DecoderLayer(cfg, self.mesh, rngs=rngs))

    def __call__(
        self, x: jax.Array, positions: packing.Positions, first_layer: jax.Array | int = 0
    ) -> tuple[jax.Array, jax.Array]:
        """`(x, aux)`: aux the L layers' load-balancing losses summed. The stage's layers are
        global layers `first_layer ..` (`(r*S + s)*L`: their dropout keys fold it in)."""
        cfg = self.config
        if cfg.scan_layers_per_stage:
            return scan_layers(self.layers, x, positions, first_layer=first_layer)
        aux = jnp.zeros(())
        for slot in range(cfg.layers_per_stage):
            layer = getattr(self, f"layers_{slot}")
            x, layer_aux = apply_layer(layer, x, dropout.at_layer(positions, first_layer + slot))
            aux = aux + layer_aux
        return x, aux


def stacked_stages(cfg: Config, mesh: Mesh, rngs: nnx.Rngs) -> StageLayers:
    """`StageLayers` with weights `[R, S, ...]` (R omitted when R == 1)."""
    create = lambda r: stack_modules(
        lambda r2: StageLayers(cfg, mesh, rngs=r2), cfg.num_stages, axes.STAGE, r
    )
    if cfg.num_repeats > 1:
        return stack_modules(create, cfg.num_repeats, axes.CIRCULAR_REPEATS, rngs)
    return create(rngs)


class Pipeline(nnx.Module):
    """The decoder layers as an S-stage circular pipeline over M microbatches."""

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        self.layers = stacked_stages(cfg, self.mesh, rngs)

    def __call__(
        self,
        inputs: jax.Array,
        positions: packing.Positions,
        bubble_fill: float | jax.Array = 0.0,
        trace: bool = False,
    ):
        """`[B, T, E] -> ([B, T, E], aux)`; with `trace`, also every iteration's stage outputs
        `[iterations, S, B/M, T, E]` (the drill-down compares them). `aux`: the layers'
        load-balancing losses, summed over layers and averaged over the M microbatches.

        `bubble_fill` fills the loop buffers before any stage has written them (a test hook:
        NaN there must reach no output and no gradient)."""
        cfg = self.config
        stage, weights = nnx.split(self.layers)
        if cfg.pipeline_fsdp_ag_once:
            weights = self.all_gather_over_fsdp(weights)
        return self.run(stage, weights, inputs, positions, bubble_fill, trace)

    def all_gather_over_fsdp(self, weights: nnx.State) -> nnx.State:
        """Constrain the stage weights to their sharding without `fsdp`, once, before the loop."""
        cfg = self.config

        def gather(variable: nnx.Variable) -> nnx.Variable:
            names = variable.get_metadata()["out_sharding"]
            spec = sharding.logical_to_spec(tuple(names), cfg.logical_axis_rules)
            spec = sharding.without_mesh_axis(spec, "fsdp")
            return variable.replace(
                jax.lax.with_sharding_constraint(variable[...], NamedSharding(self.mesh, spec))
            )

        return jax.tree.map(gather, weights, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def all_gather_window(self, weights: nnx.State, start, length: int) -> nnx.State:
        """Repeats `start .. start + length - 1` of the stage weights `[R, S, ...]`, gathered
        over `fsdp` by one constraint (still split over stages and tensor)."""
        cfg = self.config

        def gather(variable: nnx.Variable) -> nnx.Variable:
            names = variable.get_metadata()["out_sharding"]
            # Sliced while still split over fsdp, then gathered: left to choose, XLA gathers
            # all R repeats before the loop and slices them, as ag-once does.
            window = jax.lax.dynamic_slice_in_dim(variable[...], start, length, axis=0)
            window = constrain(window, tuple(names), self.mesh, cfg.logical_axis_rules)
            spec = sharding.gathered_over_fsdp(tuple(names), self.mesh, cfg)
            return variable.replace(jax.lax.with_sharding_constraint(window, spec))

        return jax.tree.map(gather, weights, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def loop_per_repeat(self, iteration, weights, loop_state):
        """The iterations as R blocks of M and the drain (block R), each block running on the
        two-repeat window of the stage weights (`schedule.window_start`) that one all-gather
        over `fsdp` fetches at its start (`pipeline_fsdp_ag_per_repeat`).

        The window is computed inside the block rather than carried from the last one: a carry
        is kept for the backward pass once per block (R windows, more than gathering once); under
        the iteration's remat policy the backward pass gathers the window again instead.
        """
        cfg = self.config
        num_micro, scanned = cfg.num_microbatches, cfg.scan_pipeline_iterations

        def block(count, state, b):
            start = schedule.window_start(cfg, b)
            window = self.all_gather_window(weights, start, 2)
            step = functools.partial(iteration, window, start)
            return schedule.iterate(step, state, b * num_micro, count, scanned)

        if cfg.set_remat_policy_on_pipeline_iterations:
            policy = remat.iteration_policy(cfg)
            block = jax.checkpoint(block, policy=policy, prevent_cse=not scanned, static_argnums=0)
        repeats = cfg.num_repeats
        if scanned:
            loop_state, history = jax.lax.scan(
                functools.partial(block, num_micro), loop_state, jnp.arange(repeats)
            )
            history = None if history is None else history.reshape(-1, *history.shape[2:])
        else:
            histories = []
            for b in range(repeats):
                loop_state, out = block(num_micro, loop_state, b)
                histories.append(out)
            history = None if histories[0] is None else jnp.concatenate(histories)
        drain = cfg.num_iterations - num_micro * repeats
        loop_state, drained = block(drain, loop_state, repeats)
        if history is not None and drained is not None:
            history = jnp.concatenate([history, drained])
        return loop_state, history

    def run_stages(self, stage, weights, stage_inputs, stage_positions, repeat_ids, first_layers):
        """Every stage applies its layers (for its current repeat: `repeat_ids` index the
        leading axis of `weights`, all R repeats or a window of them; `first_layers` `[S]` the
        global index of each stage's first layer) to its input, in parallel:
        (outputs `[S, ...]`, load-balancing losses `[S]`);
        on fsdp x tensor meshes with that repeat's weights gathered over `fsdp` for the visit
        (`sharding.stage_weights_need_gathering`). `stage` is the module the weights are applied
        with: an unbound `StageLayers` (Linen), the stacked stages' `GraphDef` (NNX)."""
        cfg = self.config
        stacked = 2 if cfg.num_repeats > 1 else 1  # [R,] S leading axes, gone inside one_stage

        def gathered(variable: nnx.Variable) -> nnx.Variable:
            names = tuple(variable.get_metadata()["out_sharding"])[stacked:]
            spec = sharding.gathered_over_fsdp(names, self.mesh, cfg)
            return variable.replace(jax.lax.with_sharding_constraint(variable[...], spec))

        def one_stage(stage_weights, x, pos, repeat, first_layer):
            if cfg.num_repeats > 1:
                stage_weights = jax.tree.map(lambda w: w[repeat], stage_weights)
            if sharding.stage_weights_need_gathering(cfg):
                stage_weights = jax.tree.map(
                    gathered, stage_weights, is_leaf=lambda x: isinstance(x, nnx.Variable)
                )
            return nnx.merge(stage, stage_weights)(x, pos, first_layer)

        weight_axis = 1 if cfg.num_repeats > 1 else 0
        return jax.vmap(one_stage, in_axes=(weight_axis, 0, 0, 0, 0), spmd_axis_name="stage")(
            weights, stage_inputs, stage_positions, repeat_ids, first_layers
        )

    def run(
        self,
        stage,
        weights,
        inputs: jax.Array,
        positions: packing.Positions,
        bubble_fill: float | jax.Array,
        trace: bool,
    ):
        """The iteration loop: `M*R + d*(S-1)` iterations of all stages, then reassembly."""
        cfg, mesh, rules = self.config, self.mesh, self.config.logical_axis_rules
        num_micro = cfg.num_microbatches
        micro_inputs = constrain(
            schedule.split_microbatches(inputs, num_micro),
            axes.MICROBATCH_BATCH_LENGTH_EMBED,
            mesh,
            rules,
        )
        micro_positions = jax.tree.map(
            lambda p: schedule.split_microbatches(p, num_micro), positions
        )
        if positions.dropout is not None:
            # Replicated ([B] keys: a few bytes a row), so that every stage picks its
            # microbatch's keys locally: left to XLA, the pick is a gather across stages.
            micro_positions = micro_positions._replace(
                dropout=constrain(micro_positions.dropout, (None, None), mesh, rules)
            )
        stage_shape = (cfg.num_stages, *micro_inputs.shape[1:])
        fill = jnp.asarray(bubble_fill, inputs.dtype)
        loop_state = {
            "shift": jnp.full(stage_shape, fill),  # each stage's input for the next iteration
            "previous": jnp.full(stage_shape, fill),  # last iteration's rotated outputs (d=2)
            # Inputs, circular storage and finished outputs: stage 0's row, sharded over stages.
            "store": constrain(
                schedule.first_stage_store(micro_inputs, cfg.num_stages, fill),
                axes.STAGE_MICROBATCH_BATCH_LENGTH_EMBED,
                mesh,
                rules,
            ),
            # Each stage's load-balancing losses, summed over the slots it worked (stage-local).
            "aux": constrain(jnp.zeros(cfg.num_stages), axes.PER_STAGE, mesh, rules),
        }

        def iteration(window, first_repeat, state, t):
            micro_ids, repeat_ids, valid = schedule.stage_work(cfg, t)
            stage_inputs = schedule.first_stage_input(state["store"], state["shift"], num_micro, t)
            # Idle slots compute on zeros: NaN x 0 in the backward pass would poison gradients.
            stage_inputs = jnp.where(valid[:, None, None, None], stage_inputs, 0)
            stage_inputs = checkpoint_name(stage_inputs, axes.ITERATION_INPUT)
            stage_inputs = constrain(stage_inputs, axes.STAGE_BATCH_LENGTH_EMBED, mesh, rules)
            stage_outputs, stage_aux = self.run_stages(
                stage,
                window,
                stage_inputs,
                jax.tree.map(lambda p: p[micro_ids], micro_positions),
                repeat_ids - first_repeat,
                schedule.first_layers(cfg, repeat_ids),
            )
            # The schedule's one collective per iteration: outputs move one stage right. The
            # rotation wraps the last stage's output around to stage 0, which stores it locally.
            rotated = constrain(
                rotate_stages(stage_outputs), axes.STAGE_BATCH_LENGTH_EMBED, mesh, rules
            )
            new_state = {
                "shift": rotated if cfg.forwarding_delay == 1 else state["previous"],
                "previous": rotated,
                "store": schedule.store_finished(cfg, state["store"], rotated, t),
                # Bubbles count nothing: a select, so that NaN there cannot leak (NaN x 0 is NaN).
                # Pinned to the stages: left to XLA, it gathers the [S] sums over stages.
                "aux": constrain(
                    state["aux"] + jnp.where(valid, stage_aux, 0.0), axes.PER_STAGE, mesh, rules
                ),
            }
            return new_state, (stage_outputs if trace else None)

        if cfg.set_remat_policy_on_pipeline_iterations:
            policy = remat.iteration_policy(cfg)
            iteration = jax.checkpoint(
                iteration, policy=policy, prevent_cse=not cfg.scan_pipeline_iterations
            )
        if cfg.pipeline_fsdp_ag_per_repeat:
            loop_state, history = self.loop_per_repeat(iteration, weights, loop_state)
        else:
            loop_state, history = schedule.iterate(
                functools.partial(iteration, weights, 0),
                loop_state,
                0,
                cfg.num_iterations,
                cfg.scan_pipeline_iterations,
            )
        # Stage 0's row holds the finished outputs: broadcast to every stage once, after the loop
        # (pinned: left to XLA, the slice of the stage-split store reshards to the logits' batch
        # split by replicating the whole store, "No involuntary rematerialisation").
        finished = constrain(
            loop_state["store"][0], axes.MICROBATCH_BATCH_LENGTH_EMBED, mesh, rules
        )
        outputs = schedule.merge_microbatches(finished)
        aux = jnp.sum(loop_state["aux"]) / num_micro
        return (outputs, aux, history) if trace else (outputs, aux)
