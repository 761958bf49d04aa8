"""Flax's own Linen/NNX pairs through `compare_modules`: each passes out of the box or with the
renames map written next to it, and a deliberately broken variant of each fails at the right
place. Where Flax's Linen and NNX modules really differ, the test shows the difference.

| pair | needs |
| --- | --- |
| Dense/Linear, Embed (lookup, `attend`), LayerNorm, RMSNorm, GroupNorm, Conv, Einsum | nothing |
| MultiHeadDotProductAttention/MultiHeadAttention | `decode=False` on NNX; the mask as a keyword; |
| | bit-exact gradients on jax 0.10.2: Linen's kernel as NNX's `attention_fn` |
| the same, decoding | `linen_variables` from Linen's `init` on the full input; `init_cache` |
| | on NNX; `cache` <-> `nnx.Cache` (default map) |
| BatchNorm | per-call `use_running_average`; `batch_stats` <-> `nnx.BatchStat` (default map) |
| Dropout | `deterministic` on Linen only (NNX defaults to train mode); `Randomness` |
| LSTMCell | renames `if` -> `if_` |
| SimpleCell | renames `i` -> `dense_i`, `h` -> `dense_h` |
| GRUCell, OptimizedLSTMCell | differ: NNX fuses the gates (and GRU has no `hn` bias) |
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from parity import pairs
from parity.pairs import Call, Randomness, compare_modules

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

B, T, D, H = 2, 4, 8, 2
X = jax.random.normal(jax.random.key(1), (B * T, D))
SEQ = X.reshape(B, T, D)
NUMERIC = ["roundtrip", "forward", "grads"]


def rngs() -> nnx.Rngs:
    return nnx.Rngs(0)


def failing(results) -> dict[str, str]:
    return {r.name: r.where for r in results if not r.passed}


def passes(results) -> None:
    __tracebackhide__ = True
    from parity.pairs import format_report

    assert not failing(results), format_report(results)
    assert all(r.value == 0.0 for r in results), format_report(results)


# ------------------------------------------------------------------ out of the box


STOCK = {
    "dense": (
        lambda: nn.Dense(6),
        lambda **kw: nnx.Linear(D, 6, rngs=rngs(), **kw),
        X,
        {"use_bias": False},
        "roundtrip",
    ),
    "layernorm": (
        lambda: nn.LayerNorm(),
        lambda **kw: nnx.LayerNorm(D, rngs=rngs(), **kw),
        X,
        {"use_fast_variance": False},
        "forward",
    ),
    "rmsnorm": (
        lambda: nn.RMSNorm(),
        lambda **kw: nnx.RMSNorm(D, rngs=rngs(), **kw),
        X,
        {"epsilon": 1e-3},
        "forward",
    ),
    "groupnorm": (
        lambda: nn.GroupNorm(num_groups=4),
        lambda num_groups=4: nnx.GroupNorm(D, num_groups=num_groups, rngs=rngs()),
        SEQ,
        {"num_groups": 2},
        "forward",
    ),
    "conv": (
        lambda: nn.Conv(4, (3,), padding="SAME"),
        lambda padding="SAME": nnx.Conv(D, 4, (3,), padding=padding, rngs=rngs()),
        SEQ,
        {"padding": "VALID"},
        "forward",
    ),
    "einsum": (
        lambda: nn.Einsum(shape=(D, H, 3), einsum_str="btd,dhk->bthk"),
        lambda bias_shape=(H, 3): nnx.Einsum("btd,dhk->bthk", (D, H, 3), bias_shape, rngs=rngs()),
        SEQ,
        {"bias_shape": None},
        "roundtrip",
    ),
}


@pytest.mark.parametrize("name", STOCK)
def test_stock_pairs_are_bit_exact_and_a_broken_variant_fails_where_it_differs(name):
    linen, port, x, broken, where = STOCK[name]
    passes(compare_modules(linen(), port(), x))
    results = compare_modules(linen(), port(**broken), x, checks=NUMERIC)
    assert next(iter(failing(results))) == where, failing(results)


def test_embed_lookup_and_attend():
    ids = jnp.arange(B * T).reshape(B, T) % 10
    linen, port = nn.Embed(10, D), nnx.Embed(10, D, rngs=rngs())
    calls = [Call((ids,), name="lookup"), Call((X,), method="attend", name="attend")]
    passes(compare_modules(linen, port, calls))
    # NNX resolves `dtype=None` to the parameter dtype at construction; Linen keeps None, so
    # `attend` on bfloat16 weights returns float32 from Linen and bfloat16 from NNX.
    linen16 = nn.Embed(10, D, param_dtype=jnp.bfloat16)
    port16 = nnx.Embed(10, D, param_dtype=jnp.bfloat16, rngs=rngs())
    attend = Call((X,), method="attend")
    results = compare_modules(linen16, port16, attend, checks=["forward"])
    assert failing(results) == {"forward": "linen-init/outputs", "layers": "output"}
    explicit = nnx.Embed(10, D, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=rngs())
    passes(compare_modules(linen16, explicit, attend, checks=NUMERIC))


# ------------------------------------------------------------------ keyword calls and state


def linen_attention(query, key, value, *, is_causal=False, module=None, **kwargs):
    """Linen's attention kernel for NNX's `attention_fn` (NNX's own default takes
    `jax.nn.dot_product_attention` when there is no dropout and no sown weights)."""
    assert not is_causal and module is None
    return nn.dot_product_attention(query, key, value, **kwargs)


def nnx_attention(**kwargs) -> nnx.MultiHeadAttention:
    """`decode` defaults to None in NNX and must be given."""
    options = {"qkv_features": D, "out_features": D, "decode": False, "rngs": rngs()}
    return nnx.MultiHeadAttention(H, D, **(options | kwargs))


def test_attention_with_a_causal_mask_as_keyword():
    """Out of the box the two attentions run different kernels: NNX's default takes
    `jax.nn.dot_product_attention`, Linen's the einsum path. The outputs are bit-exact on
    both stacks (float32, CPU), the gradients only on jax 0.12 (jax 0.10.2: up to 8.8e-8
    relative, half a float32 ulp). Given Linen's kernel, NNX is bit-exact in everything."""
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    linen = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, out_features=D)
    call = Call((SEQ,), {"mask": mask, "deterministic": True})
    passes(compare_modules(linen, nnx_attention(), call, checks=["roundtrip", "forward"]))
    passes(compare_modules(linen, nnx_attention(attention_fn=linen_attention), call))
    # The mask given to Linen only: NNX attends to every position.
    unmasked = Call((SEQ,), {"deterministic": True}, linen={"mask": mask})
    results = compare_modules(linen, nnx_attention(), unmasked, checks=["forward"])
    assert failing(results) == {"forward": "linen-init/outputs", "layers": "out"}


@pytest.mark.slow
def test_attention_decoding_compares_the_cache_after_every_step():
    linen = nn.MultiHeadDotProductAttention(
        num_heads=H, qkv_features=D, out_features=D, decode=True
    )
    variables = linen.init(jax.random.key(0), SEQ)  # the full input sizes Linen's cache
    port = nnx_attention(decode=True, attention_fn=linen_attention)
    port.init_cache(SEQ.shape)
    steps = [Call((SEQ[:, t : t + 1],), name=f"step{t}") for t in range(3)]
    results = compare_modules(linen, port, steps, linen_variables=variables, checks=NUMERIC)
    passes(results)
    tensors = [d["tensor"] for d in results[1].details]
    assert "linen-init/step2/state/cache/cached_key" in tensors
    assert "linen-init/step2/state/cache/cache_index" in tensors


TRAIN_EVAL = [
    Call((X,), {"use_running_average": False}, name="train"),
    Call((X * 2.0,), {"use_running_average": False}, name="train again"),
    Call((X,), {"use_running_average": True}, name="eval"),
]


def test_batchnorm_train_then_eval_compares_the_running_averages():
    results = compare_modules(nn.BatchNorm(), nnx.BatchNorm(D, rngs=rngs()), TRAIN_EVAL)
    passes(results)
    tensors = [d["tensor"] for d in results[1].details]
    assert tensors[:3] == [
        "linen-init/train/outputs",
        "linen-init/train/state/batch_stats/mean",
        "linen-init/train/state/batch_stats/var",
    ]
    # Another momentum: the train-mode outputs agree (they use the batch's statistics), the
    # running averages written by the first call do not (nor, through the eval call that
    # reads them, the gradients).
    wrong = compare_modules(
        nn.BatchNorm(), nnx.BatchNorm(D, momentum=0.9, rngs=rngs()), TRAIN_EVAL, checks=NUMERIC
    )
    assert failing(wrong) == {
        "forward": "linen-init/train/state/batch_stats/mean",
        "grads": "linen-init/grads/bias",
        "layers": "output",  # one layer: its own output is its only site
    }
    first = next(d for d in wrong[1].details if not d["passed"])
    assert first["tensor"] == "linen-init/train/state/batch_stats/mean"


def test_batchnorm_mode_switched_on_the_nnx_module():
    """NNX's own mode switch (`use_running_average` set on the module, as `nnx.view` and
    `Module.eval()` do) against Linen's call argument."""
    calls = [
        Call((X,), linen={"use_running_average": False}, name="train"),
        Call(
            (X,),
            linen={"use_running_average": True},
            nnx_attributes={"use_running_average": True},
            name="eval",
        ),
    ]
    passes(compare_modules(nn.BatchNorm(), nnx.BatchNorm(D, rngs=rngs()), calls, checks=NUMERIC))
    # Without the switch the NNX module stays in train mode (its default).
    calls[1] = Call((X,), linen={"use_running_average": True}, name="eval")
    results = compare_modules(
        nn.BatchNorm(), nnx.BatchNorm(D, rngs=rngs()), calls, checks=["forward"]
    )
    assert failing(results) == {"forward": "linen-init/eval/outputs", "layers": "output"}
    # ... and updates the running averages where Linen leaves them.
    failed = [d["tensor"] for d in results[0].details if not d["passed"]]
    assert "linen-init/eval/state/batch_stats/mean" in failed


# ------------------------------------------------------------------ dropout

ALIGNED = Randomness(linen_arg="rng", nnx_arg="rngs", draws=32)


def dropout_calls(randomness: Randomness) -> list[Call]:
    return [
        Call((X,), linen={"deterministic": False}, randomness=randomness, name="train"),
        Call((X,), {"deterministic": True}, name="eval"),
    ]


def test_dropout_with_the_same_key_on_both_sides_is_bit_exact():
    results = compare_modules(nn.Dropout(0.5), nnx.Dropout(0.5), dropout_calls(ALIGNED))
    passes(results)
    assert [r.name for r in results][-1] == "random"
    assert failing(compare_modules(nn.Dropout(0.5), nnx.Dropout(0.25), dropout_calls(ALIGNED))) == {
        "forward": "linen-init/train/outputs",
        "grads": "linen-init/input_grads/train/0",  # no parameters: the input's gradient
        "random": "train/draws",
        "layers": "output",
    }


def test_dropout_with_each_side_drawing_its_own_keys_is_compared_in_distribution():
    stream = Randomness()  # Linen: rngs={'dropout': key}; NNX: the module's own Rngs
    own = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
    results = compare_modules(nn.Dropout(0.5), own, dropout_calls(stream))
    passes(results)
    assert "distributions compared" in results[-1].message
    wrong_rate = compare_modules(
        nn.Dropout(0.5), nnx.Dropout(0.4, rngs=nnx.Rngs(dropout=1)), dropout_calls(stream)
    )
    assert failing(wrong_rate) == {"random": "train/outputs: zero fraction mean"}


# ------------------------------------------------------------------ recurrent cells


def carry(shape_h: int, lstm: bool):
    zeros = jnp.zeros((B, shape_h))
    return (zeros, zeros + 0.5) if lstm else zeros + 0.5


def test_lstm_cell_needs_one_rename():
    call = Call((carry(6, True), X[:B]))
    linen, port = nn.LSTMCell(6), nnx.LSTMCell(D, 6, rngs=rngs())
    without = compare_modules(linen, port, call, checks=["roundtrip"])
    assert "if/kernel: missing on the NNX side" in without[0].message
    passes(compare_modules(linen, port, call, renames={("if",): ("if_",)}))


def test_simple_cell_needs_renames():
    call = Call((carry(6, False), X[:B]))
    renames = {("i",): ("dense_i",), ("h",): ("dense_h",)}
    passes(
        compare_modules(nn.SimpleCell(6), nnx.SimpleCell(D, 6, rngs=rngs()), call, renames=renames)
    )


@pytest.mark.parametrize(
    "linen,port,missing",
    [
        (nn.GRUCell(6), nnx.GRUCell(D, 6, rngs=rngs()), "hn/bias: missing on the NNX side"),
        (
            nn.OptimizedLSTMCell(6),
            nnx.OptimizedLSTMCell(D, 6, rngs=rngs()),
            "hi/kernel: missing on the NNX side",
        ),
    ],
    ids=["gru", "optimized_lstm"],
)
def test_cells_whose_nnx_version_fuses_the_gates_differ(linen, port, missing):
    """NNX fuses the gates into `dense_i`/`dense_h` (no rename maps that), and NNX's GRU has
    no bias on the recurrent candidate (`hn`): n = tanh(W_in x + b_in + r * (W_hn h)), where
    Linen adds b_hn inside the product. A trained Linen GRU has no stock NNX equivalent."""
    lstm = isinstance(linen, nn.OptimizedLSTMCell)
    results = compare_modules(linen, port, Call((carry(6, lstm), X[:B])), checks=NUMERIC)
    assert failing(results).keys() == set(NUMERIC)
    assert missing in results[0].message


GATES = ("i", "f", "g", "o")  # the order NNX's OptimizedLSTMCell fuses them in


def fuse_gates(variables):
    params = variables["params"]
    joined = lambda prefix, leaf: jnp.concatenate([params[prefix + g][leaf] for g in GATES], -1)
    return {
        "dense_i": {"kernel": joined("i", "kernel")},
        "dense_h": {"kernel": joined("h", "kernel"), "bias": joined("h", "bias")},
    }


def split_gates(state):
    inputs = jnp.split(state["dense_i"]["kernel"], 4, -1)
    kernels, biases = (jnp.split(state["dense_h"][leaf], 4, -1) for leaf in ("kernel", "bias"))
    params = {f"i{g}": {"kernel": k} for g, k in zip(GATES, inputs, strict=True)}
    params |= {
        f"h{g}": {"kernel": k, "bias": b} for g, k, b in zip(GATES, kernels, biases, strict=True)
    }
    return {"params": params}


def test_a_fused_gate_cell_passes_through_a_conversion_of_its_weights():
    """What no rename maps (above), a `Conversion` does: Linen's eight gate layers fused into
    NNX's two; the fused dots compute each gate's sums as the separate ones do: bit-exact."""
    call = Call((carry(6, True), X[:B]))
    linen, port = nn.OptimizedLSTMCell(6), nnx.OptimizedLSTMCell(D, 6, rngs=rngs())
    conversion = pairs.Conversion(fuse_gates, split_gates)
    results = compare_modules(linen, port, call, conversion=conversion)
    passes(results)
    assert {"linen-init/grads/hf/kernel", "nnx-init/grads/io/kernel"} <= {
        d["tensor"] for d in results[2].details
    }
