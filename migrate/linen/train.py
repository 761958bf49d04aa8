"""Linen train step (the original): `model.apply` on boxed params, optax on the boxed tree.

Twin of `migrate/nnx/train.py`. `LogicallyPartitioned` boxes are pytrees, so optax's moments
come out boxed with the same logical names as the parameters. The jitted step pins the
shardings of the parameters and optimizer state, in and out, to the ones their logical names
declare: without that, XLA may hand back a different sharding than the step was compiled for
(a replicated norm scale returned sharded over `tensor`), and the next step refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from migrate.common import accumulation, dropout, optim, packing
from migrate.common.loss import training_loss
from migrate.config.contract import Config
from migrate.linen.decoder import Decoder
from migrate.linen.decoder import param_shardings as param_shardings_of


def make_loss_fn(cfg: Config, model: Decoder) -> Callable:
    """`(params, batch, bubble_fill=0.0, dropout_keys=None) -> (loss, (logits, aux))` for
    `model`, the decoder of `cfg`: the loss the optimizer sees (`training_loss`) and the
    load-balancing loss aux in it; `bubble_fill` (a test hook, `Pipeline.__call__`) and
    `dropout_keys` (per row; None: nothing drops) go to the decoder's call."""

    def loss_fn(params, batch, bubble_fill: float | jax.Array = 0.0, dropout_keys=None):
        logits, aux = model.apply(
            {"params": params},
            batch["inputs"],
            bubble_fill,
            **packing.decoder_inputs(batch),
            dropout_keys=dropout_keys,
        )
        loss = training_loss(cfg, logits, aux, batch["targets"], packing.loss_weights(batch))
        return loss, (logits, aux)

    return loss_fn


def make_train_step(cfg: Config, model: Decoder, tx: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, batch) -> (params, opt_state, metrics)`, pure; jit it. The batch
    holds `cfg.train_batch_size` rows: with `gradient_accumulation_steps` k > 1, the loss and
    gradients are averaged over k batches of `global_batch_size` rows (`accumulation`). With
    dropout on, the step's masks come from its rows' keys (`dropout.step_key`: the seed and the
    optimizer's step count, so a resumed run draws what an uninterrupted one draws)."""
    value_and_grad = accumulation.value_and_grad(
        make_loss_fn(cfg, model), cfg.gradient_accumulation_steps
    )

    def train_step(params, opt_state, batch):
        step = optim.step_count(opt_state)
        keys = dropout.step_row_keys(cfg, step, batch["inputs"].shape[0])
        (loss, (_, aux)), grads = value_and_grad(params, batch, keys)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, step_metrics(cfg, loss, aux, grads)

    return train_step


def step_metrics(cfg: Config, loss: jax.Array, aux: jax.Array, grads: Any) -> dict:
    """The train step's metrics: loss, global gradient norm, and the load-balancing loss in a
    model with experts."""
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
    if cfg.num_experts > 1:
        metrics["aux_loss"] = aux
    return metrics


def make_eval_step(cfg: Config, model: Decoder) -> Callable:
    """`(params, batch) -> loss`, forward only."""
    loss_fn = make_loss_fn(cfg, model)
    return lambda params, batch: loss_fn(params, batch)[0]


def train_state_shardings(
    abstract_params: Any, mesh: Mesh, cfg: Config, tx: optax.GradientTransformation
) -> tuple[Any, Any]:
    """(parameter shardings, optimizer-state shardings) that the logical names declare.

    `abstract_params` is the boxed tree of `jax.eval_shape(model.init, ...)['params']`. Every
    optimizer moment is sharded like its parameter, everything else (step counts) replicated.
    """
    param_shardings = param_shardings_of(abstract_params, mesh, cfg)
    opt_state_shardings = optim.state_shardings(
        tx, abstract_params, param_shardings, mesh, lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    return param_shardings, opt_state_shardings


def jit_train_step(
    train_step: Callable, state_shardings: tuple[Any, Any], batch_sharding: NamedSharding
) -> Callable:
    """`train_step` jitted with parameters and optimizer state pinned, in and out, to
    `state_shardings`, the batch to `batch_sharding`, and the metrics replicated.

    Parameters and optimizer state are donated: the new state is written into the old one's
    buffers, so a step holds one train state, not two. The arrays passed in are deleted by the
    call; keep a copy (`jnp.copy`) of any that are needed afterwards.
    """
    param_shardings, opt_state_shardings = state_shardings
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    return jax.jit(
        train_step,
        in_shardings=(param_shardings, opt_state_shardings, batch_sharding),
        out_shardings=(param_shardings, opt_state_shardings, replicated),
        donate_argnums=(0, 1),
    )


def jit_eval_step(
    eval_step: Callable, param_shardings: Any, batch_sharding: NamedSharding
) -> Callable:
    """`eval_step` jitted with its inputs pinned like the train step's."""
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    return jax.jit(
        eval_step, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated
    )
