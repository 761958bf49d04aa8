"""A corpus of user-style Linen modules, their hand-written NNX ports, and seeded bugs (issue 53).

Written as a Flax user writes a model and ports it: idiomatic Linen (`@nn.compact` and `setup`,
explicit `name=`s, a `train` argument, `self.variable('cache', ...)`, `nn.scan`) and idiomatic
NNX (`__init__(..., *, rngs)`, mode attributes, `nnx.Cache`, `nnx.vmap` + `nnx.scan`), on tiny
shapes. Each `UserPair` holds the Linen module, its correct port, the calls that gate it, and
`bugs`: small variants of the port (a subclass overriding one line, or one submodule replaced),
each with the place the report must name (`Bug.blamed`) and the checks that show it.

`tests/test_user_pairs.py` runs them; its docstring holds the table of what the harness names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from parity.pairs import Call, Conversion, Randomness

# How the report names a bug (`Bug.by`):
LAYERS = "layers"  # the drill-down's first divergence (`layers` result's `where`)
RANDOM = "random"  # the `random` check's site (`train/drop: zero fraction mean` -> `train/drop`)
GRADS = "grads"  # the `grads` result's `where`: a bug in the backward pass only
STATE = "state"  # the `forward` result's first failing record: a state path (batch_stats, cache)
ROUNDTRIP = "roundtrip"  # the `roundtrip` result's `where`: weights that do not convert


@dataclasses.dataclass(frozen=True)
class Bug:
    """A seeded bug: `port()` builds the broken NNX module; the report must name `blamed`,
    read as `by` says, running `checks` (each bug runs only what shows it)."""

    port: Callable[[], nnx.Module]
    blamed: str
    by: str = LAYERS
    checks: tuple[str, ...] = ("forward",)
    options: Mapping[str, Any] | None = None  # replaces the pair's (`conversion=`)
    call: str | None = None  # the call the drill-down must find it in (pairs of several calls)


@dataclasses.dataclass(frozen=True)
class UserPair:
    linen: Callable[[], nn.Module]
    port: Callable[[], nnx.Module]
    calls: Sequence[Call]
    bugs: Mapping[str, Bug]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def rngs() -> nnx.Rngs:
    return nnx.Rngs(0)


# ------------------------------------------------------------------ an MLP with dropout

F = 8  # features = hidden: a square first kernel (a transposed one still fits)
MLP_X = jax.random.normal(jax.random.key(1), (4, F))


class LinenMLP(nn.Module):
    """Pre-norm residual MLP: `x + fc2(drop(gelu(fc1(ln(x)))))`."""

    hidden: int = F
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, *, train: bool):
        h = nn.LayerNorm(name="ln")(x)
        h = nn.gelu(nn.Dense(self.hidden, name="fc1")(h))
        h = nn.Dropout(self.rate, deterministic=not train, name="drop")(h)
        return x + nn.Dense(x.shape[-1], name="fc2")(h)


class NNXMLP(nnx.Module):
    def __init__(self, features: int = F, hidden: int = F, rate: float = 0.5, *, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(features, rngs=rngs)
        self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, features, rngs=rngs)

    def __call__(self, x):
        h = nnx.gelu(self.fc1(self.ln(x)))
        return x + self.fc2(self.drop(h))


class TransposedLinear(nnx.Linear):
    """Applies its kernel transposed (a PyTorch habit: `x @ W.T`)."""

    def __call__(self, x):
        return x @ self.kernel[...].T + self.bias[...]


class MLPTransposedFc1(NNXMLP):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.fc1 = TransposedLinear(F, F, rngs=rngs)


class MLPNoResidual(NNXMLP):
    def __call__(self, x):
        return self.fc2(self.drop(nnx.gelu(self.fc1(self.ln(x)))))  # Linen: x + ...


class MLPDropoutInEval(NNXMLP):
    def __call__(self, x):
        h = nnx.gelu(self.fc1(self.ln(x)))
        return x + self.fc2(self.drop(h, deterministic=False))  # ignores the eval switch


class MLPDropoutRate(NNXMLP):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)  # Linen: 0.5


class MLPFrozenFc1(NNXMLP):
    def __call__(self, x):
        h = nnx.gelu(jax.lax.stop_gradient(self.fc1(self.ln(x))))  # forward unchanged
        return x + self.fc2(self.drop(h))


MLP = UserPair(
    linen=LinenMLP,
    port=lambda: NNXMLP(rngs=rngs()),
    calls=[
        # Each side draws from its own streams (Linen `rngs={'dropout': ...}`, NNX its Rngs):
        # the train call is compared in distribution (`random`), eval exactly.
        Call(
            (MLP_X,),
            linen={"train": True},
            nnx_attributes={"deterministic": False},
            randomness=Randomness(draws=32),
            name="train",
        ),
        Call((MLP_X,), linen={"train": False}, nnx_attributes={"deterministic": True}, name="eval"),
    ],
    bugs={
        "transposed fc1 kernel": Bug(lambda: MLPTransposedFc1(rngs=rngs()), "fc1"),
        "missing residual": Bug(lambda: MLPNoResidual(rngs=rngs()), "output"),
        "dropout in eval": Bug(lambda: MLPDropoutInEval(rngs=rngs()), "drop"),
        "dropout rate": Bug(
            lambda: MLPDropoutRate(rngs=rngs()), "train/drop", by=RANDOM, checks=("random",)
        ),
        "fc1 detached (backward only)": Bug(
            lambda: MLPFrozenFc1(rngs=rngs()), "fc1", by=GRADS, checks=("forward", "grads")
        ),
    },
)


# ------------------------------------------------------------------ a CNN with BatchNorm

C = 4
IMAGES = jax.random.normal(jax.random.key(2), (2, 6, 6, 3))


class LinenCNN(nn.Module):
    """conv-bn-relu, strided conv-bn-relu, global average pool, dense head (`setup` style)."""

    classes: int = 4

    def setup(self):
        self.conv1 = nn.Conv(C, (3, 3), padding="SAME")
        self.bn1 = nn.BatchNorm(momentum=0.9)
        self.conv2 = nn.Conv(2 * C, (3, 3), strides=2)
        self.bn2 = nn.BatchNorm(momentum=0.9)
        self.head = nn.Dense(self.classes)

    def __call__(self, x, train: bool):
        h = nn.relu(self.bn1(self.conv1(x), use_running_average=not train))
        h = nn.relu(self.bn2(self.conv2(h), use_running_average=not train))
        return self.head(h.mean(axis=(1, 2)))


class NNXCNN(nnx.Module):
    def __init__(self, channels: int = 3, classes: int = 4, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(channels, C, (3, 3), padding="SAME", rngs=rngs)
        self.bn1 = nnx.BatchNorm(C, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(C, 2 * C, (3, 3), strides=2, rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * C, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(2 * C, classes, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn1(self.conv1(x)))
        h = nnx.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean(axis=(1, 2)))


class CNNMomentum(NNXCNN):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * C, momentum=0.99, rngs=rngs)  # Linen: 0.9


class CNNValidPadding(NNXCNN):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.conv1 = nnx.Conv(3, C, (3, 3), padding="VALID", rngs=rngs)  # Linen: SAME


class FlippedConv(nnx.Conv):
    """A true convolution (the kernel flipped in space, PyTorch-port style), where Flax
    correlates; stride 2, SAME padding, as `conv2`."""

    def __call__(self, x):
        kernel = self.kernel[...][::-1, ::-1]
        numbers = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(x, kernel, (2, 2), "SAME", dimension_numbers=numbers)
        return y + self.bias[...]


class CNNFlippedConv2(NNXCNN):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.conv2 = FlippedConv(C, 2 * C, (3, 3), strides=2, rngs=rngs)


class CNNBatchStatsInEval(NNXCNN):
    def __call__(self, x):
        h = nnx.relu(self.bn1(self.conv1(x), use_running_average=False))  # ignores eval
        h = nnx.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean(axis=(1, 2)))


TRAIN_BN = {"use_running_average": False}
EVAL_BN = {"use_running_average": True}
CNN = UserPair(
    linen=LinenCNN,
    port=lambda: NNXCNN(rngs=rngs()),
    calls=[
        Call((IMAGES,), linen={"train": True}, nnx_attributes=TRAIN_BN, name="train"),
        Call((IMAGES * 0.5,), linen={"train": False}, nnx_attributes=EVAL_BN, name="eval"),
    ],
    bugs={
        "BatchNorm momentum (bn2)": Bug(
            lambda: CNNMomentum(rngs=rngs()),
            "linen-init/train/state/batch_stats/bn2/mean",
            by=STATE,
        ),
        "VALID padding (conv1)": Bug(lambda: CNNValidPadding(rngs=rngs()), "conv1"),
        "flipped kernel (conv2)": Bug(lambda: CNNFlippedConv2(rngs=rngs()), "conv2", call="train"),
        "batch statistics in eval (bn1)": Bug(
            lambda: CNNBatchStatsInEval(rngs=rngs()), "bn1", call="eval"
        ),
    },
)


# ------------------------------------------------------------------ attention with a KV cache

E, H, DH, MAX_LEN, B = 8, 2, 4, 4, 2
TOKENS = jax.random.normal(jax.random.key(3), (B, 2, E))
DECODE = [Call((TOKENS[:, t : t + 1],), name=f"step{t}") for t in range(2)]


def _attend(q, k, v, filled, scale):
    """One query step against the whole cache; positions >= `filled` masked (finite)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = jnp.where(jnp.arange(k.shape[1]) < filled, scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class LinenCachedAttention(nn.Module):
    """Decoding self-attention: each call appends its keys and values to the cache."""

    num_heads: int = H
    head_dim: int = DH
    max_len: int = MAX_LEN

    @nn.compact
    def __call__(self, x):
        b, t, e = x.shape
        heads = (self.num_heads, self.head_dim)
        q = nn.DenseGeneral(heads, name="query")(x)
        k = nn.DenseGeneral(heads, name="key")(x)
        v = nn.DenseGeneral(heads, name="value")(x)
        shape = (b, self.max_len, *heads)
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, x.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, x.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        i = index.value
        k = jax.lax.dynamic_update_slice(cached_key.value, k, (0, i, 0, 0))
        v = jax.lax.dynamic_update_slice(cached_value.value, v, (0, i, 0, 0))
        if not self.is_initializing():
            cached_key.value, cached_value.value, index.value = k, v, i + t
        out = _attend(q, k, v, i + t, self.head_dim**-0.5)
        return nn.DenseGeneral(e, axis=(-2, -1), name="out")(out)


class LinenDecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + LinenCachedAttention(name="attn")(nn.LayerNorm(name="ln")(x))


class NNXCachedAttention(nnx.Module):
    def __init__(self, embed: int, batch: int, *, rngs: nnx.Rngs):
        heads = (H, DH)
        self.query = nnx.LinearGeneral(embed, heads, rngs=rngs)
        self.key = nnx.LinearGeneral(embed, heads, rngs=rngs)
        self.value = nnx.LinearGeneral(embed, heads, rngs=rngs)
        self.out = nnx.LinearGeneral(heads, embed, axis=(-2, -1), rngs=rngs)
        self.cached_key = nnx.Cache(jnp.zeros((batch, MAX_LEN, *heads)))
        self.cached_value = nnx.Cache(jnp.zeros((batch, MAX_LEN, *heads)))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def append(self, k, v, at):
        """The cache with this step's keys and values written at `at`."""
        k = jax.lax.dynamic_update_slice(self.cached_key[...], k, (0, at, 0, 0))
        v = jax.lax.dynamic_update_slice(self.cached_value[...], v, (0, at, 0, 0))
        self.cached_key[...], self.cached_value[...] = k, v
        return k, v

    def __call__(self, x):
        # Linen's order (query, key, value): the gradients reaching `x` add up in the order
        # its uses were traced; another order is a rounding away from bit-exact.
        q, k, v = self.query(x), self.key(x), self.value(x)
        i, t = self.cache_index[...], x.shape[1]
        k, v = self.append(k, v, i)
        self.cache_index[...] = i + t
        return self.out(_attend(q, k, v, i + t, DH**-0.5))


class NNXDecoderBlock(nnx.Module):
    def __init__(self, embed: int = E, batch: int = B, *, rngs: nnx.Rngs, attention=None):
        self.ln = nnx.LayerNorm(embed, rngs=rngs)
        self.attn = (attention or NNXCachedAttention)(embed, batch, rngs=rngs)

    def __call__(self, x):
        return x + self.attn(self.ln(x))


class IndexNotAdvanced(NNXCachedAttention):
    def __call__(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        i, t = self.cache_index[...], x.shape[1]
        k, v = self.append(k, v, i)  # cache_index never moves
        return self.out(_attend(q, k, v, i + t, DH**-0.5))


class ScaleByHeadDim(NNXCachedAttention):
    def __call__(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        i, t = self.cache_index[...], x.shape[1]
        k, v = self.append(k, v, i)
        self.cache_index[...] = i + t
        return self.out(_attend(q, k, v, i + t, DH**-1.0))  # Linen: DH**-0.5


def block(attention) -> Callable[[], nnx.Module]:
    return lambda: NNXDecoderBlock(rngs=rngs(), attention=attention)


ATTENTION = UserPair(
    linen=LinenDecoderBlock,
    port=block(NNXCachedAttention),
    calls=DECODE,
    bugs={
        "cache index not advanced": Bug(
            block(IndexNotAdvanced), "linen-init/step0/state/cache/attn/cache_index", by=STATE
        ),
        # One cached position at step 0: the softmax is 1 whatever the scale.
        "scores scaled by 1/head_dim": Bug(block(ScaleByHeadDim), "attn/out", call="step1"),
    },
)


# ------------------------------------------------------------------ a scanned stack

L = D = 4  # as many layers as features: a scan over the wrong axis still fits
STACK_X = jax.random.normal(jax.random.key(4), (2, D))


class LinenResidualBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.tanh(nn.Dense(D, name="dense")(nn.LayerNorm(name="ln")(x))), None


class LinenScannedStack(nn.Module):
    """`L` residual blocks under `nn.scan` (weights stacked on axis 0), then a final norm."""

    def setup(self):
        scanned = nn.scan(
            LinenResidualBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=L,
        )
        self.layers = scanned()
        self.final_ln = nn.LayerNorm()

    def __call__(self, x):
        return self.final_ln(self.layers(x, None)[0])


class NNXResidualBlock(nnx.Module):
    def __init__(self, epsilon: float = 1e-6, *, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(D, epsilon=epsilon, rngs=rngs)
        self.dense = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(self.ln(x)))


class NNXScannedStack(nnx.Module):
    scan_axis = 0

    def __init__(self, *, rngs: nnx.Rngs, epsilon: float = 1e-6):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NNXResidualBlock(epsilon, rngs=rngs)

        self.layers = create(rngs)
        self.final_ln = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, self.scan_axis), out_axes=nnx.Carry)
        def step(x, layer):
            return layer(x)

        return self.final_ln(step(x, self.layers))


class StackScanAxis1(NNXScannedStack):
    scan_axis = 1  # the weights are stacked on axis 0


class StackFinalNormEpsilon(NNXScannedStack):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.final_ln = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)  # Linen: 1e-6


STACK = UserPair(
    linen=LinenScannedStack,
    port=lambda: NNXScannedStack(rngs=rngs()),
    calls=[Call((STACK_X,))],
    bugs={
        "scan over the wrong axis": Bug(lambda: StackScanAxis1(rngs=rngs()), "layers"),
        "LayerNorm epsilon inside the stack": Bug(
            lambda: NNXScannedStack(rngs=rngs(), epsilon=1e-5), "layers/ln"
        ),
        "final LayerNorm epsilon": Bug(lambda: StackFinalNormEpsilon(rngs=rngs()), "final_ln"),
    },
)


# ------------------------------------------------------------------ a fused-QKV attention

SENTENCE = jax.random.normal(jax.random.key(5), (B, 3, E))
QKV = ("query", "key", "value")


def _causal_attend(q, k, v):
    """Causal multi-head attention on [batch, time, heads, head_dim]; a finite mask."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    t = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class LinenSelfAttention(nn.Module):
    """Separate `query`, `key`, `value` projections (`setup` style)."""

    num_heads: int = H

    def setup(self):
        self.query, self.key, self.value = (nn.Dense(E) for _ in QKV)
        self.out = nn.Dense(E)

    def __call__(self, x):
        b, t, e = x.shape
        heads = lambda y: y.reshape(b, t, self.num_heads, e // self.num_heads)
        y = _causal_attend(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)))
        return self.out(y.reshape(b, t, e))


class NNXFusedAttention(nnx.Module):
    """One fused `qkv` projection, kernel [E, 3E]: query, key, value side by side."""

    def __init__(self, embed: int = E, num_heads: int = H, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(embed, 3 * embed, rngs=rngs)
        self.out = nnx.Linear(embed, embed, rngs=rngs)

    def heads(self, qkv):
        b, t, _ = qkv.shape
        return [y.reshape(b, t, self.num_heads, -1) for y in jnp.split(qkv, 3, axis=-1)]

    def __call__(self, x):
        y = _causal_attend(*self.heads(self.qkv(x)))
        return self.out(y.reshape(x.shape))


def fuse(variables, order=QKV):
    """Linen variables -> the NNX state: the three kernels and biases concatenated."""
    params = variables["params"]
    return {
        "qkv": {
            "kernel": jnp.concatenate([params[n]["kernel"] for n in order], axis=1),
            "bias": jnp.concatenate([params[n]["bias"] for n in order], axis=0),
        },
        "out": params["out"],
    }


def unfuse(state, order=QKV):
    """The NNX state -> Linen variables: `fuse` undone."""
    kernels = jnp.split(state["qkv"]["kernel"], 3, axis=1)
    biases = jnp.split(state["qkv"]["bias"], 3, axis=0)
    params = {n: {"kernel": k, "bias": b} for n, k, b in zip(order, kernels, biases, strict=True)}
    return {"params": params | {"out": state["out"]}}


FUSED = Conversion(to_nnx=fuse, to_linen=unfuse)
KQV = ("key", "query", "value")


class InterleavedHeads(NNXFusedAttention):
    def heads(self, qkv):
        b, t, _ = qkv.shape  # Megatron's per-head [q, k, v] layout; the weights are not in it
        q, k, v = jnp.split(qkv.reshape(b, t, self.num_heads, -1), 3, axis=-1)
        return q, k, v


class TransposedOut(NNXFusedAttention):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.out = TransposedLinear(E, E, rngs=rngs)


class QKVWithoutBias(NNXFusedAttention):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.qkv = nnx.Linear(E, 3 * E, use_bias=False, rngs=rngs)


FUSED_QKV = UserPair(
    linen=LinenSelfAttention,
    port=lambda: NNXFusedAttention(rngs=rngs()),
    calls=[Call((SENTENCE,))],
    # One [E, 3E] matmul rounds unlike three [E, E] ones (a float32 ulp), and the gradient of
    # the key's bias is zero up to rounding (softmax ignores a shift of the scores).
    options={"conversion": FUSED, "tolerance": (1e-6, 1e-6)},
    bugs={
        "interleaved head split": Bug(lambda: InterleavedHeads(rngs=rngs()), "out"),
        "transposed out kernel": Bug(lambda: TransposedOut(rngs=rngs()), "out"),
        # The user's hook: fuses key, query, value in that order (and splits them back alike).
        "conversion fuses k, q, v": Bug(
            lambda: NNXFusedAttention(rngs=rngs()),
            "out",
            options={
                "conversion": Conversion(lambda v: fuse(v, KQV), lambda s: unfuse(s, KQV)),
                "tolerance": (1e-6, 1e-6),
            },
        ),
        # ... or fuses in one order and splits in another: not a round trip.
        "conversion not its own inverse": Bug(
            lambda: NNXFusedAttention(rngs=rngs()),
            "key",
            by=ROUNDTRIP,
            checks=("roundtrip",),
            options={"conversion": Conversion(fuse, lambda s: unfuse(s, KQV))},
        ),
        "qkv without bias": Bug(
            lambda: QKVWithoutBias(rngs=rngs()), "qkv/bias", by=ROUNDTRIP, checks=("roundtrip",)
        ),
    },
)


PAIRS: dict[str, UserPair] = {
    "mlp": MLP,
    "cnn": CNN,
    "attention": ATTENTION,
    "stack": STACK,
    "fused_qkv": FUSED_QKV,
}
