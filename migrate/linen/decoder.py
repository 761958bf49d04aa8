"""Linen decoder (the original): embedding, pipelined or scanned layers, final norm, logits, loss.

Twin of `migrate/nnx/decoder.py`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from migrate.common import axes, numerics, placement, sharding
from migrate.config.contract import Config
from migrate.linen.layers import DecoderLayer, DenseGeneral, Embed, RMSNorm
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
    bubble_fill: float = 0.0

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, rules = self.config, self.config.logical_axis_rules
        token_embedder = Embed(cfg, self.mesh, name="token_embedder")
        x = token_embedder(tokens)
        x = nn.with_logical_constraint(
            x, axes.LOGITS_BATCH_LENGTH_EMBED, rules=rules, mesh=self.mesh
        )
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        pipelined = cfg.using_pipeline if self.use_pipeline is None else self.use_pipeline
        if pipelined:
            with jax.named_scope(axes.INTO_PIPELINE):
                x = nn.with_logical_constraint(
                    x, axes.BATCH_LENGTH_EMBED, rules=rules, mesh=self.mesh
                )
            x, aux = Pipeline(cfg, self.mesh, self.bubble_fill, name="pipeline")(x, positions)
            with jax.named_scope(axes.OUT_OF_PIPELINE):
                x = nn.with_logical_constraint(
                    x, axes.LOGITS_BATCH_LENGTH_EMBED, rules=rules, mesh=self.mesh
                )
            if placement.has_layers_after_pipeline(cfg):
                after = LayersAfterPipeline(cfg, self.mesh, name="layers_after_pipeline")
                x, after_aux = after(x, positions)
                aux = aux + after_aux
        else:
            layer = remat_layer(cfg)(cfg, self.mesh, name="layers")
            x, aux = scan_layers(
                layer, x, positions, cfg.base_num_decoder_layers, axes.REFERENCE_LAYERS
            )
        x = RMSNorm(cfg, name="decoder_norm")(x)
        x = nn.with_logical_constraint(x, axes.LOGITS_HEAD_INPUT, rules=rules, mesh=self.mesh)
        head = (
            token_embedder.attend
            if cfg.logits_via_embedding
            else DenseGeneral(
                (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg, name="logits_dense"
            )
        )
        logits = head(x)
        logits = logits.astype(jnp.float32)
        logits = nn.with_logical_constraint(
            logits, axes.LOGITS_BATCH_LENGTH_VOCAB, rules=rules, mesh=self.mesh
        )
        return logits, aux


def remat_layer(cfg: Config) -> type[nn.Module]:
    """`DecoderLayer`, rematerialised per layer as the config's policy says."""
    policy = numerics.remat_policy(cfg)
    if policy is None:
        return DecoderLayer
    return nn.remat(DecoderLayer, policy=policy, prevent_cse=False)


class LayersAfterPipeline(nn.Module):
    """The N - P layers after a pipelined subset (`migrate.common.placement`), scanned, on the batch
    split over stages too (`sharding.after_pipeline_config`)."""

    config: Config
    mesh: Mesh

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, trace: bool = False):
        """`[B, T, E] -> ([B, T, E], aux)`; with `trace`, also every layer's output
        `[N-P, B, T, E]`."""
        cfg = sharding.after_pipeline_config(self.config)
        layer = remat_layer(cfg)(cfg, self.mesh, name="layers")
        count = cfg.num_layers_after_pipeline
        return scan_layers(layer, x, positions, count, axes.LAYERS_AFTER_PIPELINE, trace)


def cross_entropy_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Token-mean cross entropy: microbatching cannot change its scale."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def training_loss(cfg: Config, logits: jax.Array, aux: jax.Array, targets: jax.Array) -> jax.Array:
    """The loss the optimizer sees: cross entropy, plus `load_balance_loss_weight` x the
    load-balancing loss `aux` in a model with experts."""
    loss = cross_entropy_loss(logits, targets)
    if cfg.num_experts > 1:
        loss = loss + cfg.load_balance_loss_weight * aux
    return loss


def param_shardings(abstract_variables, mesh: Mesh, cfg: Config):
    """NamedSharding per leaf from the LogicallyPartitioned boxes (Linen's resolver; a dim the
    mesh axes do not divide replicated: `sharding.fitted_sharding`)."""
    rules = sharding.logical_rules(cfg)

    def resolve(leaf):
        names = leaf.names if isinstance(leaf, nn.LogicallyPartitioned) else ()
        return sharding.fitted_sharding(tuple(names), tuple(nn.meta.unbox(leaf).shape), mesh, rules)

    return jax.tree.map(
        resolve, abstract_variables, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )


def init_variables(model: Decoder, tokens: jax.Array, seed: int | None = None):
    """Boxed variables from `model.init`, each array placed on the mesh per its logical names."""
    cfg = model.config
    seed_arg = np.uint32(cfg.seed if seed is None else seed)

    def init(seed: jax.Array, tokens: jax.Array) -> dict:
        # The key is made inside the program: made outside, it is an eager op of its own.
        return model.init(jax.random.key(seed, impl=cfg.jax_default_prng_impl), tokens)

    abstract = jax.eval_shape(init, seed_arg, tokens)
    shardings = param_shardings(abstract, model.mesh, cfg)
    return jax.jit(init, out_shardings=shardings)(seed_arg, tokens)
