"""Packed sequences (`packing: true`, `migrate.common.packing`): the synthetic packed batch,
attention kept inside each document, the loss over real tokens, and the gate's checks on
packed batches (a twin that lets attention cross documents fails them)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIG_DIR, run_cli, tiny
from flax import nnx

from migrate.common import loss, packing, sharding
from migrate.linen import layers as linen_layers
from migrate.nnx import layers as nnx_layers
from parity import cli
from parity.decoder import data

TINY = str(CONFIG_DIR / "llama2-tiny.yml")


@pytest.fixture(scope="module")
def packed():
    cfg = tiny("llama2-tiny", "packing=true")
    return cfg, sharding.make_mesh(cfg)


def test_a_packed_row_holds_documents_counted_from_position_zero_then_padding(packed):
    cfg, mesh = packed
    batch = {k: np.asarray(v) for k, v in data.synthetic_batch(cfg, mesh, step=3).items()}
    again = data.synthetic_batch(cfg, mesh, step=3)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)  # deterministic
    segments, positions = batch["inputs_segmentation"], batch["inputs_position"]
    assert np.array_equal(batch["targets_segmentation"], segments)
    length = cfg.max_target_length
    documents = []
    for row_segments, row_positions in zip(segments, positions, strict=True):
        real = row_segments != 0
        padding = length - real.sum()
        assert 0 <= padding <= length // 4 and not real[length - padding :].any()
        assert real[: length - padding].all() and row_segments[0] == 1
        ids = row_segments[real]
        assert np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)  # 1, 2, ... in order
        starts = np.flatnonzero(np.diff(ids, prepend=0))
        for start, end in zip(starts, [*starts[1:], len(ids)], strict=True):
            assert np.array_equal(row_positions[start:end], np.arange(end - start))
            documents.append(end - start)
    assert 1 < np.mean(documents) < length / 2  # several documents per row
    unpacked = data.synthetic_batch(tiny("llama2-tiny"), mesh, step=3)
    assert set(unpacked) == {"inputs", "targets"}
    assert np.array_equal(unpacked["inputs"], batch["inputs"])  # the same tokens


def test_attention_sees_the_earlier_tokens_of_its_own_document_only():
    segments = jnp.array([[1, 1, 2, 2, 0]])
    mask = packing.attention_mask(segments, 5)
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    assert mask.shape == (1, 1, 1, 5, 5)
    np.testing.assert_array_equal(mask[0, 0, 0], np.array(expected, bool))
    unpacked = packing.attention_mask(None, 5)
    np.testing.assert_array_equal(unpacked, np.tril(np.ones((5, 5), bool)))


def test_the_loss_counts_real_tokens_only():
    logits = jax.random.normal(jax.random.key(0), (2, 4, 8))
    targets = jnp.array([[1, 2, 3, 4], [5, 6, 7, 0]])
    weights = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    per_token = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    expected = (per_token[0, :3].sum() + per_token[1, 0]) / 4
    np.testing.assert_allclose(
        loss.cross_entropy_loss(logits, targets, weights), expected, rtol=1e-6
    )
    assert packing.loss_weights({"targets": targets}) is None


@pytest.mark.compat  # each stack's attention, rotary and masking
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_a_document_computes_in_a_packed_row_what_it_computes_alone(packed, framework):
    """One decoder layer on a row packing two documents and padding: the second document's
    outputs are those of the same tokens alone at the start of a row, bit for bit (attention
    cannot see
    the first document, rotary positions restart); without the segment ids they are not."""
    cfg, mesh = packed
    length, first = cfg.max_target_length, 5
    rows = 2  # the batch splits over fsdp
    x = jax.random.normal(jax.random.key(1), (rows, length, cfg.base_emb_dim))
    segments = jnp.array([[1] * first + [2] * (length - first - 2) + [0, 0]] * rows)
    index = jnp.broadcast_to(jnp.arange(length), (rows, length))
    positions = jnp.where(index < first, index, index - first)
    alone = jnp.roll(x, -first, axis=1)  # the second document first, then the rest
    if framework == "linen":
        layer = linen_layers.DecoderLayer(cfg, mesh)
        params = layer.init(jax.random.key(0), x, positions, segments)
        run = lambda x, *places: layer.apply(params, x, *places)[0]
    else:
        with nnx.use_eager_sharding(False):
            module = nnx_layers.DecoderLayer(cfg, mesh, rngs=nnx.Rngs(0))
        run = lambda x, *places: module(x, *places)[0]
    second = slice(first, length - 2)
    in_row = run(x, positions, segments)[:, second]
    by_itself = run(alone, index)[:, : length - 2 - first]
    # bit for bit: a masked score's exp is exactly 0, and adding zeros rounds nothing
    np.testing.assert_array_equal(in_row, by_itself)
    crossing = run(x, positions)[:, second]
    assert np.abs(np.asarray(crossing - by_itself)).max() > 1e-2


@pytest.mark.slow
@pytest.mark.compat
def test_the_twins_hold_parity_on_packed_batches(tmp_path):
    status, report = run_cli(
        tmp_path, TINY, "packing=true", "--checks=forward,grads,pipeline,train,layers"
    )
    assert status == cli.EXIT_PASS, [c for c in report["checks"] if not c["passed"]]


@pytest.mark.slow
def test_attention_across_documents_in_one_twin_fails_forward(tmp_path, monkeypatch, fresh_nnx):
    """The NNX twin's attention ignoring the segment ids (a port that dropped the packing
    mask): forward, grads and the drill-down fail, the drill-down at layer 0's attention
    output."""
    wrong = types.SimpleNamespace(**vars(packing))
    wrong.attention_mask = lambda segment_ids, length: packing.attention_mask(None, length)
    monkeypatch.setattr(nnx_layers, "packing", wrong)
    status, report = run_cli(tmp_path, TINY, "packing=true", "--checks=forward,grads,layers")
    assert status == cli.EXIT_FAIL
    where = {c["name"]: c["worst"]["where"] for c in report["checks"] if not c["passed"]}
    assert set(where) == {"forward", "grads", "layers"}, where
    assert where["layers"] == "layer 0/self_attention/out", where
