"""`compare_modules` on a whole model pair (docs/examples/whole_model.py, the migration guide's
section 13): a correct port passes every
check with the default options; each seeded bug is named where it is; the harness raises no
false alarm of its own (gradient norms, `layers` with renames, bridges, skipped checks); a call
that does not fit the NNX module is bad input with a hint."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import flax.linen as nn
import jax
import pytest
from flax import nnx
from flax.nnx import bridge

from migrate import errors
from parity.module_pair import bridges
from parity.module_pair.modules import LinenModuleSide, NNXModuleSide
from parity.pairs import Call, Randomness, compare_modules, exit_status, format_report

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


def _load_pair():
    """docs/examples/whole_model.py as a module (registered: Linen dataclasses look it up)."""
    path = Path(__file__).resolve().parent.parent / "docs" / "examples" / "whole_model.py"
    spec = importlib.util.spec_from_file_location("whole_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


wm = _load_pair()
FORWARD = ["forward", "grads", "layers"]


def calls(draws: int = 32) -> list[Call]:
    """A train call (dropout on, each side drawing its own keys), then an eval call."""
    return [
        Call(
            (wm.tokens(),),
            linen={"deterministic": False},
            nnx_attributes={"deterministic": False},
            randomness=Randomness(draws=draws),
            name="train",
        ),
        Call(
            (wm.tokens(3),),
            linen={"deterministic": True},
            nnx_attributes={"deterministic": True},
            name="eval",
        ),
    ]


EVAL = [calls()[1]]


def failing(results) -> dict[str, str]:
    return {r.name: r.where for r in results if not r.passed}


@pytest.mark.slow
def test_the_correct_port_passes_every_check_with_the_default_options():
    results = compare_modules(wm.LinenModel(), wm.nnx_model(), calls(), rules=wm.RULES)
    assert [r.name for r in results] == ["roundtrip", "forward", "grads", "sharding", "random"]
    assert not failing(results), format_report(results)
    random = results[-1]
    assert "27 submodule outputs" in random.message  # every site's distribution compared


@pytest.mark.parametrize(
    "bug,expected",
    [
        (
            {"scale": 2.0},  # block 1's attention scores twice too sharp
            {
                "forward": "linen-init/sown/intermediates/block_1/mlp_hidden/0",
                # The forward pass parts ways in block 1: its largest gradient difference (the
                # largest of all is upstream, in block 0: the backward pass carries it there).
                "grads": "linen-init/grads/block_1/norm_attn/bias",
                "layers": "block_1/attn/out",
            },
        ),
        (
            # block 0 uses each LayerNorm in the other's place: the same forward (both start
            # at scale 1, bias 0); the backward pass reaches norm_mlp first
            {"swap": True},
            {"grads": "linen-init/grads/block_0/norm_mlp/scale", "layers": "block_0/norm_attn"},
        ),
        (
            # block 1's MLP passes no gradient back through its hidden layer: the same forward;
            # the last module whose gradients differ is `up` (every module before it receives
            # its cotangent)
            {"cut": True},
            {"grads": "linen-init/grads/block_1/up/bias"},
        ),
    ],
    ids=["scale", "swapped_names", "backward_only"],
)
def test_a_seeded_bug_is_named_in_its_block(bug, expected):
    results = compare_modules(wm.LinenModel(), wm.nnx_model(**bug), EVAL, checks=FORWARD)
    assert failing(results) == expected, format_report(results)


def test_a_missing_dropout_fails_random_at_its_site():
    """Block 1 forgets its attention dropout; two other sites keep theirs. Named at the site
    (the power at the outputs alone: docs/migration-guide.md, section 13)."""
    port = wm.nnx_model(drop_attn=False)
    results = compare_modules(wm.LinenModel(), port, calls(), checks=["random"])
    assert failing(results) == {"random": "train/block_1/drop_attn: zero fraction mean"}


def test_renamed_paths_pass_train_and_layers_with_one_rename():
    """`wte` sorts after `norm`, `embed` before it: the sides' own leaf orders differ, and
    the gradient norm is summed in Linen's path order on both."""
    with nnx.use_eager_sharding(False):
        port = wm.NNXRenamedModel(rngs=nnx.Rngs(0))
    without = compare_modules(wm.LinenModel(), port, EVAL, checks=["roundtrip"])
    assert "try renames={('embed',): ('wte',)}" in without[0].message.splitlines()[0]
    assert exit_status(without) == errors.EXIT_FAIL
    results = compare_modules(
        wm.LinenModel(), port, EVAL, renames=wm.RENAMES, checks=["train", "layers"]
    )
    assert not failing(results), format_report(results)
    layers = [d["tensor"] for d in results[1].details]
    assert layers[:3] == ["embed", "drop_embed", "block_0/norm_attn"]  # execution order
    assert layers[-2:] == ["norm", "output"]


def test_gradient_leaves_are_reduced_in_one_order_on_both_sides():
    with nnx.use_eager_sharding(False):
        port = wm.NNXRenamedModel(rngs=nnx.Rngs(0))
    common = {
        "calls": tuple(EVAL),
        "loss_fn": None,
        "rules": None,
        "mesh": None,
        "optimizer": None,
        "seed": 0,
    }
    linen = LinenModuleSide(wm.LinenModel(), None, {"params": nnx.Param}, **common)
    nnx_side = NNXModuleSide(port, wm.RENAMES, {"params": nnx.Param}, **common)
    grads = nnx.state(port, nnx.Param)
    native = [nnx_side.param_label(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    assert native.index("embed/embedding") > native.index("norm/scale")  # its own order
    labels = [label for label, _ in nnx_side.grad_leaves(grads)]
    assert labels.index("embed/embedding") < labels.index("norm/scale")
    params = linen.own_weights()["params"]
    assert labels == [label for label, _ in linen.grad_leaves(params)]
    assert "block_0/attn/value/kernel" in labels  # a module named `value` keeps its name


@pytest.mark.slow
def test_decoding_compares_the_cache_after_every_step():
    variables = wm.LinenModel(decode=True).init(jax.random.key(0), wm.tokens())
    steps = [
        Call(
            (wm.tokens()[:, t : t + 1],),
            linen={"deterministic": True},
            nnx_attributes={"deterministic": True},
            name=f"step{t}",
        )
        for t in range(3)
    ]
    results = compare_modules(
        wm.LinenModel(decode=True),
        wm.nnx_model(decode=True),
        steps,
        linen_variables=variables,
        checks=["forward", "grads"],
    )
    assert not failing(results), format_report(results)
    tensors = [d["tensor"] for d in results[0].details]
    assert "linen-init/step2/state/cache/block_1/attn/cached_key" in tensors


# ------------------------------------------------------------------ half-migrated models


def test_nnx_capture_keeps_its_buffers_where_the_bridge_shield_looks():
    """API contract (flax 0.12.8 and 0.12.12): `nnx.capture` keeps a module's buffers as the
    attribute `bridges.CAPTURES` while the module runs; the harness hides exactly that one from
    a `ToNNX` layer (`parity/module_pair/bridges.py`)."""
    seen = []

    class Probe(nnx.Module):
        def __call__(self, x):
            seen.append(bridges.CAPTURES in vars(self))
            self.sow(nnx.Intermediate, "y", x)
            return x

    nnx.capture(Probe(), nnx.Intermediate)(jax.numpy.ones(3))
    assert seen == [True]


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.Dense(4, name="dense")(nn.LayerNorm(name="norm")(x))
        self.sow("intermediates", "hidden", hidden)
        return x + hidden


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        hidden = self.dense(self.norm(x))
        self.sow(nnx.Intermediate, "hidden", hidden)
        return x + hidden


class LinenStack(nn.Module):
    """The original, or (`nnx_blocks` > 0) the first blocks migrated, held through
    `bridge.to_linen` (bottom-up migration)."""

    nnx_blocks: int = 0

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            if i < self.nnx_blocks:
                x = bridge.to_linen(NNXBlock, name=f"block_{i}")(x)
            else:
                x = LinenBlock(name=f"block_{i}")(x)
        return x


class NNXStack(nnx.Module):
    """The port, or (`linen_blocks` > 0) the last blocks still Linen, held through
    `bridge.ToNNX` (top-down migration)."""

    def __init__(self, x, linen_blocks: int = 0):
        rngs = nnx.Rngs(0)
        for i in range(3):
            if i >= 3 - linen_blocks:
                setattr(self, f"block_{i}", bridge.ToNNX(LinenBlock(), rngs=rngs))
            else:
                setattr(self, f"block_{i}", NNXBlock(rngs))
        bridge.lazy_init(self, x)

    def __call__(self, x):
        for i in range(3):
            x = getattr(self, f"block_{i}")(x)
        return x


@pytest.mark.slow
def test_a_migration_layer_by_layer_gates_bit_exactly_at_every_stage():
    """All-Linen to all-NNX one block at a time: first NNX blocks inside the Linen model,
    then the NNX model with Linen blocks inside, each stage against the original or the
    port; the harness's own captures never break a bridge."""
    x = jax.random.normal(jax.random.key(0), (2, 4))
    checks = ["roundtrip", "forward", "grads", "layers"]
    with nnx.use_eager_sharding(False):
        port = NNXStack(x)
        stages = [(LinenStack(k), port) for k in range(4)]
        stages += [(LinenStack(), NNXStack(x, linen_blocks=k)) for k in (3, 2, 1)]
    sown = [f"linen-init/sown/intermediates/block_{i}/hidden/0" for i in range(3)]
    for linen, nnx_model in stages:
        results = compare_modules(linen, nnx_model, (x,), checks=checks)
        assert not failing(results), format_report(results)
        assert all(r.value == 0.0 for r in results)
        # every block's sown value, on both sides of every bridge
        compared = [d["tensor"] for d in results[1].details]
        assert all(tensor in compared for tensor in sown), compared


def test_a_bug_in_a_bridged_linen_layer_is_named_by_what_it_sows():
    """The NNX model's last block is a Linen layer held through `bridge.ToNNX`, one that
    differs from the original's (its hidden layer twice as large): named at its sown value."""

    class Doubled(LinenBlock):
        @nn.compact
        def __call__(self, x):
            hidden = 2.0 * nn.Dense(4, name="dense")(nn.LayerNorm(name="norm")(x))
            self.sow("intermediates", "hidden", hidden)
            return x + hidden

    x = jax.random.normal(jax.random.key(0), (2, 4))
    with nnx.use_eager_sharding(False):
        port = NNXStack(x, linen_blocks=1)
        port.block_2 = bridge.ToNNX(Doubled(), rngs=nnx.Rngs(0))
        bridge.lazy_init(port, x)
    results = compare_modules(LinenStack(), port, (x,), checks=["forward"])
    place = "linen-init/sown/intermediates/block_2/hidden/0"
    assert failing(results) == {"forward": place, "layers": "block_2"}
    record = next(d for d in results[0].details if d["tensor"] == place)
    assert 0 < record["max_rel"] < float("inf"), record  # compared, not missing on one side


def test_a_bridged_linen_layer_called_twice_sows_twice():
    """One Linen layer held through `bridge.ToNNX` and called twice: both values it sows are
    compared, in call order (Linen's `sow` appends)."""

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = LinenBlock(name="block")
            return block(block(x))

    class NNXTwice(nnx.Module):
        def __init__(self, x):
            self.block = bridge.ToNNX(LinenBlock(), rngs=nnx.Rngs(0))
            bridge.lazy_init(self, x)

        def __call__(self, x):
            return self.block(self.block(x))

    x = jax.random.normal(jax.random.key(0), (2, 4))
    with nnx.use_eager_sharding(False):
        port = NNXTwice(x)
    results = compare_modules(Twice(), port, (x,), checks=["forward"])
    assert not failing(results), format_report(results)
    compared = [d["tensor"] for d in results[0].details]
    for call in (0, 1):
        assert f"linen-init/sown/intermediates/block/hidden/{call}" in compared, compared


# ------------------------------------------------------------------ misuse and hints


def test_rngs_taken_at_call_time_need_no_glue():
    x = jax.random.normal(jax.random.key(0), (8, 8))
    dropout_calls = [
        Call(
            (x,),
            linen={"deterministic": False},
            randomness=Randomness(nnx_arg="rngs", nnx_arg_as="rngs", draws=32),
            name="train",
        ),
        Call((x,), {"deterministic": True}, name="eval"),
    ]
    results = compare_modules(nn.Dropout(0.5), nnx.Dropout(0.5), dropout_calls)
    assert not failing(results), format_report(results)
    # No parameters: the gradient compared is the input's, of the call compared exactly.
    (grads,) = [r for r in results if r.name == "grads"]
    assert grads.status == "passed"
    assert [d["tensor"] for d in grads.details] == [
        f"{source}-init/input_grads/eval/0" for source in ("linen", "nnx")
    ]
    # Without it: Flax's "no rngs" error, as bad input with the option that supplies them.
    dropout_calls[0] = Call(
        dropout_calls[0].args, linen={"deterministic": False}, randomness=Randomness(draws=32)
    )
    results = compare_modules(nn.Dropout(0.5), nnx.Dropout(0.5), dropout_calls, checks=["random"])
    assert exit_status(results) == errors.EXIT_USAGE
    assert "nnx_arg_as='rngs'" in results[0].message


def test_a_missing_mode_flag_is_bad_input_with_a_hint():
    x = jax.random.normal(jax.random.key(0), (2, 4, 8))
    linen = nn.MultiHeadDotProductAttention(2, qkv_features=8, out_features=8)
    port = nnx.MultiHeadAttention(2, 8, qkv_features=8, out_features=8, rngs=nnx.Rngs(0))
    results = compare_modules(linen, port, Call((x,), {"deterministic": True}), checks=["forward"])
    assert exit_status(results) == errors.EXIT_USAGE
    assert "Call(nnx_attributes={'decode': ...})" in results[0].message


def test_flax_errors_for_a_call_that_does_not_fit_become_hints():
    from parity.module_pair.hints import nnx_hint

    raw_key = TypeError("'DynamicJaxprTracer' object is not callable")
    assert "nnx_arg_as='rngs'" in nnx_hint(raw_key, "rngs")
    assert nnx_hint(raw_key, None) is None  # no key was passed: not ours to explain
    cache = ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
    assert "init_cache(input_shape)" in nnx_hint(cache, None)
    assert nnx_hint(ValueError("shapes (2, 3) and (4,) differ"), None) is None
