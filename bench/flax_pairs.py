"""Wall time of `compare_modules` on Flax's own Linen/NNX pairs (tests/test_flax_pairs.py), and
what each needed: one call of the default checks (roundtrip, forward, grads, sharding; and
`random` for dropout) per pair, each in a process that has compiled one other pair first (so
that JAX's one-time start-up is not counted), on 8 simulated CPU devices.

    PYTHONPATH=. python bench/flax_pairs.py
"""

from __future__ import annotations

import os
import re
import sys

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import time  # noqa: E402

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from test_flax_pairs import (  # noqa: E402
    ALIGNED,
    SEQ,
    STOCK,
    TRAIN_EVAL,
    B,
    D,
    H,
    T,
    X,
    carry,
    dropout_calls,
    linen_attention,
    nnx_attention,
    rngs,
)
from test_module_gate import ALIGNED as BLOCK_CALLS  # noqa: E402
from test_module_gate import STREAMS, LinenBlock, NNXBlock  # noqa: E402

from parity.pairs import Call, Randomness, compare_modules  # noqa: E402


def cases():
    """(name, what it needs, thunk -> results)."""
    for name, (linen, port, x, _, _) in STOCK.items():
        yield (
            name,
            "nothing",
            lambda linen=linen, port=port, x=x: compare_modules(linen(), port(), x),
        )
    ids = jnp.arange(B * T).reshape(B, T) % 10
    yield (
        "embed (lookup, attend)",
        "nothing",
        lambda: compare_modules(
            nn.Embed(10, D),
            nnx.Embed(10, D, rngs=rngs()),
            [Call((ids,), name="lookup"), Call((X,), method="attend", name="attend")],
        ),
    )
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    mha = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, out_features=D)
    call = Call((SEQ,), {"mask": mask, "deterministic": True})
    yield (
        "attention, causal mask",
        "decode=False; mask keyword; attention_fn (jax 0.10.2)",
        (lambda: compare_modules(mha, nnx_attention(attention_fn=linen_attention), call)),
    )
    decoding = nn.MultiHeadDotProductAttention(
        num_heads=H, qkv_features=D, out_features=D, decode=True
    )

    def decode():
        port = nnx_attention(decode=True, attention_fn=linen_attention)
        port.init_cache(SEQ.shape)
        steps = [Call((SEQ[:, t : t + 1],), name=f"step{t}") for t in range(3)]
        variables = decoding.init(jax.random.key(0), SEQ)
        return compare_modules(decoding, port, steps, linen_variables=variables)

    yield "attention, 3 decode steps", "linen_variables; init_cache; cache map", decode
    yield (
        "batchnorm, train x2 + eval",
        "per-call use_running_average; batch_stats map",
        (lambda: compare_modules(nn.BatchNorm(), nnx.BatchNorm(D, rngs=rngs()), TRAIN_EVAL)),
    )
    yield (
        "dropout, same key",
        "deterministic (Linen); Randomness(linen_arg, nnx_arg)",
        (lambda: compare_modules(nn.Dropout(0.5), nnx.Dropout(0.5), dropout_calls(ALIGNED))),
    )
    yield (
        "dropout, own streams",
        "deterministic (Linen); Randomness()",
        (
            lambda: compare_modules(
                nn.Dropout(0.5),
                nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)),
                dropout_calls(Randomness()),
            )
        ),
    )
    yield (
        "lstm cell",
        "renames if -> if_",
        lambda: compare_modules(
            nn.LSTMCell(6),
            nnx.LSTMCell(D, 6, rngs=rngs()),
            Call((carry(6, True), X[:B])),
            renames={("if",): ("if_",)},
        ),
    )
    yield (
        "simple cell",
        "renames i, h -> dense_i, dense_h",
        lambda: compare_modules(
            nn.SimpleCell(6),
            nnx.SimpleCell(D, 6, rngs=rngs()),
            Call((carry(6, False), X[:B])),
            renames={("i",): ("dense_i",), ("h",): ("dense_h",)},
        ),
    )
    yield (
        "block: BatchNorm+Dropout+sow, same key",
        "Call per mode; Randomness(args)",
        (lambda: compare_modules(LinenBlock(), NNXBlock(rngs=nnx.Rngs(0)), BLOCK_CALLS)),
    )
    yield (
        "block: BatchNorm+Dropout+sow, own streams",
        "Call per mode; Randomness()",
        (lambda: compare_modules(LinenBlock(), NNXBlock(rngs=nnx.Rngs(0)), STREAMS)),
    )


def main() -> None:
    print(f"jax {jax.__version__}, flax {flax.__version__}")
    compare_modules(nn.Dense(3), nnx.Linear(D, 3, rngs=rngs()), X)  # start-up, not counted
    print("| pair | needs | checks | verdict | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name, needs, run in cases():
        start = time.perf_counter()
        results = run()
        seconds = time.perf_counter() - start
        verdict = "pass" if all(r.passed for r in results) else "FAIL"
        checks = ", ".join(r.name for r in results)
        print(f"| {name} | {needs} | {checks} | {verdict} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
