"""Linen decoder (the original): embedding, pipelined or scanned layers, final norm, logits
(its loss, the same for both twins: `migrate.common.loss`).

Twin of `migrate/nnx/decoder.py`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from migrate.common import axes, dropout, packing, placement, remat, sharding
from migrate.config.contract import Config
from migrate.linen.layers import DecoderLayer, DenseGeneral, Embed, RMSNorm, constrain
from migrate.linen.pipeline import Pipeline, scan_layers


class Decoder(nn.Module):
    """llama2-style decoder. `use_pipeline=None` follows the config (pipeline when S > 1);
    `False` gives the non-pipelined reference, all layers stacked on one `layers` axis. With a
    pipelined subset (`pipeline_parallel_layers`) the layers after the first P run after the
    pipeline, scanned, as `layers_after_pipeline` (`migrate.common.placement`). With
    `logits_via_embedding` the token embedding is also the logits head (`Embed.attend`) and no
    `logits_dense` exists: the table's gradient sums both uses.

    Returns `(logits, aux)`: aux the load-balancing losses of the MoE layers (0 without
    experts), summed over layers; each layer's is a mean over the batch's sequences, so the
    pipeline (mean over microbatches of their means) and the reference agree."""

    config: Config
    mesh: Mesh
    use_pipeline: bool | None = None

    def setup(self) -> None:
        cfg = self.config
        self.pipelined = cfg.using_pipeline if self.use_pipeline is None else self.use_pipeline
        self.token_embedder = Embed(cfg, self.mesh)
        if self.pipelined:
            self.pipeline = Pipeline(cfg, self.mesh)
            if placement.has_layers_after_pipeline(cfg):
                self.layers_after_pipeline = LayersAfterPipeline(cfg, self.mesh)
        else:
            self.layers = DecoderLayer(cfg, self.mesh)
        self.decoder_norm = RMSNorm(cfg)
        self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=dropout.BROADCAST_DIMS)
        if not cfg.logits_via_embedding:
            self.logits_dense = DenseGeneral(
                (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg
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
        drop = lambda row, key: self.dropout(row, deterministic=False, rng=key)
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
            length = cfg.base_num_decoder_layers
            policy = remat.layer_policy(cfg)
            x, aux = scan_layers(self.layers, x, positions, length, axes.REFERENCE_LAYERS, policy)
        x = self.decoder_norm(x)
        x = dropout.per_row(drop, x, keys, dropout.SITE_DECODER_NORM)
        x = constrain(x, axes.LOGITS_HEAD_INPUT, self.mesh, rules)
        head = self.token_embedder.attend if cfg.logits_via_embedding else self.logits_dense
        logits = head(x)
        logits = logits.astype(jnp.float32)
        logits = constrain(logits, axes.LOGITS_BATCH_LENGTH_VOCAB, self.mesh, rules)
        return logits, aux


class LayersAfterPipeline(nn.Module):
    """The N - P layers after a pipelined subset (`migrate.common.placement`), scanned, on the batch
    split over stages too (`sharding.after_pipeline_config`)."""

    config: Config
    mesh: Mesh

    def setup(self) -> None:
        cfg = sharding.after_pipeline_config(self.config)
        self.layers = DecoderLayer(cfg, self.mesh)

    def __call__(self, x: jax.Array, positions: packing.Positions, trace: bool = False):
        """`[B, T, E] -> ([B, T, E], aux)`; with `trace`, also every layer's output
        `[N-P, B, T, E]`."""
        cfg = self.config
        length = cfg.num_layers_after_pipeline
        policy = remat.layer_policy(cfg)
        first = cfg.num_pipelined_layers
        return scan_layers(
            self.layers, x, positions, length, axes.LAYERS_AFTER_PIPELINE, policy, trace, first
        )


def param_shardings(abstract: dict, mesh: Mesh, cfg: Config) -> dict:
    """NamedSharding per leaf from the LogicallyPartitioned boxes (Linen's resolver; a dim the
    mesh axes do not divide replicated: `sharding.fitted_sharding`)."""
    rules = sharding.logical_rules(cfg)

    def resolve(leaf: nn.LogicallyPartitioned | jax.ShapeDtypeStruct) -> NamedSharding:
        names = leaf.names if isinstance(leaf, nn.LogicallyPartitioned) else ()
        return sharding.fitted_sharding(tuple(names), tuple(nn.meta.unbox(leaf).shape), mesh, rules)

    return jax.tree.map(resolve, abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def init_model(
    cfg: Config, mesh: Mesh, seed: int | None = None, use_pipeline: bool | None = None
) -> dict:
    """The decoder's variables (boxed), each array created directly with its sharding on the
    mesh, in one jitted init."""
    seed_arg = np.uint32(cfg.seed if seed is None else seed)
    model = Decoder(cfg, mesh, use_pipeline)
    tokens = np.zeros((cfg.global_batch_size, cfg.max_target_length), np.int32)

    def init(seed: jax.Array, tokens: jax.Array) -> dict:
        # The key is made inside the program: made outside, it is an eager op of its own.
        return model.init(jax.random.key(seed, impl=cfg.jax_default_prng_impl), tokens)

    abstract = jax.eval_shape(init, seed_arg, tokens)
    return jax.jit(init, out_shardings=param_shardings(abstract, mesh, cfg))(seed_arg, tokens)
