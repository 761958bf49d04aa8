"""Proof that the gate works: real migration bugs injected into the NNX side (monkeypatched,
never edits to the shipped code) make the CLI exit 1 and name the right check and place.
And no false alarms: the clean run passes for seeds 0 to 4 (seed 0 in the config matrix)."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import pytest
from conftest import CONFIG_DIR, run_cli
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import migrate.nnx.decoder as nnx_decoder
import migrate.nnx.layers as nnx_layers
import migrate.nnx.pipeline as nnx_pipeline
import migrate.nnx.train as nnx_train
from migrate.common import axes, loss, numerics, remat
from parity import cli

pytestmark = pytest.mark.slow
# The oldest stack runs one bug per check kind (`COMPAT_BUGS`, marked compat); every other bug
# runs on the default stack only: whether the gate names its place is the gate's own code, not
# the JAX version's.
default_stack_only = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="outside the compatibility layer: the default stack's"
)
TINY = str(CONFIG_DIR / "llama2-tiny.yml")
TINY_BF16 = str(CONFIG_DIR / "llama2-tiny-bf16.yml")
TINY_TP = str(CONFIG_DIR / "llama2-tiny-tp.yml")


def failing(report: dict) -> dict[str, str]:
    return {c["name"]: c["worst"]["where"] for c in report["checks"] if not c["passed"]}


# ------------------------------------------------------------------ the bugs


def transposed_query_kernel(monkeypatch):
    """The query kernel used as (out, in): a square [E, H*D] kernel transposed."""
    original = nnx_layers.DenseGeneral.__call__

    def call(self, x):
        # Inside the functional loop a sliced Param keeps its stacked names: match the tail.
        if tuple(self.kernel.get_metadata().get("out_sharding", ()))[-3:] == axes.QUERY:
            kernel = self.kernel[...]
            square = kernel.reshape(kernel.shape[0], -1).T.reshape(kernel.shape)
            return jnp.tensordot(
                x, square, axes=((x.ndim - 1,), (0,)), precision=numerics.precision(self.config)
            )
        return original(self, x)

    monkeypatch.setattr(nnx_layers.DenseGeneral, "__call__", call)


def wrong_rmsnorm_epsilon(monkeypatch):
    """RMSNorm with epsilon 1e-6 where the config (and Linen) say 1e-5."""

    def call(self, x):
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_square + 1e-6)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)

    monkeypatch.setattr(nnx_layers.RMSNorm, "__call__", call)


def rotary_on_the_wrong_axis(monkeypatch):
    """Rotary embedding rotating interleaved pairs (x[0::2], x[1::2]) instead of halves."""

    def call(self, x, positions):
        cfg = self.config
        half = cfg.head_dim // 2
        fraction = 2 * jnp.arange(half, dtype=jnp.float32) / cfg.head_dim
        timescale = (
            cfg.rope_min_timescale * (cfg.rope_max_timescale / cfg.rope_min_timescale) ** fraction
        )
        angle = positions.astype(jnp.float32)[..., None, None] / timescale
        x1, x2 = x[..., 0::2], x[..., 1::2]
        sin, cos = jnp.sin(angle), jnp.cos(angle)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    monkeypatch.setattr(nnx_layers.RotaryEmbedding, "__call__", call)


def wrong_logical_name(monkeypatch):
    """wi_0 annotated ('mlp', 'embed') instead of ('embed', 'mlp')."""
    original = nnx_layers.MLP.__init__

    def init(self, config, mesh, *, rngs):
        original(self, config, mesh, rngs=rngs)
        kernel = self.wi_0.kernel
        self.wi_0.kernel = nnx.Param(kernel[...], out_sharding=("mlp", "embed"))

    monkeypatch.setattr(nnx_layers.MLP, "__init__", init)


def rotated_the_wrong_way(monkeypatch):
    """Activations moved one stage left instead of right between iterations."""
    wrong = types.SimpleNamespace(
        **{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")}
    )
    wrong.roll = lambda a, shift, axis=None: jnp.roll(a, -shift, axis=axis)
    monkeypatch.setattr(nnx_pipeline, "jnp", wrong)


def microbatches_out_of_order(monkeypatch):
    """Outputs reassembled as contiguous microbatches, though they were split strided."""
    wrong = types.SimpleNamespace(**vars(nnx_pipeline.schedule))
    wrong.merge_microbatches = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    monkeypatch.setattr(nnx_pipeline, "schedule", wrong)


def remat_removed(monkeypatch):
    """The pipeline iteration body no longer checkpointed."""
    no_remat = types.SimpleNamespace(**vars(jax))
    no_remat.checkpoint = lambda fun, **_: fun
    monkeypatch.setattr(nnx_pipeline, "jax", no_remat)


def residual_dropped(monkeypatch):
    """The MLP residual of the decoder layer dropped."""

    def call(self, x, positions, segment_ids=None, dropout_keys=None):
        rules = self.config.logical_axis_rules
        x = jax.ad_checkpoint.checkpoint_name(x, axes.DECODER_LAYER_INPUT)
        x = x + self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
        out = nnx_layers.sharding.constrain(
            self.mlp(self.post_self_attention_layer_norm(x)),
            axes.BATCH_LENGTH_EMBED,
            self.mesh,
            rules,
        )
        return out, jnp.zeros(())  # (x, the dense layer's load-balancing loss)

    monkeypatch.setattr(nnx_layers.DecoderLayer, "__call__", call)


def dropout_keys_shared_by_layers(monkeypatch):
    """Every layer of the NNX twin drops with its rows' keys as they are, the layer's index
    never folded in: each layer draws the same masks (an RNG stream split once, not per layer)."""
    wrong = types.SimpleNamespace(**vars(nnx_pipeline.dropout))
    wrong.at_layer = lambda positions, layer: positions
    monkeypatch.setattr(nnx_pipeline, "dropout", wrong)


def optimizer_skips_one_parameter(monkeypatch):
    """The final norm's scale is never updated by the optimizer."""
    original = nnx_train.make_train_step

    def make(cfg, graphdef, tx):
        step = original(cfg, graphdef, tx)

        def skipping(params, opt_state, batch):
            new_params, opt_state, metrics = step(params, opt_state, batch)
            new_params["decoder_norm"]["scale"] = params["decoder_norm"]["scale"]
            return new_params, opt_state, metrics

        return skipping

    monkeypatch.setattr(nnx_train, "make_train_step", make)


def init_scale_wrong(monkeypatch):
    """The MLP output kernel initialised with 1.5x Linen's standard deviation."""
    original = nnx_layers.MLP.__init__

    def init(self, config, mesh, *, rngs):
        original(self, config, mesh, rngs=rngs)
        kernel = self.wo.kernel
        self.wo.kernel = nnx.Param(kernel[...] * 1.5, **kernel.get_metadata())

    monkeypatch.setattr(nnx_layers.MLP, "__init__", init)


def init_family_swapped(monkeypatch):
    """Dense kernels drawn from a normal instead of a truncated normal (same variance)."""
    wrong = types.SimpleNamespace(**vars(numerics))
    wrong.kernel_init = lambda in_axis, out_axis, batch_axis=(): (
        jax.nn.initializers.variance_scaling(
            1.0, "fan_in", "normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
        )
    )
    monkeypatch.setattr(nnx_layers, "numerics", wrong)


def norm_scale_zeros(monkeypatch):
    """RMSNorm scales initialised to zeros instead of ones."""
    wrong = types.SimpleNamespace(**vars(numerics))
    wrong.scale_init = jax.nn.initializers.zeros
    monkeypatch.setattr(nnx_layers, "numerics", wrong)


def stage_keys_reused(monkeypatch):
    """Every pipeline stage created with the same key: the stages start as copies."""
    original = nnx_pipeline.stack_modules

    def stack_modules(create, count, axis_name, rngs):
        module = original(create, count, axis_name, rngs)
        if axis_name == axes.STAGE:
            copies = jax.tree.map(
                lambda v: jnp.broadcast_to(v[:1], v.shape), nnx.state(module, nnx.Param)
            )
            nnx.update(module, copies)
        return module

    monkeypatch.setattr(nnx_pipeline, "stack_modules", stack_modules)


def bubbles_unmasked(monkeypatch):
    """Idle pipeline slots no longer masked: every slot treated as valid."""
    wrong = types.SimpleNamespace(**vars(nnx_pipeline.schedule))
    real_stage_work = nnx_pipeline.schedule.stage_work

    def every_slot_valid(cfg, iteration):
        micro, repeat, _ = real_stage_work(cfg, iteration)
        return micro, repeat, micro >= 0

    wrong.stage_work = every_slot_valid
    monkeypatch.setattr(nnx_pipeline, "schedule", wrong)


def highest_precision_on_one_side(monkeypatch):
    """NNX matmuls hard-coded to HIGHEST precision while the config says default."""
    wrong = types.SimpleNamespace(**vars(numerics))
    wrong.precision = lambda cfg: jax.lax.Precision.HIGHEST
    monkeypatch.setattr(nnx_layers, "numerics", wrong)


def mlp_constraint_dropped(monkeypatch):
    """The MLP hidden activation's logical sharding constraint dropped on the NNX side."""
    wrong = types.SimpleNamespace(**vars(nnx_layers.sharding))
    real_constrain = nnx_layers.sharding.constrain
    wrong.constrain = lambda x, names, mesh, rules: (
        x if tuple(names) == axes.BATCH_LENGTH_MLP else real_constrain(x, names, mesh, rules)
    )
    monkeypatch.setattr(nnx_layers, "sharding", wrong)


def remat_policy_changed(monkeypatch):
    """The pipeline iterations rematerialised with 'save nothing' instead of the config's
    policy (which saves the iteration and layer inputs)."""
    wrong = types.SimpleNamespace(**vars(remat))
    wrong.iteration_policy = lambda cfg: jax.checkpoint_policies.nothing_saveable
    monkeypatch.setattr(nnx_pipeline, "remat", wrong)


def embedding_off_by_one(monkeypatch):
    """The embedding looks up the next token's row."""

    def call(self, tokens):
        table = self.embedding[...]
        shifted = (tokens + 1) % table.shape[0]
        return jnp.take(table, shifted, axis=0).astype(numerics.activation_dtype(self.config))

    monkeypatch.setattr(nnx_layers.Embed, "__call__", call)


def attention_probabilities_in_bfloat16(monkeypatch):
    """The attention softmax's probabilities rounded through bfloat16 on the NNX side."""
    wrong = types.SimpleNamespace(
        **{k: getattr(jax, k) for k in dir(jax) if not k.startswith("__")}
    )
    wrong.nn = types.SimpleNamespace(**vars(jax.nn))
    wrong.nn.softmax = lambda x, axis=-1: jax.nn.softmax(x, axis=axis).astype(jnp.bfloat16)
    monkeypatch.setattr(nnx_layers, "jax", wrong)


def rotary_tables_in_bfloat16(monkeypatch):
    """The rotary sin/cos tables rounded to the activation dtype, so that the rotation runs in
    bfloat16: in the bf16 config each rotated element moves by about one bfloat16 ulp."""

    def call(self, x, positions):
        cfg = self.config
        half = cfg.head_dim // 2
        fraction = 2 * jnp.arange(half, dtype=jnp.float32) / cfg.head_dim
        timescale = (
            cfg.rope_min_timescale * (cfg.rope_max_timescale / cfg.rope_min_timescale) ** fraction
        )
        angle = positions.astype(jnp.float32)[..., None, None] / timescale
        sin, cos = jnp.sin(angle).astype(x.dtype), jnp.cos(angle).astype(x.dtype)
        x1, x2 = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    monkeypatch.setattr(nnx_layers.RotaryEmbedding, "__call__", call)


def train_step_not_pinned(monkeypatch):
    """The NNX train step jitted without pinning its shardings: under stage x tensor, XLA hands
    the norm scales back sharded over `tensor`, and the next step refuses them."""
    monkeypatch.setattr(nnx_train, "jit_train_step", lambda step, shardings, batch: jax.jit(step))


def train_step_not_donated(monkeypatch):
    """The NNX train step pinned but not donating its state: the same arithmetic, a second
    train state resident during every step."""

    def jit_train_step(step, state_shardings, batch_sharding):
        params, opt_state = state_shardings
        replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
        return jax.jit(
            step,
            in_shardings=(params, opt_state, batch_sharding),
            out_shardings=(params, opt_state, replicated),
        )

    monkeypatch.setattr(nnx_train, "jit_train_step", jit_train_step)


# bug, config, checks to run, {failing check: text its `where` must contain}[, overrides]
BUGS = [
    (
        transposed_query_kernel,
        TINY,
        "forward,grads",
        {"forward": "logits", "grads": "grads/params/", "layers": "layer 0/self_attention/query"},
    ),
    (
        wrong_rmsnorm_epsilon,
        TINY,
        "forward,grads",
        {
            "forward": "logits",
            "grads": "grads/params/",
            "layers": "layer 0/pre_self_attention_layer_norm",
        },
    ),
    (
        rotary_on_the_wrong_axis,
        TINY,
        "forward,grads",
        {"forward": "logits", "grads": "grads/params/", "layers": "layer 0/self_attention/rotary"},
    ),
    (
        wrong_logical_name,
        TINY,
        "sharding,forward",
        {
            "sharding": "mlp/wi_0/kernel: names",
            # weights that do not convert: no drill-down (it would fail the same way)
            "forward": "mlp/wi_0/kernel: logical names",
        },
    ),
    (
        rotated_the_wrong_way,
        TINY,
        "forward,pipeline",
        {"forward": "logits", "pipeline": "nnx/", "layers": "iteration 1/stage 1"},
    ),
    (
        microbatches_out_of_order,
        TINY,
        "forward,pipeline",
        {"forward": "logits", "pipeline": "nnx/"},
    ),
    (remat_removed, TINY, "sharding,forward", {"sharding": "collectives"}),
    (
        residual_dropped,
        TINY,
        "forward,grads",
        {"forward": "logits", "grads": "grads/params/", "layers": "layer 0/output"},
    ),
    (
        dropout_keys_shared_by_layers,
        TINY,
        "forward,random",
        {"forward": "logits", "random": "decoder/draws"},
        ("dropout_rate=0.1",),
    ),
    (
        optimizer_skips_one_parameter,
        TINY,
        "forward,train",
        {"train": "step 0/params/decoder_norm/scale"},
    ),
    # A pipeline bug under the bfloat16 pipeline tier.
    (microbatches_out_of_order, TINY_BF16, "pipeline", {"pipeline": "nnx/"}),
    (
        train_step_not_pinned,
        TINY_TP,
        "sharding,train",
        {
            "sharding": "train step output: params/decoder_norm/scale",
            "train": "step 0/nnx returned: params/decoder_norm/scale",
        },
    ),
    (train_step_not_donated, TINY, "compile", {"compile": "alias_bytes"}),
    (init_scale_wrong, TINY, "init,forward", {"init": "mlp/wo/kernel: log std ratio"}),
    (init_family_swapped, TINY, "init,forward", {"init": "logits_dense/kernel: kurtosis"}),
    (
        norm_scale_zeros,  # also a dead model from NNX's own weights: a vacuous forward
        TINY,
        "init,forward",
        {"init": "decoder_norm/scale: constant value", "forward": "nnx-init): logits are all zero"},
    ),
    (stage_keys_reused, TINY, "init,forward", {"init": "distinct stacked slices"}),
    (bubbles_unmasked, TINY, "forward,grads,bubbles", {"bubbles": "nnx/grads/params/pipeline"}),
    (
        highest_precision_on_one_side,
        TINY,
        "forward,grads,program",
        {"program": "pre-optimisation HLO: replaced"},
        ("matmul_precision=default",),
    ),
    (
        mlp_constraint_dropped,
        TINY,
        "forward,program",
        {"program": "pre-optimisation HLO: only in Linen"},
    ),
    (remat_policy_changed, TINY, "forward,grads,program", {"program": "pre-optimisation HLO"}),
    (
        embedding_off_by_one,
        TINY,
        "forward,grads",
        {"forward": "logits", "grads": "grads/params/", "layers": "embedding"},
    ),
    (
        attention_probabilities_in_bfloat16,
        TINY,
        "forward,program",
        {
            "forward": "logits",
            "program": "pre-optimisation HLO",
            "layers": "layer 0/self_attention",
        },
    ),
]


# The oldest stack's compatibility layer: one bug per kind of check (each check reads what that
# JAX computed, compiled and sharded, and the drill-down what that Flax captured), on
# llama2-tiny; the rest run on the default stack.
COMPAT_BUGS = {
    "init_scale_wrong",  # init
    "transposed_query_kernel",  # forward, grads, layers (a layer)
    "rotated_the_wrong_way",  # forward, pipeline, layers (a pipeline iteration)
    "wrong_logical_name",  # sharding
    "mlp_constraint_dropped",  # program
    "bubbles_unmasked",  # bubbles
    "optimizer_skips_one_parameter",  # train
    "train_step_not_donated",  # compile
}


def _bug_param(bug: tuple) -> pytest.param:
    inject, config, *_ = bug
    compat = inject.__name__ in COMPAT_BUGS and config == TINY
    bug_id = f"{inject.__name__}-{config.split('/')[-1][:-4]}"
    return pytest.param(bug, id=bug_id, marks=pytest.mark.compat if compat else default_stack_only)


# Checks a bug may also fail, by rounding only: unmasked bubbles add exact zeros, but the NNX
# program is no longer the Linen one, and XLA may sum the gradients in another order. Measured:
# bit-exact with XLA's default code generation, 5.6e-7 relative (a few float32 ulp) with the
# suite's unoptimised one (tests/conftest.py). Zero-filled, the idle slots change no value:
# only the NaN fill of `bubbles` sees the bug.
ROUNDING_ALSO = {"bubbles_unmasked": "grads"}


@pytest.mark.parametrize("bug", [_bug_param(b) for b in BUGS])
def test_injected_bug_fails_the_gate_at_the_right_place(bug, monkeypatch, fresh_nnx, tmp_path):
    inject, config, selected, expected, *overrides = bug
    inject(monkeypatch)
    args = (*(overrides[0] if overrides else ()), f"--checks={selected}", "--steps=2")
    status, report = run_cli(tmp_path, config, *args)
    assert status == cli.EXIT_FAIL
    where = failing(report)
    rounding = ROUNDING_ALSO.get(inject.__name__)
    if rounding in where:
        worst = next(c["worst"]["value"] for c in report["checks"] if c["name"] == rounding)
        assert worst < 16 * 2.0**-23, (rounding, worst)  # rounding, not a real difference
        del where[rounding]
    assert set(where) == set(expected), where
    for check, place in expected.items():
        assert place in where[check], (check, where[check])


@default_stack_only
def test_one_bfloat16_ulp_between_the_twins_fails_the_gate(monkeypatch, fresh_nnx, tmp_path):
    """Linen vs NNX are held to zero difference in bfloat16 too: a bug worth about one bf16 ulp
    where it starts fails the gate, though it stays far inside the old blanket bf16 tier
    (16 bf16 ulp at scale, 6.25%) everywhere downstream."""
    rotary_tables_in_bfloat16(monkeypatch)
    status, report = run_cli(tmp_path, TINY_BF16, "--checks=forward,grads", "--steps=2")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == {"forward", "grads", "layers"}, where
    assert "logits" in where["forward"] and "grads/params/" in where["grads"]
    assert "layer 0/self_attention/rotary" in where["layers"]
    checks = {c["name"]: c for c in report["checks"]}
    assert 0 < checks["forward"]["worst"]["value"] < 16 * 2.0**-8
    first = next(r for r in checks["layers"]["details"] if not r["passed"])
    assert first["tensor"].startswith("layer 0/self_attention/rotary")
    # bfloat16 keeps 8 significant bits: one ulp of a value is 2^-8 to 2^-7 of it.
    assert 0 < first["max_rel"] <= 2.0**-7


DEFAULT_CHECKS = {
    "roundtrip", "init", "forward", "grads", "sharding", "program", "pipeline", "bubbles", "train",
    "random",
}  # fmt: skip


def test_no_false_alarms_for_seeds_0_to_4(tmp_path):
    """Seeds 1 to 4 in one process (seed 0: every check, in the config matrix): a seed changes
    the weights and batches, not the programs, so the later seeds reuse the first's."""
    for seed in range(1, 5):
        status, report = run_cli(tmp_path, TINY, f"seed={seed}", "--steps=2")
        assert status == cli.EXIT_PASS, (seed, failing(report))
        assert {c["name"] for c in report["checks"]} == DEFAULT_CHECKS, seed


# The llama2-tiny kinds on shipped configs other than llama2-tiny: a cheap subset of the matrix that
# bench/bug_matrix.py runs in full (every kind on every config, docs/configs.md).
# bug, config, the one check run, the text its `where` must contain
CROSS_CONFIG_BUGS = [
    (bubbles_unmasked, "llama2-tiny-delay", "bubbles", "nnx/grads/params/pipeline"),
    (
        stage_keys_reused,  # stages stacked around the scanned layers_per_stage axis
        "llama2-tiny-scan",
        "init",
        "pipeline/layers/layers/mlp/wi_0/kernel: distinct stacked slices",
    ),
    (init_scale_wrong, "llama2-tiny-bf16", "init", "mlp/wo/kernel: log std ratio"),
    (mlp_constraint_dropped, "llama2-tiny-tp", "program", "pre-optimisation HLO: only in Linen"),
]


@default_stack_only
@pytest.mark.parametrize(
    "bug", CROSS_CONFIG_BUGS, ids=[f"{b[0].__name__}-{b[1]}" for b in CROSS_CONFIG_BUGS]
)
def test_the_llama2_tiny_kinds_are_caught_on_other_configs(bug, monkeypatch, fresh_nnx, tmp_path):
    inject, name, check, place = bug
    inject(monkeypatch)
    status, report = run_cli(tmp_path, str(CONFIG_DIR / f"{name}.yml"), f"--checks={check}")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == {check}, where
    assert place in where[check], where[check]


# ------------------------------------------------------------------ weight tying
# Bugs of a tied head (`logits_via_embedding: true`) on llama2-tiny-tied.

TINY_TIED = str(CONFIG_DIR / "llama2-tiny-tied.yml")


def tied_head_without_gradient(monkeypatch):
    """The NNX head reads the table through `stop_gradient`: the logits are unchanged, but the
    embedding's gradient loses the head's share and keeps only the lookup's."""

    def attend(self, x):
        dtype = numerics.activation_dtype(self.config)
        table = jax.lax.stop_gradient(self.embedding[...])
        return jnp.tensordot(
            x.astype(dtype),
            table.astype(dtype),
            axes=((x.ndim - 1,), (1,)),
            precision=numerics.precision(self.config),
        )

    monkeypatch.setattr(nnx_layers.Embed, "attend", attend)


def untied_head_on_one_side(monkeypatch):
    """The NNX decoder ignores `logits_via_embedding`: it builds (and uses) its own
    `logits_dense` head where Linen ties the head to the embedding."""

    original = nnx_decoder.Decoder.__init__

    def init(self, config, *args, **kwargs):
        original(self, config.replace(logits_via_embedding=False), *args, **kwargs)

    monkeypatch.setattr(nnx_decoder.Decoder, "__init__", init)


@default_stack_only
def test_a_tied_head_without_the_logits_gradient_fails_grads_at_the_embedding(
    monkeypatch, fresh_nnx, tmp_path
):
    tied_head_without_gradient(monkeypatch)
    status, report = run_cli(tmp_path, TINY_TIED, "--checks=forward,grads")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == {"grads"}, where  # forward values are untouched
    assert "grads/params/token_embedder/embedding" in where["grads"], where["grads"]


@default_stack_only
def test_an_untied_head_on_one_side_fails_init_at_the_logits_kernel(
    monkeypatch, fresh_nnx, tmp_path
):
    untied_head_on_one_side(monkeypatch)
    status, report = run_cli(tmp_path, TINY_TIED, "--checks=init")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == {"init"}, where
    assert "logits_dense/kernel" in where["init"], where["init"]


# ------------------------------------------------------------------ multi-slice
# The NNX port builds its mesh the way NNX's examples do, `jax.make_mesh` over the mesh's
# sizes (ici x dcn per axis), instead of MaxText's hybrid mesh: the devices in order,
# reshaped, with no grouping into slices. The values cannot show it (the same arithmetic on
# other devices); on a multi-slice mesh with data parallelism inside each slice, the weights
# land on devices laid out data-major, so the stages no longer sit in their slices.
MULTISLICE = str(CONFIG_DIR / "llama2-tiny-multislice.yml")


def mesh_without_slices(monkeypatch):
    """The NNX decoder built and placed on `jax.make_mesh(ici x dcn sizes)`."""
    from jax.sharding import AxisType

    from migrate.config.rules import MESH_AXES

    original = nnx_decoder.init_model

    def init_model(cfg, mesh, *args, **kwargs):
        sizes = tuple(cfg.mesh_shape[a] for a in MESH_AXES)
        flat = jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
        return original(cfg, flat, *args, **kwargs)

    monkeypatch.setattr(nnx_decoder, "init_model", init_model)


@default_stack_only
def test_mesh_without_slices_is_caught_on_the_multislice_config(monkeypatch, fresh_nnx, tmp_path):
    """Caught by `sharding`, on the first parameter, with the device order it landed on; on a
    one-slice config the same code is no bug (its mesh is the devices in order) and passes."""
    mesh_without_slices(monkeypatch)
    status, report = run_cli(tmp_path, MULTISLICE, "--checks=sharding")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == {"sharding"}, where
    assert where["sharding"] == "decoder_norm/scale: placed"
    (check,) = report["checks"]
    placed = [r for r in check["details"] if r["tensor"].endswith(": placed")]
    assert placed and not any(r["passed"] for r in placed)  # every parameter, on either mesh
    assert all("on mesh devices [0, 1, 2, 3, 4, 5, 6, 7]" in r["nnx"] for r in placed)
    assert all("on mesh devices" not in r["linen"] for r in placed)

    status, report = run_cli(tmp_path, TINY, "--checks=sharding")
    assert status == cli.EXIT_PASS, failing(report)


# ================================================================== ag per repeat
# `pipeline_fsdp_ag_per_repeat` bugs in the NNX twin, on llama2-tiny-agrepeat (R = 3: the
# window moves). bug, checks to run, {failing check: text its `where` must contain}
TINY_AGREPEAT = str(CONFIG_DIR / "llama2-tiny-agrepeat.yml")


def window_one_repeat_late(monkeypatch):
    """Each block's weight window starts at repeat b instead of b - 1: a stage still finishing
    repeat b - 1 (its first d*s iterations of the block) runs repeat b's weights."""
    wrong = types.SimpleNamespace(**vars(nnx_pipeline.schedule))
    wrong.window_start = lambda cfg, block: jnp.clip(block, 0, cfg.num_repeats - 2)
    monkeypatch.setattr(nnx_pipeline, "schedule", wrong)


def window_not_gathered(monkeypatch):
    """The window sliced but never constrained: the same values, left to XLA, which gathers
    the weights over fsdp in every iteration (the per-iteration mode's traffic)."""

    def all_gather_window(self, weights, start, length):
        return jax.tree.map(
            lambda w: jax.lax.dynamic_slice_in_dim(w, start, length, axis=0), weights
        )

    monkeypatch.setattr(nnx_pipeline.Pipeline, "all_gather_window", all_gather_window)


AG_PER_REPEAT_BUGS = [
    (
        window_one_repeat_late,
        "forward,pipeline",
        {"forward": "logits", "pipeline": "nnx/", "layers": "iteration 8/stage 1"},
    ),
    (
        window_not_gathered,
        "compile",
        {"compile": "loop body forward: all-gather over fsdp (ag-per-repeat)"},
    ),
]


@default_stack_only
@pytest.mark.parametrize("bug", AG_PER_REPEAT_BUGS, ids=[b[0].__name__ for b in AG_PER_REPEAT_BUGS])
def test_ag_per_repeat_bugs_are_caught(bug, monkeypatch, fresh_nnx, tmp_path):
    inject, selected, expected = bug
    inject(monkeypatch)
    status, report = run_cli(tmp_path, TINY_AGREPEAT, f"--checks={selected}")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == set(expected), where
    for check, place in expected.items():
        assert place in where[check], (check, where[check])


# ------------------------------------------------------------------ a pipelined subset
# (`pipeline_parallel_layers`): the layers after the pipeline must run after it, in the rows
# `migrate.common.placement` gives them.

TINY_SUBSET = str(CONFIG_DIR / "llama2-tiny-subset.yml")


def remainder_rows_reversed(monkeypatch):
    """The NNX twin runs the layers after the pipeline with their rows mapped backwards:
    layer 8 computed with layer 9's weights and the other way round."""

    def reversed_rows(self, x, positions, trace=False):
        graphdef, state = nnx.split(self.layers)
        layers = nnx.merge(graphdef, jax.tree.map(lambda w: w[::-1], state))
        policy = remat.layer_policy(self.config)
        return nnx_pipeline.scan_layers(layers, x, positions, policy, trace)

    monkeypatch.setattr(nnx_decoder.LayersAfterPipeline, "__call__", reversed_rows)


@default_stack_only
def test_subset_remainder_rows_mapped_wrongly_are_named(monkeypatch, fresh_nnx, tmp_path):
    """Caught by forward, grads and the NNX half of `pipeline` (the NNX reference has no
    remainder to get wrong); the drill-down names the first remainder row by its placement."""
    remainder_rows_reversed(monkeypatch)
    status, report = run_cli(tmp_path, TINY_SUBSET, "--checks=forward,grads,pipeline")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == {"forward", "grads", "pipeline", "layers"}, where
    assert "logits" in where["forward"] and "grads/params/" in where["grads"]
    assert where["pipeline"].startswith("nnx/"), where["pipeline"]
    assert where["layers"].startswith("layer 8 (after the pipeline, row 0)"), where["layers"]
    checks = {c["name"]: c for c in report["checks"]}
    drill = checks["layers"]["details"]
    first = next(r for r in drill if not r["passed"])
    assert (first["layer"], first["placement"]) == (8, "after the pipeline, row 0")
    # Every record before it (embedding, all ten layers in the reference layout, the
    # pipeline's own stages) passed: the bug is in the remainder's rows alone.
    assert all(r["passed"] for r in drill[: drill.index(first)])
    assert not any(r["passed"] is False and r.get("iteration") is not None for r in drill)


# ------------------------------------------------------------------ MoE layers
# Bugs of the mixture-of-experts pipeline (mixtral-tiny), each caught at its place.

MIXTRAL_TINY = str(CONFIG_DIR / "mixtral-tiny.yml")


def aux_loss_counted_for_bubbles(monkeypatch):
    """The pipeline adds every stage's load-balancing loss each iteration, idle slots too: the
    `[S]` select on the schedule's `valid` mask dropped (the stage-input mask stays)."""
    wrong = types.SimpleNamespace(
        **{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")}
    )
    wrong.where = lambda c, x, y: x if jnp.ndim(c) == 1 else jnp.where(c, x, y)
    monkeypatch.setattr(nnx_pipeline, "jnp", wrong)


def aux_loss_left_out_of_the_loss(monkeypatch):
    """The NNX train step optimises the cross entropy alone: the load-balancing loss is still
    computed and reported, but never reaches the loss the optimizer sees."""
    monkeypatch.setattr(
        nnx_train,
        "training_loss",
        lambda cfg, logits, aux, targets, weights=None: loss.cross_entropy_loss(
            logits, targets, weights
        ),
    )


MOE_BUGS = [
    (
        aux_loss_counted_for_bubbles,  # `bubbles` passes under it: idle inputs stay masked
        "forward,pipeline",
        {"forward": "aux_loss", "pipeline": "nnx/aux_loss"},
    ),
    (
        aux_loss_left_out_of_the_loss,
        "grads,train",
        {"grads": "grads/params/", "train": "eval-before/loss"},
    ),
]


@default_stack_only
@pytest.mark.parametrize("bug", MOE_BUGS, ids=[b[0].__name__ for b in MOE_BUGS])
def test_moe_bug_fails_the_gate_at_the_right_place(bug, monkeypatch, fresh_nnx, tmp_path):
    inject, selected, expected = bug
    inject(monkeypatch)
    status, report = run_cli(tmp_path, MIXTRAL_TINY, f"--checks={selected}", "--steps=2")
    assert status == cli.EXIT_FAIL
    where = failing(report)
    assert set(where) == set(expected), where
    for check, place in expected.items():
        assert place in where[check], (check, where[check])
