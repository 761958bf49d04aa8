"""NNX train step (the port): functional form over split Param state, optax on the State.

Twin of `migrate/linen/train.py`. The step takes the Param state, not the module: `nnx.merge`
inside, so it is pure, works with graph mode and graph updates on or off, and dispatches as
cheaply as a Linen step. Variables are pytrees, so optax's moments come out as Params with the
same `out_sharding` as the parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from flax import nnx

from migrate.nnx.decoder import cross_entropy_loss


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable:
    """`(params, batch) -> (loss, logits)` for the decoder that `graphdef` describes."""

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"])
        return cross_entropy_loss(logits, batch["targets"]), logits

    return loss_fn


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, batch) -> (params, opt_state, metrics)`, pure; jit it."""
    loss_fn = make_loss_fn(graphdef)

    def train_step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    """`(params, batch) -> loss`, forward only."""
    loss_fn = make_loss_fn(graphdef)
    return lambda params, batch: loss_fn(params, batch)[0]
