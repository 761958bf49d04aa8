"""Linen pipeline (the original): stages vmapped over the `stage` mesh axis, circular repeats.

Twin of `migrate/nnx/pipeline.py`. The behaviour is docs/pipeline.md's. Weights are created once by
`nn.vmap` (stage axis `layers`, repeat axis `circular_repeats`); the iteration loop is functional:
each iteration selects every stage's weights for its current repeat and applies `StageLayers` to
the stage inputs under `jax.vmap(spmd_axis_name='stage')`, as MaxText's Linen pipeline does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding

from migrate.common import axes, dropout, packing, remat, schedule, sharding
from migrate.config.contract import Config
from migrate.linen.layers import DecoderLayer, constrain


def apply_layer(
    layer: nn.Module, x: jax.Array, positions: packing.Positions
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer's `(x, aux)`: what `remat_layer` rematerialises. `positions` carry
    this layer's dropout keys (`dropout.at_layer`)."""
    return layer(x, positions.index, positions.segment, positions.dropout)


def remat_layer(policy: Callable | None) -> Callable:
    """`apply_layer` under `jax.checkpoint` with `policy` (None: `apply_layer` itself)."""
    if policy is None:
        return apply_layer
    return nn.remat(apply_layer, policy=policy, prevent_cse=False)


def scan_layers(
    layer: nn.Module,
    x: jax.Array,
    positions: packing.Positions,
    length: int,
    axis_name: str,
    policy: Callable | None = None,
    trace: bool = False,
    first_layer: jax.Array | int = 0,
):
    """Apply `layer` `length` times, its weights stacked on a new leading axis `axis_name`,
    each application rematerialised with `policy` (`remat_layer`): `(x, aux)`, aux the layers'
    load-balancing losses summed (carried through the scan); with `trace`, also every
    application's output, stacked (the drill-down compares them). Application i is global
    layer `first_layer + i`, whose index its dropout keys fold in."""
    call = remat_layer(policy)

    def body(module: nn.Module, carry, pos: packing.Positions, layer_id):
        y, aux = call(module, carry[0], dropout.at_layer(pos, layer_id))
        return (y, carry[1] + aux), (y if trace else None)

    # Layer ids scanned only where they key dropout: without it the program is unchanged.
    layer_ids = None if positions.dropout is None else first_layer + jnp.arange(length)
    scanned = nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, 0),
        length=length,
        metadata_params={nn.PARTITION_NAME: axis_name},
    )
    (x, aux), outputs = scanned(layer, (x, jnp.zeros(())), positions, layer_ids)
    return (x, aux, outputs) if trace else (x, aux)


# Activations move one stage right, the last stage's output wrapping around to stage 0: one
# collective-permute forward and, its transpose being the opposite rotation, one backward.
rotate_stages = schedule.permutation(
    lambda x: jnp.roll(x, 1, axis=0), lambda x: jnp.roll(x, -1, axis=0)
)


class StageLayers(nn.Module):
    """The L decoder layers one stage runs per visit (scanned, or L separate modules)."""

    config: Config
    mesh: Mesh

    def setup(self) -> None:
        cfg = self.config
        if cfg.scan_layers_per_stage:
            self.layers = DecoderLayer(cfg, self.mesh)
        else:
            for slot in range(cfg.layers_per_stage):
                setattr(self, f"layers_{slot}", DecoderLayer(cfg, self.mesh))

    def __call__(
        self, x: jax.Array, positions: packing.Positions, first_layer: jax.Array | int = 0
    ) -> tuple[jax.Array, jax.Array]:
        """`(x, aux)`: aux the L layers' load-balancing losses summed. The stage's layers are
        global layers `first_layer ..` (`(r*S + s)*L`: their dropout keys fold it in)."""
        cfg = self.config
        if cfg.scan_layers_per_stage:
            length = cfg.layers_per_stage
            return scan_layers(
                self.layers, x, positions, length, axes.LAYERS_PER_STAGE, first_layer=first_layer
            )
        aux = jnp.zeros(())
        for slot in range(cfg.layers_per_stage):
            layer = getattr(self, f"layers_{slot}")
            x, layer_aux = apply_layer(layer, x, dropout.at_layer(positions, first_layer + slot))
            aux = aux + layer_aux
        return x, aux


def stacked_stages(cfg: Config) -> type[nn.Module]:
    """`StageLayers` vmapped to weights `[R, S, ...]` (R omitted when R == 1)."""
    stacked = nn.vmap(
        StageLayers,
        in_axes=(None, None),
        out_axes=0,
        axis_size=cfg.num_stages,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        spmd_axis_name="stage",
        metadata_params={nn.PARTITION_NAME: axes.STAGE},
    )
    if cfg.num_repeats > 1:
        stacked = nn.vmap(
            stacked,
            in_axes=(None, None),
            out_axes=0,
            axis_size=cfg.num_repeats,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            metadata_params={nn.PARTITION_NAME: axes.CIRCULAR_REPEATS},
        )
    return stacked


class Pipeline(nn.Module):
    """The decoder layers as an S-stage circular pipeline over M microbatches."""

    config: Config
    mesh: Mesh

    def setup(self) -> None:
        cfg = self.config
        self.layers = stacked_stages(cfg)(cfg, self.mesh)

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
        if self.is_initializing():
            # Creates the [R, S, ...] weights; the init output only needs the right shape.
            first = jax.tree.map(lambda p: p[: cfg.microbatch_size], positions)
            self.layers(inputs[: cfg.microbatch_size], first)
            return inputs, jnp.zeros(())
        stage = StageLayers(cfg, self.mesh, parent=None)
        boxed_weights = self.variables["params"]["layers"]
        weights = nn.meta.unbox(boxed_weights)
        if cfg.pipeline_fsdp_ag_once:
            weights = self.all_gather_over_fsdp(boxed_weights, weights)
        return self.run(stage, weights, inputs, positions, bubble_fill, trace)

    def all_gather_over_fsdp(self, boxed_weights, weights):
        """Constrain the stage weights to their sharding without `fsdp`, once, before the loop."""
        cfg = self.config
        logical = nn.get_partition_spec(boxed_weights)

        def gather(names, w):
            if len(names) != w.ndim:
                raise ValueError(
                    "pipeline_fsdp_ag_once needs the stage weights' logical names: pass the "
                    "LogicallyPartitioned variables from init, not unboxed arrays"
                )
            spec = sharding.logical_to_spec(tuple(names), cfg.logical_axis_rules)
            spec = sharding.without_mesh_axis(spec, "fsdp")
            return jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, spec))

        return jax.tree.map(
            gather, logical, weights, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        )

    def all_gather_window(self, weights, start, length: int):
        """Repeats `start .. start + length - 1` of the stage weights `[R, S, ...]`, gathered
        over `fsdp` by one constraint (still split over stages and tensor)."""
        cfg = self.config

        def gather(names, w):
            # Sliced while still split over fsdp, then gathered: left to choose, XLA gathers
            # all R repeats before the loop and slices them, as ag-once does.
            window = jax.lax.dynamic_slice_in_dim(w, start, length, axis=0)
            window = constrain(window, tuple(names), self.mesh, cfg.logical_axis_rules)
            spec = sharding.gathered_over_fsdp(tuple(names), self.mesh, cfg)
            return jax.lax.with_sharding_constraint(window, spec)

        return jax.tree.map(
            gather,
            nn.get_partition_spec(self.variables["params"]["layers"]),
            weights,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )

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
        gathered = jax.tree.map(
            lambda names: sharding.gathered_over_fsdp(names[stacked:], self.mesh, cfg),
            nn.get_partition_spec(self.variables["params"]["layers"]),
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )

        def one_stage(stage_weights, x, pos, repeat, first_layer):
            if cfg.num_repeats > 1:
                stage_weights = jax.tree.map(lambda w: w[repeat], stage_weights)
            if sharding.stage_weights_need_gathering(cfg):
                stage_weights = jax.tree.map(
                    jax.lax.with_sharding_constraint, stage_weights, gathered
                )
            return stage.apply({"params": stage_weights}, x, pos, first_layer)

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
