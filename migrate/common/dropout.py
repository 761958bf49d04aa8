"""Dropout (MaxText's `dropout_rate`, `enable_dropout`) at MaxText's four sites, with masks keyed
per row and per layer (both twins).

MaxText drops, each with `broadcast_dims=(-2,)` (one mask per row, shared along the sequence):
the embedding's output, the MLP's hidden activations before `wo`, each layer's output after its
residual add, and the final norm's output. The twins drop at the same sites with Flax's own
modules (`nn.Dropout`, `nnx.Dropout`), each call given its raw key: the one way both frameworks
draw the same mask (Linen's `make_rng` folds the module path into the key, an `nnx.Rngs`
stream its call counter, so the two never agree by stream).

The keys. A train step draws one key from (seed, optimizer step count), as MaxText folds
`state.step` into its `init_rng`, and folds each row's index of the step's batch into it
(`row_keys`); the decoder takes those per-row keys, each layer folds its global index
`(r*S + s)*L + j` into its rows' keys (`at_layer`), and each site its number (`SITE_*`). A mask
is thus a function of (seed, step, row, layer, site) alone: not of the microbatch a row travels
in, the stage or iteration that runs its layer, nor the pipeline's shape. The pipelined decoder
therefore equals the reference under dropout too (the `pipeline` check still compares values),
bubbles draw masks that reach nothing, and a run resumed from a checkpoint (its optimizer state
holds the step count) draws what an uninterrupted one draws. A step that accumulates gradients
over k batches splits the rows' keys with the rows, so it drops as one step on all k batches at
once does.

The keys are always threefry2x32, whatever `jax_default_prng_impl` (the weights' init) says:
rbg's random bits depend on how their keys are batched (measured: the pipeline's masks, drawn
under the stage vmap, differed from the reference's at every layer site under rbg, and were
equal under threefry), and the masks must not depend on the schedule.

MaxText's own pipeline keys its masks otherwise (0.2.5 splits the key per stage and repeat and
folds the iteration in; 0.2.3's Linen pipeline hands the stages no dropout key at all), so its
pipelined masks follow the schedule (docs/pipeline.md, "Dropout").
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from migrate.common import packing
from migrate.config.contract import Config

BROADCAST_DIMS = (-2,)  # MaxText's: one mask per row, shared by every position

# Sites inside a layer (folded into the layer's keys) ...
SITE_MLP = 0  # the MLP's hidden activations, before `wo`
SITE_LAYER_OUTPUT = 1  # the layer's output, after its residual add
# ... and in the decoder (folded into the rows' keys, past every layer index: < 2**10).
SITE_EMBEDDING = 2**20
SITE_DECODER_NORM = 2**20 + 1
# Folded into the seed's key, so that no init key is ever a dropout key.
SALT = 0xD50
IMPL = "threefry2x32"  # vmap-exact (module docstring)


def active(cfg: Config) -> bool:
    """Whether the decoder drops at all: `enable_dropout` and a positive `dropout_rate`."""
    return cfg.enable_dropout and cfg.dropout_rate > 0


def step_key(cfg: Config, step: jax.Array | int) -> jax.Array:
    """The key of train step `step` (the optimizer's step count): from the config's seed."""
    base = jax.random.fold_in(jax.random.key(cfg.seed, impl=IMPL), SALT)
    return jax.random.fold_in(base, step)


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """`[rows]` keys, row `b`'s `fold_in(key, b)`."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(rows))


def step_row_keys(cfg: Config, step: jax.Array | int, rows: int) -> jax.Array | None:
    """The rows' keys of train step `step` (`row_keys` of `step_key`); None where nothing
    drops."""
    return row_keys(step_key(cfg, step), rows) if active(cfg) else None


def fold_rows(keys: jax.Array, value: jax.Array | int) -> jax.Array:
    """`value` (a layer's index, a site's number) folded into every row's key."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, value)


def per_row(
    drop: Callable[[jax.Array, jax.Array], jax.Array],
    x: jax.Array,
    keys: jax.Array | None,
    site: int,
) -> jax.Array:
    """`drop(row, key)` (a framework's Dropout called with a raw key) on every row of
    `x` `[B, ...]`, row `b` with `fold_in(keys[b], site)`; `x` itself where `keys` is None."""
    if keys is None:
        return x
    return jax.vmap(drop)(x, fold_rows(keys, site))


def at_layer(positions: packing.Positions, layer: jax.Array | int) -> packing.Positions:
    """`positions` with its rows' keys for global layer `layer` (None stays None: no
    dropout)."""
    if positions.dropout is None:
        return positions
    return positions._replace(dropout=fold_rows(positions.dropout, layer))
