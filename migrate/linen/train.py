"""Linen train step (the original): `model.apply` on boxed params, optax on the boxed tree.

Twin of `migrate/nnx/train.py`. `LogicallyPartitioned` boxes are pytrees, so optax's moments
come out boxed with the same logical names as the parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax.sharding import Mesh

from migrate.config import Config
from migrate.linen.decoder import Decoder, cross_entropy_loss


def make_loss_fn(
    cfg: Config, mesh: Mesh, use_pipeline: bool | None = None, bubble_fill: float = 0.0
) -> Callable:
    """`(params, batch) -> (loss, logits)` for the decoder the arguments describe."""
    model = Decoder(cfg, mesh, use_pipeline=use_pipeline, bubble_fill=bubble_fill)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return cross_entropy_loss(logits, batch["targets"]), logits

    return loss_fn


def make_train_step(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, batch) -> (params, opt_state, metrics)`, pure; jit it."""
    loss_fn = make_loss_fn(cfg, mesh)

    def train_step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return train_step


def make_eval_step(cfg: Config, mesh: Mesh) -> Callable:
    """`(params, batch) -> loss`, forward only."""
    loss_fn = make_loss_fn(cfg, mesh)
    return lambda params, batch: loss_fn(params, batch)[0]
