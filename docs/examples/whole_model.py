"""A whole-model pair for `compare_modules` (the migration guide's section 13, gated in
tests/test_whole_model.py): a tiny Transformer language model in Linen and its NNX port
(embedding, two pre-norm blocks of attention with a decode cache and an MLP, dropout at three
sites, logically annotated weights, logits through the tied embedding), and seeded bugs.

The NNX attention takes Linen's attention kernel (`linen_attention`): NNX's default kernel is
`jax.nn.dot_product_attention`, which is exact in the outputs but not in every gradient on
jax 0.10.2 (tests/test_flax_pairs.py).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, EMBED, HEADS, MLP, BATCH, LENGTH = 16, 8, 2, 16, 2, 4
DROPOUT = 0.25
RULES = (("vocab", None), ("embed", None), ("heads", "model"), ("kv", None), ("mlp", "model"))
BLOCKS = ("block_0", "block_1")
KERNEL = nn.initializers.lecun_normal()


def linen_attention(query, key, value, *, scale: float = 1.0, is_causal=False, module=None, **kw):
    """Linen's attention kernel for the NNX side (Linen passes an `attention_fn` only the
    keywords its signature names); `scale` != 1 is the seeded scale bug."""
    del is_causal, module
    return nn.dot_product_attention(query * scale, key, value, **kw)


def tokens(offset: int = 0) -> jnp.ndarray:
    return (jnp.arange(BATCH * LENGTH).reshape(BATCH, LENGTH) * 5 + offset) % VOCAB


# ------------------------------------------------------------------ Linen


def _logical(*names: str):
    return nn.with_logical_partitioning(KERNEL, names)


class LinenBlock(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        h = nn.LayerNorm(name="norm_attn")(x)
        h = nn.MultiHeadDotProductAttention(
            HEADS,
            qkv_features=EMBED,
            out_features=EMBED,
            kernel_init=_logical("embed", "heads", "kv"),
            out_kernel_init=_logical("heads", "kv", "embed"),
            decode=self.decode,
            name="attn",
        )(h, mask=mask, deterministic=True)
        x = x + nn.Dropout(DROPOUT, name="drop_attn")(h, deterministic=deterministic)
        h = nn.LayerNorm(name="norm_mlp")(x)
        h = nn.Dense(MLP, kernel_init=_logical("embed", "mlp"), name="up")(h)
        h = nn.Dropout(DROPOUT, name="drop_mlp")(nn.relu(h), deterministic=deterministic)
        self.sow("intermediates", "mlp_hidden", h)
        h = nn.Dense(EMBED, kernel_init=_logical("mlp", "embed"), name="down")(h)
        return x + h


class LinenModel(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, token_ids, deterministic: bool = True):
        embed = nn.Embed(
            VOCAB,
            EMBED,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(1.0), ("vocab", "embed")
            ),
            name="embed",
        )
        x = nn.Dropout(DROPOUT, name="drop_embed")(embed(token_ids), deterministic=deterministic)
        mask = None if self.decode else nn.make_causal_mask(token_ids)
        for name in BLOCKS:
            x = LinenBlock(self.decode, name=name)(x, mask, deterministic)
            self.sow("intermediates", f"{name}_out", x)
        return embed.attend(nn.LayerNorm(name="norm")(x))


# ------------------------------------------------------------------ NNX


def _meta(*names: str) -> dict:
    return {"out_sharding": names}


class NNXBlock(nnx.Module):
    def __init__(
        self,
        *,
        rngs: nnx.Rngs,
        scale: float = 1.0,
        drop_attn: bool = True,
        swap: bool = False,
        cut: bool = False,
    ):
        self.swap = swap  # the seeded swapped name: each LayerNorm used in the other's place
        self.cut = cut  # the seeded backward-only bug: no gradient through the MLP's hidden
        self.norm_attn = nnx.LayerNorm(EMBED, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS,
            EMBED,
            qkv_features=EMBED,
            out_features=EMBED,
            kernel_metadata=_meta("embed", "heads", "kv"),
            out_kernel_metadata=_meta("heads", "kv", "embed"),
            attention_fn=functools.partial(linen_attention, scale=scale),
            decode=False,
            deterministic=True,
            rngs=rngs,
        )
        self.drop_attn = nnx.Dropout(DROPOUT if drop_attn else 0.0, rngs=rngs)
        self.norm_mlp = nnx.LayerNorm(EMBED, rngs=rngs)
        self.up = nnx.Linear(EMBED, MLP, kernel_metadata=_meta("embed", "mlp"), rngs=rngs)
        self.drop_mlp = nnx.Dropout(DROPOUT, rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, kernel_metadata=_meta("mlp", "embed"), rngs=rngs)

    def __call__(self, x, mask):
        norm_attn, norm_mlp = (
            (self.norm_mlp, self.norm_attn)
            if self.swap
            else (
                self.norm_attn,
                self.norm_mlp,
            )
        )
        x = x + self.drop_attn(self.attn(norm_attn(x), mask=mask))
        h = self.drop_mlp(nnx.relu(self.up(norm_mlp(x))))
        h = jax.lax.stop_gradient(h) if self.cut else h
        self.sow(nnx.Intermediate, "mlp_hidden", h)
        return x + self.down(h)


class NNXModel(nnx.Module):
    """The port. Seeded bugs: `scale` in block 1's attention, `drop_attn=False` (block 1
    forgets its attention dropout), `swap` (block 0 uses each LayerNorm in the other's place),
    `cut` (block 1's MLP passes no gradient back through its hidden layer: the same forward).
    `embed_name` is the embedding's attribute (`wte` needs a rename, and sorts after `norm`)."""

    embed_name = "embed"

    def __init__(
        self,
        *,
        rngs: nnx.Rngs,
        decode: bool = False,
        scale: float = 1.0,
        drop_attn: bool = True,
        swap: bool = False,
        cut: bool = False,
    ):
        embed = nnx.Embed(
            VOCAB,
            EMBED,
            embedding_init=nnx.initializers.normal(1.0),
            embedding_metadata=_meta("vocab", "embed"),
            rngs=rngs,
        )
        setattr(self, self.embed_name, embed)
        self.drop_embed = nnx.Dropout(DROPOUT, rngs=rngs)
        self.block_0 = NNXBlock(rngs=rngs, swap=swap)
        self.block_1 = NNXBlock(rngs=rngs, scale=scale, drop_attn=drop_attn, cut=cut)
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)
        self.decode = decode

    def init_cache(self) -> None:
        for name in BLOCKS:
            getattr(self, name).attn.init_cache((BATCH, LENGTH, EMBED))
            getattr(self, name).attn.decode = True

    def __call__(self, token_ids):
        embed = getattr(self, self.embed_name)
        x = self.drop_embed(embed(token_ids))
        mask = None if self.decode else nn.make_causal_mask(token_ids)
        for name in BLOCKS:
            x = getattr(self, name)(x, mask)
            self.sow(nnx.Intermediate, f"{name}_out", x)
        return embed.attend(self.norm(x))


def nnx_model(seed: int = 0, **kwargs) -> NNXModel:
    """The port (with `kwargs`' seeded bugs), its cache made when it decodes."""
    with nnx.use_eager_sharding(False):
        model = NNXModel(rngs=nnx.Rngs(seed), **kwargs)
    if kwargs.get("decode"):
        model.init_cache()
    return model


class NNXRenamedModel(NNXModel):
    """The port with the embedding named as GPT-2 names it: needs `RENAMES`."""

    embed_name = "wte"


RENAMES = {("embed",): ("wte",)}
