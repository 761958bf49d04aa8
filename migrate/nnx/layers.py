"""NNX decoder layers (the port): RMSNorm, rotary embedding, GQA attention, SwiGLU MLP,
mixtral-style mixture of SwiGLU experts.

Twin of `migrate/linen/layers.py`: same classes, same order, same parameter names.
Every parameter is an `nnx.Param` whose `out_sharding` metadata holds the logical names declared
in `migrate.common.axes`, exactly the names of the Linen twin's `LogicallyPartitioned` box.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from migrate.common import axes, dropout, moe, numerics, packing, remat, sharding
from migrate.config.contract import Config, Rules

# Large negative score for masked positions (finite, so a fully masked row stays NaN-free).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def constrain(x: jax.Array, names: sharding.LogicalNames, mesh: Mesh, rules: Rules) -> jax.Array:
    """`x` constrained to the sharding its logical `names` resolve to on `mesh` through `rules`
    (Linen's resolver); without rules, `x` as it is."""
    return sharding.constrain(x, names, mesh, rules) if rules else x


class DenseGeneral(nnx.Module):
    """`x @ kernel`, contracting the trailing `len(in_features)` dims of x."""

    def __init__(
        self,
        in_features: tuple[int, ...],
        out_features: tuple[int, ...],
        kernel_axes: tuple[str, ...],
        config: Config,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_axes = kernel_axes
        self.config = config
        n_in = len(self.in_features)
        init = numerics.kernel_init(
            in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + len(self.out_features)))
        )
        self.kernel = nnx.Param(
            init(
                rngs.params(),
                (*self.in_features, *self.out_features),
                numerics.weight_dtype(self.config),
            ),
            out_sharding=self.kernel_axes,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        n_in = len(self.in_features)
        dtype = numerics.activation_dtype(cfg)
        contract_x = tuple(range(x.ndim - n_in, x.ndim))
        return jnp.tensordot(
            x.astype(dtype),
            self.kernel[...].astype(dtype),
            axes=(contract_x, tuple(range(n_in))),
            precision=numerics.precision(cfg),
        )


class Embed(nnx.Module):
    """Token id -> embedding row; `attend` reuses the table as the logits head (tied).

    On a `mesh`, the lookup reads the table gathered over `fsdp` (FSDP's gather for use) and
    its rows leave it split over the batch axes only. Otherwise the gradient's scatter into the
    table wants the rows' cotangent split like the table (`embed` over fsdp, or split over
    tensor along `vocab` where the rows are along `embed`): reshards from the batch's split
    that XLA's partitioner cannot express, so it replicates the whole cotangent on every
    device (docs/performance.md, "No involuntary rematerialisation").
    """

    def __init__(self, config: Config, mesh: Mesh | None = None, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        self.embedding = nnx.Param(
            numerics.embedding_init(
                rngs.params(), (cfg.vocab_size, cfg.base_emb_dim), numerics.weight_dtype(cfg)
            ),
            out_sharding=axes.EMBEDDING,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, table = self.config, self.embedding[...]
        if self.mesh is None:
            return jnp.take(table, tokens, axis=0).astype(numerics.activation_dtype(cfg))
        table = jax.lax.with_sharding_constraint(
            table, sharding.gathered_over_fsdp(axes.EMBEDDING, self.mesh, cfg)
        )
        rows = jnp.take(table, tokens, axis=0).astype(numerics.activation_dtype(cfg))
        return constrain(rows, axes.EMBEDDING_ROWS, self.mesh, cfg.logical_axis_rules)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits `x @ embedding.T` in the activation dtype and matmul precision.

        The plain form: no `1/sqrt(emb)` scaling (MaxText's `normalize_embedding_logits:
        false`, as its tied llama-family configs set it) and no soft cap.
        """
        dtype = numerics.activation_dtype(self.config)
        return jnp.tensordot(
            x.astype(dtype),
            self.embedding[...].astype(dtype),
            axes=((x.ndim - 1,), (1,)),
            precision=numerics.precision(self.config),
        )


class RMSNorm(nnx.Module):
    """Root-mean-square norm in float32 with a learned scale."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs) -> None:
        self.config = config
        cfg = self.config
        self.scale = nnx.Param(
            numerics.scale_init(rngs.params(), (cfg.base_emb_dim,), numerics.weight_dtype(cfg)),
            out_sharding=axes.NORM_SCALE,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_square + cfg.normalization_layer_epsilon)
        return (normed * self.scale[...].astype(jnp.float32)).astype(numerics.activation_dtype(cfg))


class RotaryEmbedding(nnx.Module):
    """Rotates halves (`x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin`) by position / timescale."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.config
        half = cfg.head_dim // 2
        fraction = 2 * jnp.arange(half, dtype=jnp.float32) / cfg.head_dim
        timescale = (
            cfg.rope_min_timescale * (cfg.rope_max_timescale / cfg.rope_min_timescale) ** fraction
        )
        angle = positions.astype(jnp.float32)[..., None, None] / timescale  # [b, t, 1, half]
        sin, cos = jnp.sin(angle), jnp.cos(angle)
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with rotary position embedding."""

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        emb, heads, kv_heads, head_dim = (
            cfg.base_emb_dim,
            cfg.base_num_query_heads,
            cfg.base_num_kv_heads,
            cfg.head_dim,
        )
        self.query = DenseGeneral((emb,), (heads, head_dim), axes.QUERY, cfg, rngs=rngs)
        self.key = DenseGeneral((emb,), (kv_heads, head_dim), axes.KEY, cfg, rngs=rngs)
        self.value = DenseGeneral((emb,), (kv_heads, head_dim), axes.VALUE, cfg, rngs=rngs)
        self.out = DenseGeneral((heads, head_dim), (emb,), axes.ATTENTION_OUT, cfg, rngs=rngs)
        self.rotary = RotaryEmbedding(cfg)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """`segment_ids`: each token's document in a packed batch (`migrate.common.packing`);
        None: every row is one document."""
        cfg = self.config
        rules = cfg.logical_axis_rules
        query = self.rotary(self.query(x), positions)
        key = self.rotary(self.key(x), positions)
        value = self.value(x)
        query = constrain(query, axes.BATCH_LENGTH_HEADS_KV, self.mesh, rules)
        key = constrain(key, axes.BATCH_LENGTH_KV_HEADS_KV, self.mesh, rules)
        value = constrain(value, axes.BATCH_LENGTH_KV_HEADS_KV, self.mesh, rules)
        query = query * cfg.head_dim**-0.5
        # MaxText's checkpoint names, which its remat policies save (`migrate.common.remat`).
        query = checkpoint_name(query, remat.QUERY_PROJ)
        key = checkpoint_name(key, remat.KEY_PROJ)
        value = checkpoint_name(value, remat.VALUE_PROJ)
        batch, length, heads, head_dim = query.shape
        groups = heads // cfg.base_num_kv_heads
        grouped_query = query.reshape(batch, length, cfg.base_num_kv_heads, groups, head_dim)
        scores = jnp.einsum(
            "btkgd,bskd->bkgts", grouped_query, key, precision=numerics.precision(cfg)
        ).astype(jnp.float32)
        scores = jnp.where(packing.attention_mask(segment_ids, length), scores, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
        context = jnp.einsum("bkgts,bskd->btkgd", probs, value, precision=numerics.precision(cfg))
        context = checkpoint_name(
            context.reshape(batch, length, heads, head_dim), remat.ATTENTION_OUT
        )
        return checkpoint_name(self.out(context), remat.OUT_PROJ)


class MLP(nnx.Module):
    """SwiGLU: `(silu(x @ wi_0) * (x @ wi_1)) @ wo`."""

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        emb, mlp = cfg.base_emb_dim, cfg.base_mlp_dim
        self.wi_0 = DenseGeneral((emb,), (mlp,), axes.MLP_IN, cfg, rngs=rngs)
        self.wi_1 = DenseGeneral((emb,), (mlp,), axes.MLP_IN, cfg, rngs=rngs)
        self.wo = DenseGeneral((mlp,), (emb,), axes.MLP_OUT, cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, broadcast_dims=dropout.BROADCAST_DIMS)

    def __call__(self, x: jax.Array, dropout_keys: jax.Array | None = None) -> jax.Array:
        """`dropout_keys`: the rows' keys of this layer (`dropout.at_layer`), or None."""
        gate_proj = checkpoint_name(self.wi_0(x), remat.MLPWI_0)
        up_proj = checkpoint_name(self.wi_1(x), remat.MLPWI_1)
        hidden = jax.nn.silu(gate_proj) * up_proj
        hidden = constrain(hidden, axes.BATCH_LENGTH_MLP, self.mesh, self.config.logical_axis_rules)
        drop = lambda row, key: self.dropout(row, deterministic=False, rngs=key)
        hidden = dropout.per_row(drop, hidden, dropout_keys, dropout.SITE_MLP)
        return checkpoint_name(self.wo(hidden), remat.MLPWO)


class MoeBlock(nnx.Module):
    """Mixtral-style mixture of `num_experts` SwiGLU experts, `num_experts_per_tok` per token.

    Router: `softmax(x @ gate)` over experts in float32, the top k kept (`migrate.common.moe.route`:
    ties go to the lower expert index) and renormalised to sum to 1. Dropless and dense: every
    expert is computed for every token and the outputs combined with the routing weights, zero
    for the experts a token is not routed to. Exact (no capacity, no token dropped), simple, and the
    expert dim shards over the `expert` mesh axis; it costs E/k times the matmul work of a
    sparse dispatch (counted as such by the efficiency and compile checks).

    Returns `(y, aux)`: `aux` is the load-balancing loss (Switch/MaxText form) per sequence,
    `E * sum_e f_e * p_e` with `f_e` the fraction of the sequence's tokens routed to expert e
    and `p_e` its mean router probability, averaged over the sequences of `x`. Per sequence, so
    that any split of the batch into microbatches (which keep sequences whole) averages to the
    same value.
    """

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        emb, mlp, experts = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.num_experts
        self.gate = DenseGeneral((emb,), (experts,), axes.ROUTER, cfg, rngs=rngs)
        init = numerics.kernel_init(in_axis=1, out_axis=2, batch_axis=0)
        dtype = numerics.weight_dtype(cfg)
        self.wi_0 = nnx.Param(
            init(rngs.params(), (experts, emb, mlp), dtype), out_sharding=axes.EXPERT_MLP_IN
        )
        self.wi_1 = nnx.Param(
            init(rngs.params(), (experts, emb, mlp), dtype), out_sharding=axes.EXPERT_MLP_IN
        )
        self.wo = nnx.Param(
            init(rngs.params(), (experts, mlp, emb), dtype), out_sharding=axes.EXPERT_MLP_OUT
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        rules, dtype, precision = cfg.logical_axis_rules, x.dtype, numerics.precision(cfg)
        # Routing runs on the tokens as the layer shards them (the expert axis splits them).
        x = constrain(x, axes.BATCH_LENGTH_EMBED, self.mesh, rules)
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        combine, routed = moe.route(probs, cfg.num_experts_per_tok)  # [b, t, E] each
        x = constrain(x, axes.BATCH_NO_EXP_LENGTH_EMBED, self.mesh, rules)
        gate_proj = jnp.einsum(
            "btd,edf->btef", x, self.wi_0[...].astype(dtype), precision=precision
        )
        up_proj = jnp.einsum("btd,edf->btef", x, self.wi_1[...].astype(dtype), precision=precision)
        # Each under both of MaxText's names (its dense and its MoE remat keys).
        gate_proj = checkpoint_name(checkpoint_name(gate_proj, remat.MLPWI_0), remat.MOE_MLPWI_0)
        up_proj = checkpoint_name(checkpoint_name(up_proj, remat.MLPWI_1), remat.MOE_MLPWI_1)
        hidden = jax.nn.silu(gate_proj) * up_proj * combine[..., None].astype(dtype)
        hidden = constrain(hidden, axes.BATCH_NO_EXP_LENGTH_EXP_MLP, self.mesh, rules)
        y = jnp.einsum("btef,efd->btd", hidden, self.wo[...].astype(dtype), precision=precision)
        # Pinned, or XLA may gather the tokens over fsdp to meet wo's fsdp-split embed dim and
        # compute the output projection once per fsdp shard (measured: 1.29x the matmul work).
        y = constrain(y, axes.BATCH_NO_EXP_LENGTH_EMBED, self.mesh, rules)
        y = checkpoint_name(checkpoint_name(y, remat.MLPWO), remat.MOE_MLPWO)
        return y, moe.load_balance_loss(probs, routed)


class DecoderLayer(nnx.Module):
    """Pre-norm llama2 block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; the MLP is a
    `MoeBlock` when `num_experts > 1`. Returns `(x, aux)`: the layer's load-balancing loss (0
    for a dense MLP)."""

    def __init__(self, config: Config, mesh: Mesh, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.mesh = mesh
        cfg = self.config
        self.pre_self_attention_layer_norm = RMSNorm(cfg, rngs=rngs)
        self.self_attention = Attention(cfg, self.mesh, rngs=rngs)
        self.post_self_attention_layer_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = (
            MoeBlock(cfg, self.mesh, rngs=rngs)
            if cfg.num_experts > 1
            else MLP(cfg, self.mesh, rngs=rngs)
        )
        self.dropout = nnx.Dropout(cfg.dropout_rate, broadcast_dims=dropout.BROADCAST_DIMS)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        dropout_keys: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`dropout_keys`: the rows' keys of this layer (`dropout.at_layer`), or None: no
        dropout (MaxText's MoE block drops nothing inside; its layer output does)."""
        rules = self.config.logical_axis_rules
        x = checkpoint_name(x, axes.DECODER_LAYER_INPUT)
        x = constrain(x, axes.BATCH_LENGTH_EMBED, self.mesh, rules)
        x = x + self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
        if self.config.num_experts > 1:
            mlp_out, aux = self.mlp(self.post_self_attention_layer_norm(x))
        else:
            mlp_out = self.mlp(self.post_self_attention_layer_norm(x), dropout_keys)
            aux = jnp.zeros(())
        x = x + mlp_out
        drop = lambda row, key: self.dropout(row, deterministic=False, rngs=key)
        x = dropout.per_row(drop, x, dropout_keys, dropout.SITE_LAYER_OUTPUT)
        x = constrain(x, axes.BATCH_LENGTH_EMBED, self.mesh, rules)
        return x, aux
