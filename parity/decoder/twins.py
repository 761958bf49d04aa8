"""The decoder twins' compiled functions and initial weights, cached per config and mesh.

Framework-specific on purpose: this is what `parity.decoder.sides` adapts to the `Side`
protocol. Every run returns host (numpy) values in one common form, Linen's: loss, logits, and
gradients as an unboxed `{'params': ...}` tree, so that any two runs compare leaf by leaf.
Configs that differ only in keys that do not change the computation share one compiled
function (`compute_config`); configs that differ only in schedule keys share one
initialisation (`schedule_free`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from migrate.checkpoints import convert
from migrate.common import dropout, optim, sharding
from migrate.config.contract import Config
from migrate.linen import decoder as linen_decoder
from migrate.linen import train as linen_train
from migrate.nnx import decoder as nnx_decoder
from migrate.nnx import train as nnx_train
from parity.engine.side import Run
from parity.multiprocess import distributed

# Every cache whose value depends on the NNX code registers here (`nnx_cache`), in this module
# or in the modules that build on it (the drill-down), so that `clear_nnx_caches` reaches them
# all without importing upwards.
_NNX_CACHES: list[Any] = []


def nnx_cache(fn: Callable) -> Callable:
    """`functools.cache`, forgotten by `clear_nnx_caches`: for anything traced from NNX code."""
    cached = functools.cache(fn)
    _NNX_CACHES.append(cached)
    return cached


def fresh_copy(tree: Any) -> Any:
    """`tree` with every array copied into new buffers of the same sharding: what a train
    step, which donates its state, may consume while the original stays valid (the cached
    initial weights, a state compared after the step). One program copies them all."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    copies = _copier(tuple(leaves[i].sharding for i in arrays))([leaves[i] for i in arrays])
    for i, copy in zip(arrays, copies, strict=True):
        leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


@functools.cache
def _copier(shardings: tuple[Any, ...]) -> Callable:
    # Pinned out: a copy keeps its original's sharding; `jnp.copy` inside jit writes new
    # buffers (an output that is an input unchanged would be the same buffer).
    return jax.jit(lambda arrays: [jnp.copy(x) for x in arrays], out_shardings=list(shardings))


def schedule_free(cfg: Config) -> Config:
    """`cfg` with the pipeline-schedule keys at their defaults.

    Initial weights and the reference decoder's arithmetic do not depend on these keys, so
    configs that differ only in them share one initialisation and one compiled reference.
    """
    return cfg.replace(
        model_name="schedule-free",
        num_pipeline_microbatches=-1,
        pipeline_delay_activation_forwarding=False,
        pipeline_fsdp_ag_once=False,
        scan_pipeline_iterations=True,
        set_remat_policy_on_pipeline_iterations=True,
        remat_policy="full",
    )


def nnx_mode() -> tuple[bool, bool]:
    """(graph mode, graph updates) now in force: NNX objects built under one are kept apart."""
    return nnx.set_graph_mode.current_value(), nnx.set_graph_updates.current_value()


# ------------------------------------------------------------------ Linen


def compute_config(cfg: Config) -> Config:
    """`cfg` without the keys that do not change the compiled computation: the name, and the
    seed unless dropout is on (a train step draws its masks from it: `dropout.step_key`)."""
    return cfg.replace(seed=cfg.seed if dropout.active(cfg) else 0, model_name="compute")


def with_grad_norm(loss_fn: Callable) -> Callable:
    """`(params, batch, bubble_fill) -> ((loss, logits, aux, grad_norm), grads)`: the global
    gradient norm is computed inside the jitted step from the sharded gradients, as gradient
    clipping does; aux is the load-balancing loss inside `loss`. `bubble_fill` (a float32
    scalar, `fill_value`) fills the pipeline's unwritten buffer slots: an argument, so that the
    `bubbles` check's NaN runs the forward program every other check runs; so is
    `dropout_keys` (`forward_keys`), so that every draw of the `random` check runs it too."""

    def step(params, batch, bubble_fill=0.0, dropout_keys=None):
        (loss, (logits, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch, bubble_fill, dropout_keys
        )
        return (loss, logits, aux, optax.global_norm(grads)), grads

    return step


def forward_keys(cfg: Config, batch: Any, draw: jax.Array | None = None) -> jax.Array | None:
    """The rows' dropout keys the checks' forward and backward run with: the first train
    step's (`dropout.step_key(cfg, 0)`), or those of a `random` check draw's key; None where
    nothing drops."""
    rows = batch["inputs"].shape[0]
    if draw is None:
        return dropout.step_row_keys(cfg, 0, rows)
    return dropout.row_keys(draw, rows) if dropout.active(cfg) else None


def fill_value(bubble_fill: float) -> np.ndarray:
    """The bubble fill as the step's argument: always a float32 scalar (a Python float is
    weakly typed, another trace)."""
    return np.float32(bubble_fill)


def linen_step(cfg: Config, mesh: Mesh, use_pipeline: bool | None = None) -> Callable:
    """Jitted `(params, batch, bubble_fill) -> ((loss, logits, aux, grad_norm), grads)` for a
    Linen decoder (cached)."""
    return _linen_step(compute_config(cfg), mesh, use_pipeline)


@functools.cache
def _linen_step(cfg: Config, mesh: Mesh, use_pipeline: bool | None) -> Callable:
    model = linen_decoder.Decoder(cfg, mesh, use_pipeline)
    return jax.jit(with_grad_norm(linen_train.make_loss_fn(cfg, model)))


def linen_train_fns(cfg: Config, mesh: Mesh) -> tuple[Callable, Callable]:
    """Jitted (train step, eval step) of the Linen twin, for `optim.make_optimizer(cfg)`."""
    return _linen_train_fns(compute_config(cfg), mesh)


@functools.cache
def _linen_train_fns(cfg: Config, mesh: Mesh) -> tuple[Callable, Callable]:
    model = linen_decoder.Decoder(cfg, mesh)
    tx = optim.make_optimizer(cfg)
    state_shardings = linen_train_shardings(cfg, mesh)
    batch_sharding = sharding.batch_sharding(cfg, mesh)
    return (
        linen_train.jit_train_step(
            linen_train.make_train_step(cfg, model, tx), state_shardings, batch_sharding
        ),
        linen_train.jit_eval_step(
            linen_train.make_eval_step(cfg, model), state_shardings[0], batch_sharding
        ),
    )


def linen_train_shardings(cfg: Config, mesh: Mesh) -> tuple[Any, Any]:
    """(param, optimizer-state) shardings the Linen train step is pinned to (declared by the
    logical names)."""
    abstract = linen_abstract_variables(cfg, mesh)["params"]
    return linen_train.train_state_shardings(abstract, mesh, cfg, optim.make_optimizer(cfg))


@functools.cache
def linen_initial_variables(cfg: Config, mesh: Mesh, use_pipeline: bool | None = None):
    """Boxed variables from the Linen decoder's own init, placed on the mesh (cached)."""
    return linen_decoder.init_model(schedule_free(cfg), mesh, use_pipeline=use_pipeline)


def linen_abstract_variables(cfg: Config, mesh: Mesh, use_pipeline: bool | None = None):
    """The Linen decoder's boxed variables, abstract (cached: a trace of its init; each call
    gets its own containers, the boxes and shapes shared)."""
    return jax.tree.map(
        lambda leaf: leaf,
        _linen_abstract_variables(schedule_free(cfg), mesh, use_pipeline),
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


@functools.cache
def _linen_abstract_variables(cfg: Config, mesh: Mesh, use_pipeline: bool | None):
    tokens = jax.ShapeDtypeStruct((cfg.global_batch_size, cfg.max_target_length), jnp.int32)
    model = linen_decoder.Decoder(cfg, mesh, use_pipeline=use_pipeline)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)  # key traced too


def place_linen(variables, cfg: Config, mesh: Mesh, use_pipeline: bool | None = None):
    """Host or device Linen variables -> device arrays sharded per their logical names."""
    abstract = linen_abstract_variables(cfg, mesh, use_pipeline)
    return distributed.place(variables, linen_decoder.param_shardings(abstract, mesh, cfg))


def run_linen(
    cfg: Config,
    mesh: Mesh,
    variables,
    batch,
    use_pipeline: bool | None = None,
    bubble_fill: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> Run:
    """One forward and backward of the Linen twin, dropping with the rows' keys of
    `dropout_key` (`forward_keys`)."""
    step = linen_step(cfg, mesh, use_pipeline)
    key = forward_keys(cfg, batch, dropout_key)
    (loss, logits, aux, grad_norm), grads = step(
        variables["params"], batch, fill_value(bubble_fill), key
    )
    loss, logits, aux, grad_norm, grads = distributed.to_host((loss, logits, aux, grad_norm, grads))
    return Run(loss, logits, {"params": nn.meta.unbox(grads)}, grad_norm, **aux_loss(cfg, aux))


def aux_loss(cfg: Config, aux: Any) -> dict[str, Any]:
    """A Run's load-balancing loss, its own compared record where the model has experts."""
    return {"aux_loss": aux} if cfg.num_experts > 1 else {}


# ------------------------------------------------------------------ NNX


@nnx_cache
def _nnx_abstract(cfg: Config, mesh: Mesh, use_pipeline: bool | None, mode: tuple[bool, bool]):
    del mode  # part of the cache key only
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(
            lambda: nnx_decoder.Decoder(cfg, mesh, use_pipeline, rngs=nnx.Rngs(0))
        )
    return nnx.split(abstract)


def nnx_abstract(
    cfg: Config, mesh: Mesh, use_pipeline: bool | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of the NNX decoder, without allocating weights (one trace
    per computation: the seed and name change no shape)."""
    return _nnx_abstract(compute_config(cfg), mesh, use_pipeline, nnx_mode())


@nnx_cache
def _nnx_step(
    cfg: Config, mesh: Mesh, use_pipeline: bool | None, mode: tuple[bool, bool]
) -> Callable:
    graphdef, _ = _nnx_abstract(cfg, mesh, use_pipeline, mode)
    return jax.jit(with_grad_norm(nnx_train.make_loss_fn(cfg, graphdef)))


def nnx_step(cfg: Config, mesh: Mesh, use_pipeline: bool | None = None) -> Callable:
    """Jitted `(params, batch, bubble_fill) -> ((loss, logits, aux, grad_norm), grads)` in the
    functional form (cached)."""
    return _nnx_step(compute_config(cfg), mesh, use_pipeline, nnx_mode())


def nnx_train_fns(cfg: Config, mesh: Mesh) -> tuple[Callable, Callable]:
    """Jitted (train step, eval step) of the NNX twin, for `optim.make_optimizer(cfg)`."""
    return _nnx_train_fns(compute_config(cfg), mesh, nnx_mode())


@nnx_cache
def _nnx_train_fns(cfg: Config, mesh: Mesh, mode: tuple[bool, bool]) -> tuple[Callable, Callable]:
    graphdef, abstract = _nnx_abstract(cfg, mesh, None, mode)
    tx = optim.make_optimizer(cfg)
    state_shardings = nnx_train.train_state_shardings(abstract, mesh, cfg, tx)
    batch_sharding = sharding.batch_sharding(cfg, mesh)
    return (
        nnx_train.jit_train_step(
            nnx_train.make_train_step(cfg, graphdef, tx), state_shardings, batch_sharding
        ),
        nnx_train.jit_eval_step(
            nnx_train.make_eval_step(cfg, graphdef), state_shardings[0], batch_sharding
        ),
    )


def nnx_train_shardings(cfg: Config, mesh: Mesh) -> tuple[Any, Any]:
    """(param, optimizer-state) shardings the NNX train step is pinned to (declared by the
    logical names)."""
    _, abstract = nnx_abstract(cfg, mesh)
    return nnx_train.train_state_shardings(abstract, mesh, cfg, optim.make_optimizer(cfg))


@nnx_cache
def _nnx_initial_state(
    cfg: Config, mesh: Mesh, use_pipeline: bool | None, mode: tuple[bool, bool]
) -> nnx.State:
    del mode
    model = nnx_decoder.init_model(schedule_free(cfg), mesh, use_pipeline=use_pipeline)
    return nnx.state(model, nnx.Param)


def nnx_initial_state(cfg: Config, mesh: Mesh, use_pipeline: bool | None = None) -> nnx.State:
    """Param state from the NNX decoder's own init, placed on the mesh (cached)."""
    return _nnx_initial_state(cfg, mesh, use_pipeline, nnx_mode())


def run_nnx(
    cfg: Config,
    mesh: Mesh,
    params: nnx.State,
    batch,
    use_pipeline: bool | None = None,
    bubble_fill: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> Run:
    """One forward and backward of the NNX twin, dropping with the rows' keys of
    `dropout_key` (`forward_keys`)."""
    step = nnx_step(cfg, mesh, use_pipeline)
    key = forward_keys(cfg, batch, dropout_key)
    (loss, logits, aux, grad_norm), grads = step(params, batch, fill_value(bubble_fill), key)
    loss, logits, aux, grad_norm = distributed.to_host((loss, logits, aux, grad_norm))
    grads = distributed.to_host(nn.meta.unbox(convert.nnx_to_linen(grads)))
    return Run(loss, logits, grads, grad_norm, **aux_loss(cfg, aux))


def clear_nnx_caches() -> None:
    """Forget every cached NNX graphdef, state and compiled function (after the NNX code
    changed, for example a monkeypatched bug in a test). Linen caches stay valid."""
    for cached in _NNX_CACHES:
        cached.cache_clear()


def linen_to_nnx_params(
    cfg: Config, mesh: Mesh, variables, use_pipeline: bool | None = None
) -> nnx.State:
    """Linen variables -> the NNX decoder's Param state (same arrays, checked strictly)."""
    _, abstract = nnx_abstract(cfg, mesh, use_pipeline)
    return convert.linen_to_nnx(variables, abstract)
