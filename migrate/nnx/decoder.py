"""NNX decoder (the port): embedding, pipelined or scanned layers, final norm, logits
(its loss, the same for both twins: `migrate.common.loss`).

Twin of `migrate/linen/decoder.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from migrate.common import axes, dropout, packing, placement, remat, sharding
from migrate.config.contract import Config
from migrate.nnx.layers import DecoderLayer, DenseGeneral, Embed, RMSNorm, constrain
from migrate.nnx.pipeline import Pipeline, scan_layers, stack_modules


class Decoder(nnx.Module):
    """llama2-style decoder. `use_pipeline=None` follows the config (pipeline when S > 1);
    `False` gives the non-pipelined reference, all layers stacked on one `layers` axis. With a
    pipelined subset (`pipeline_parallel_layers`) the layers after the first P run after the
    pipeline, scanned, as `layers_after_pipeline` (`migrate.common.placement`). With
    `logits_via_embedding` the token embedding is also the logits head (`Embed.attend`) and no
    `logits_dense` exists: the table's gradient sums both uses.

    Returns `(logits, aux)`: aux the load-balancing losses of the MoE layers (0 without
    experts), summed over layers; each layer's is a mean over the batch's sequences, so the
    pipeline (mean over microbatches of their means) and the reference agree."""

    def __init__(
        self, config: Config, mesh: Mesh, use_pipeline: bool | None = None, *, rngs: nnx.Rngs
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.use_pipeline = use_pipeline
        cfg = self.config
        self.pipelined = cfg.using_pipeline if self.use_pipeline is None else self.use_pipeline
        self.token_embedder = Embed(cfg, self.mesh, rngs=rngs)
        if self.pipelined:
            self.pipeline = Pipeline(cfg, self.mesh, rngs=rngs)
            if placement.has_layers_after_pipeline(cfg):
                self.layers_after_pipeline = LayersAfterPipeline(cfg, self.mesh, rngs=rngs)
        else:
            self.layers = stack_modules(
                lambda r: DecoderLayer(cfg, self.mesh, rngs=r),
                cfg.base_num_decoder_layers,
                axes.REFERENCE_LAYERS,
                rngs,
            )
        self.decoder_norm = RMSNorm(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, broadcast_dims=dropout.BROADCAST_DIMS)
        if not cfg.logits_via_embedding:
            self.logits_dense = DenseGeneral(
                (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg, rngs=rngs
            )

    def __call__(
        self,
        tokens: jax.Array,
        bubble_fill: float | jax.Array = 0.0,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        dropout_keys: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`(logits, aux)`; `bubble_fill` goes to the pipeline (`Pipeline.__call__`). A packed
        batch gives each token's `segment_ids` and `positions` in its document
        (`migrate.common.packing`); otherwise every row is one document. Given `dropout_keys`
        `[B]` (a train step's, `dropout.row_keys`) and with dropout on, every row drops with its
        own keys (`migrate.common.dropout`); without them, nothing drops."""
        cfg, rules = self.config, self.config.logical_axis_rules
        keys = dropout_keys if dropout.active(cfg) else None
        drop = lambda row, key: self.dropout(row, deterministic=False, rngs=key)
        x = self.token_embedder(tokens)
        x = dropout.per_row(drop, x, keys, dropout.SITE_EMBEDDING)
        x = constrain(x, axes.LOGITS_BATCH_LENGTH_EMBED, self.mesh, rules)
        positions = packing.of_tokens(tokens, segment_ids, positions, keys)
        if self.pipelined:
            with jax.named_scope(axes.INTO_PIPELINE):
                x = constrain(x, axes.BATCH_LENGTH_EMBED, self.mesh, rules)
            x, aux = self.pipeline(x, positions, bubble_fill)
            with jax.named_scope(axes.OUT_OF_PIPELINE):
                x = constrain(x, axes.LOGITS_BATCH_LENGTH_EMBED, self.mesh, rules)
            if placement.has_layers_after_pipeline(cfg):
                x, after_aux = self.layers_after_pipeline(x, positions)
                aux = aux + after_aux
        else:
            policy = remat.layer_policy(cfg)
            x, aux = scan_layers(self.layers, x, positions, policy)
        x = self.decoder_norm(x)
        x = dropout.per_row(drop, x, keys, dropout.SITE_DECODER_NORM)
        x = constrain(x, axes.LOGITS_HEAD_INPUT, self.mesh, rules)
        head = self.token_embedder.attend if cfg.logits_via_embedding else self.logits_dense
        logits = head(x)
        logits = logits.astype(jnp.float32)
        logits = constrain(logits, axes.LOGITS_BATCH_LENGTH_VOCAB, self.mesh, rules)
        return logits, aux


class LayersAfterPipeline(nnx.Module):
    """The N - P layers after a pipelined subset (`migrate.common.placement`), scanned, on the batch
    split over stages too (`sharding.after_pipeline_config`)."""

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = sharding.after_pipeline_config(self.config)
        self.layers = stack_modules(
            lambda r: DecoderLayer(cfg, self.mesh, rngs=r),
            cfg.num_layers_after_pipeline,
            axes.LAYERS_AFTER_PIPELINE,
            rngs,
        )

    def __call__(self, x: jax.Array, positions: packing.Positions, trace: bool = False):
        """`[B, T, E] -> ([B, T, E], aux)`; with `trace`, also every layer's output
        `[N-P, B, T, E]`."""
        cfg = self.config
        policy = remat.layer_policy(cfg)
        first = cfg.num_pipelined_layers
        return scan_layers(self.layers, x, positions, policy, trace, first)


def param_shardings(abstract: nnx.State, mesh: Mesh, cfg: Config) -> nnx.State:
    """NamedSharding per Variable from its `out_sharding` names (Linen's resolver; a dim the
    mesh axes do not divide replicated: `sharding.fitted_sharding`)."""
    rules = sharding.logical_rules(cfg)

    def resolve(variable: nnx.Variable) -> NamedSharding:
        names = variable.get_metadata().get("out_sharding") or ()
        return sharding.fitted_sharding(tuple(names), tuple(variable.shape), mesh, rules)

    return jax.tree.map(resolve, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_model(
    cfg: Config, mesh: Mesh, seed: int | None = None, use_pipeline: bool | None = None
) -> Decoder:
    """The decoder, each array created directly with its sharding on the mesh, in one jitted
    init.

    NNX's eager sharding would shard each layer inside `nnx.vmap`, before the stacked axis
    exists, leaving the stage axis replicated; so build without it and place every array by its
    full `out_sharding`.
    """
    seed_arg = np.uint32(cfg.seed if seed is None else seed)

    def init(seed: jax.Array) -> Decoder:
        # The key is made inside the program: made outside, it is an eager op of its own.
        with nnx.use_eager_sharding(False):
            key = jax.random.key(seed, impl=cfg.jax_default_prng_impl)
            return Decoder(cfg, mesh, use_pipeline, rngs=nnx.Rngs(key))

    def create(seed: jax.Array) -> nnx.State:
        return nnx.split(init(seed))[1]

    graphdef, abstract = nnx.split(nnx.eval_shape(init, seed_arg))
    state = jax.jit(create, out_shardings=param_shardings(abstract, mesh, cfg))(seed_arg)
    return nnx.merge(graphdef, state)
