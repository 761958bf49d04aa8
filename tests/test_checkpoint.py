"""On-disk checkpoint migration (`migrate.checkpoints.commands`), on real Orbax checkpoints.

Sources are a Linen checkpoint after one real AdamW step (so the moments and the count are not
their initial values) and random-valued states (every leaf distinct, so a misplaced layer or a
swapped moment cannot pass a bit-exact comparison).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import tiny
from flax import nnx

from migrate.checkpoints import checkpoint_io, convert, meta, train_state
from migrate.checkpoints import commands as checkpoint
from migrate.checkpoints.meta import CheckpointError
from migrate.checkpoints.train_state import Spec, TrainState
from migrate.common import optim, sharding
from parity.decoder import twins
from parity.decoder.data import synthetic_batch
from parity.engine import compiles

# A damaged checkpoint fails an Orbax read while others are in flight; those end in Orbax's
# closed event loop and Python reports them as unraisable. The CLI silences them (its
# `_quiet_abandoned_reads`); here they are collected at once, inside the test that caused them.
pytestmark = [
    pytest.mark.compat,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

RESTAGED = {"ici_pipeline_parallelism": 2, "num_pipeline_repeats": 4}


@functools.cache
def setup(name: str = "llama2-tiny"):
    cfg = tiny(name)
    return cfg, sharding.make_mesh(cfg)


@functools.cache
def trained_linen() -> TrainState:
    """Linen weights, optimizer state and step after one AdamW step."""
    cfg, mesh = setup()
    # A copy: the step donates its state, and the initial weights are cached for everyone.
    params = twins.fresh_copy(twins.linen_initial_variables(cfg, mesh)["params"])
    opt_state = optim.make_optimizer(cfg).init(params)
    step, _ = twins.linen_train_fns(cfg, mesh)
    params, opt_state, _ = step(params, opt_state, synthetic_batch(cfg, mesh))
    return TrainState({"params": params}, opt_state, 1)


def random_state(spec: Spec, mesh, seed: int = 0) -> TrainState:
    """A state of `spec`'s shapes, names and shardings with random, distinct values."""
    template = train_state.abstract_state(spec, mesh)
    rng = np.random.default_rng(seed)

    def fill(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            value = rng.standard_normal(x.shape).astype(x.dtype) if x.shape else np.int32(7)
            return jax.device_put(np.asarray(value, x.dtype), x.sharding)
        return x

    values = jax.tree.map(fill, train_state.to_pure((template.params, template.opt_state)))
    params, opt_state = train_state.from_pure((template.params, template.opt_state), values)
    return TrainState(params, opt_state, 42)


@pytest.mark.parametrize("min_slice_bytes", [0, checkpoint_io.REPLICA_PARALLEL_MIN_SLICE_BYTES])
def test_a_save_compiles_no_program_below_the_replica_parallel_size(
    min_slice_bytes, tmp_path, monkeypatch
):
    """Orbax cuts each replica's share of a replicated array with an eager program of its own
    (0: every array split so); below `REPLICA_PARALLEL_MIN_SLICE_BYTES` a shard is written
    whole and a save of the tiny model compiles nothing. The in-memory caches are cleared first
    so that a program another test compiled counts (as a persistent-cache read)."""
    cfg, mesh = setup()
    spec = Spec("nnx", "pipeline", cfg)
    state = random_state(spec, mesh, seed=3)
    monkeypatch.setattr(checkpoint_io, "REPLICA_PARALLEL_MIN_SLICE_BYTES", min_slice_bytes)
    jax.clear_caches()
    with compiles.measure() as cost:
        checkpoint_io.save(tmp_path / "ckpt", spec, state)
    programs = cost.compilations + cost.cache_reads
    assert (programs > 0) if min_slice_bytes == 0 else (programs == 0), cost.programs
    restored = checkpoint_io.restore(tmp_path / "ckpt", spec, mesh)
    assert_bit_exact(linen_form(restored, "nnx"), linen_form(state, "nnx"))


@pytest.fixture(scope="module")
def linen_ckpt(tmp_path_factory) -> Path:
    cfg, _ = setup()
    path = tmp_path_factory.mktemp("ckpt") / "linen"
    checkpoint_io.save(path, Spec("linen", "pipeline", cfg), trained_linen())
    return path


@pytest.fixture(scope="module")
def nnx_ckpt(linen_ckpt) -> Path:
    cfg, _ = setup()
    path = linen_ckpt.parent / "nnx"
    outcome = checkpoint.convert_checkpoint(linen_ckpt, path, cfg, "linen", "nnx")
    assert (outcome.step, outcome.arrays, outcome.target.framework) == (1, 37, "nnx")
    return path


def linen_form(state: TrainState, framework: str):
    """(boxed Linen params, opt_state with boxed moments) as host arrays, from either twin."""
    if framework == "nnx":
        to_linen = lambda t: convert.nnx_to_linen(t)["params"]
        opt = jax.tree.map(
            lambda x: to_linen(x) if isinstance(x, nnx.State) else x,
            state.opt_state,
            is_leaf=lambda x: isinstance(x, nnx.State),
        )
        return jax.device_get((convert.nnx_to_linen(state.params), opt))
    return jax.device_get((state.params, state.opt_state))


def assert_bit_exact(actual, expected) -> None:
    """Same structure, same logical names, same dtypes and shapes, same bytes."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    a_leaves, a_def = jax.tree.flatten(actual, is_leaf=is_box)
    b_leaves, b_def = jax.tree.flatten(expected, is_leaf=is_box)
    assert a_def == b_def
    for a, b in zip(a_leaves, b_leaves, strict=True):
        if is_box(a):
            assert a.names == b.names
            a, b = a.value, b.value
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()


def tree_hash(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------ round trips


def test_linen_to_nnx_to_linen_is_bit_exact(linen_ckpt, nnx_ckpt, tmp_path):
    cfg, mesh = setup()
    before = tree_hash(linen_ckpt)
    checkpoint.convert_checkpoint(nnx_ckpt, tmp_path / "back", cfg, "nnx", "linen")
    original = trained_linen()
    back = checkpoint_io.restore(tmp_path / "back", Spec("linen", "pipeline", cfg), mesh)
    assert back.step == 1
    assert_bit_exact(linen_form(back, "linen"), linen_form(original, "linen"))

    # The NNX checkpoint holds the converter's NNX state, moments as States of Params.
    nnx_state = checkpoint_io.restore(nnx_ckpt, Spec("nnx", "pipeline", cfg), mesh)
    expected = twins.linen_to_nnx_params(cfg, mesh, original.params)
    assert_bit_exact(nnx.to_pure_dict(nnx_state.params), nnx.to_pure_dict(expected))
    assert isinstance(nnx_state.opt_state[1][0].mu, nnx.State)
    assert_bit_exact(linen_form(nnx_state, "nnx"), linen_form(original, "linen"))
    assert tree_hash(linen_ckpt) == before  # the source is never modified


def test_restored_arrays_land_with_the_target_sharding(linen_ckpt):
    cfg, mesh = setup()
    state = checkpoint_io.restore(linen_ckpt, Spec("linen", "pipeline", cfg), mesh)
    boxes = jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    for box in boxes:
        expected = sharding.named_sharding(box.names, mesh, cfg.logical_axis_rules)
        assert box.value.sharding.is_equivalent_to(expected, box.value.ndim), box.names
    wi = state.params["params"]["pipeline"]["layers"]["layers_0"]["mlp"]["wi_0"]["kernel"].value
    assert wi.sharding.spec == jax.sharding.PartitionSpec(None, "stage", "fsdp", "tensor")


# ------------------------------------------------------------------ re-staging


def test_restaging_then_reference_equals_direct_reference(linen_ckpt, tmp_path):
    """S=4 R=2 (Linen) -> S=2 R=4 (NNX, verified) -> reference (Linen) == S=4 R=2 -> reference."""
    cfg, mesh = setup()
    hop = checkpoint.convert_checkpoint(
        linen_ckpt, tmp_path / "hop", cfg, "linen", "nnx", changes=RESTAGED, verify=True
    )
    assert hop.checks == ("bit-exact",) and not hop.differences
    assert (hop.target.cfg.num_stages, hop.target.cfg.num_repeats) == (2, 4)
    checkpoint.convert_checkpoint(
        tmp_path / "hop", tmp_path / "two", cfg, "nnx", "linen", "reference"
    )
    checkpoint.convert_checkpoint(linen_ckpt, tmp_path / "one", cfg, "linen", "linen", "reference")

    ref_spec = Spec("linen", "reference", cfg)
    two = checkpoint_io.restore(tmp_path / "two", ref_spec, mesh)
    one = checkpoint_io.restore(tmp_path / "one", ref_spec, mesh)
    assert one.step == two.step == 1
    assert_bit_exact(linen_form(two, "linen"), linen_form(one, "linen"))
    # Both equal the converter's whole-tree placement formula, applied on the host.
    host = jax.device_get(trained_linen())
    assert_bit_exact(
        jax.device_get(one.params), convert.linen_pipeline_to_reference(host.params, cfg)
    )
    mu = {"params": host.opt_state[1][0].mu}
    expected_mu = convert.linen_pipeline_to_reference(mu, cfg)["params"]
    assert_bit_exact(jax.device_get(one.opt_state[1][0].mu), expected_mu)

    # The re-staged checkpoint lands on the S=2 mesh with the sharding its names resolve to.
    hop_cfg = hop.target.cfg
    hop_mesh = sharding.make_mesh(hop_cfg)
    assert hop_mesh.devices.size == 4
    mid = checkpoint_io.restore(tmp_path / "hop", hop.target, hop_mesh)
    for _, variable in nnx.to_flat_state(mid.params):
        names, value = convert.nnx_names(variable), variable.get_value()
        expected = sharding.named_sharding(names, hop_mesh, hop_cfg.logical_axis_rules)
        assert value.sharding.is_equivalent_to(expected, value.ndim), names
        if names[:2] == ("circular_repeats", "layers"):
            assert value.shape[:2] == (4, 2)


def test_restaging_scanned_stages_into_separate_slots(tmp_path):
    """S=4 R=2 L=2 scanned -> S=2 R=2 L=4 as layers_0..3 -> reference -> back, on random
    values."""
    cfg, mesh = setup("llama2-tiny-scan")
    spec = Spec("nnx", "pipeline", cfg)
    state = random_state(spec, mesh)
    checkpoint_io.save(tmp_path / "src", spec, state)
    changes = {
        "ici_pipeline_parallelism": 2,
        "num_layers_per_pipeline_stage": 4,
        "scan_layers_per_stage": False,
    }
    hop = checkpoint.convert_checkpoint(
        tmp_path / "src", tmp_path / "hop", cfg, "nnx", "linen", changes=changes
    )
    assert hop.target.describe() == "linen, pipeline S=2 R=2 L=4"
    checkpoint.convert_checkpoint(
        tmp_path / "hop", tmp_path / "ref", cfg, "linen", "linen", "reference"
    )
    ref = checkpoint_io.restore(tmp_path / "ref", Spec("linen", "reference", cfg), mesh)
    host_params, host_opt = linen_form(state, "nnx")
    expected = convert.linen_pipeline_to_reference(host_params, cfg)
    assert_bit_exact(jax.device_get(ref.params), expected)
    nu = convert.linen_pipeline_to_reference({"params": host_opt[1][0].nu}, cfg)["params"]
    assert_bit_exact(jax.device_get(ref.opt_state[1][0].nu), nu)
    assert ref.step == 42
    # The reference checkpoint records the last pipeline layout (S=2 L=4); back to the first
    # one, as NNX: unchanged.
    back = checkpoint.convert_checkpoint(
        tmp_path / "ref",
        tmp_path / "back",
        cfg,
        "linen",
        "nnx",
        "pipeline",
        changes=train_state.layout_keys(cfg),
        verify=True,
    )
    assert back.target.describe() == "nnx, pipeline S=4 R=2 L=2 scanned" and not back.differences
    restored = checkpoint_io.restore(tmp_path / "back", spec, mesh)
    assert_bit_exact(linen_form(restored, "nnx"), linen_form(state, "nnx"))


def test_a_failed_check_writes_nothing(linen_ckpt, tmp_path):
    cfg, _ = setup()
    out = checkpoint.convert_checkpoint(
        linen_ckpt,
        tmp_path / "bad",
        cfg,
        "linen",
        "nnx",
        checks={"always-fails": lambda path, spec: [f"{path.name}: differs"]},
    )
    assert out.differences and out.differences[0].endswith(": differs")
    assert list(tmp_path.iterdir()) == []  # no destination, no staging left behind


# ------------------------------------------------------------------ resuming training


@pytest.mark.slow
def test_training_resumed_from_a_converted_checkpoint_takes_the_same_step(linen_ckpt, nnx_ckpt):
    cfg, mesh = setup()
    batch = synthetic_batch(cfg, mesh, step=1)

    linen = checkpoint_io.restore(linen_ckpt, Spec("linen", "pipeline", cfg), mesh)
    linen_step, _ = twins.linen_train_fns(cfg, mesh)
    linen_params, linen_opt, linen_metrics = linen_step(
        linen.params["params"], linen.opt_state, batch
    )
    resumed = checkpoint_io.restore(nnx_ckpt, Spec("nnx", "pipeline", cfg), mesh)
    assert resumed.step == 1 and int(resumed.opt_state[1][0].count) == 1
    nnx_step, _ = twins.nnx_train_fns(cfg, mesh)
    nnx_params, nnx_opt, nnx_metrics = nnx_step(resumed.params, resumed.opt_state, batch)

    # The same next step as an uninterrupted run, bit for bit.
    original = trained_linen()  # copied: the step donates what it is given
    params, opt_state = twins.fresh_copy((original.params["params"], original.opt_state))
    _, _, direct = linen_step(params, opt_state, batch)
    for key in ("loss", "grad_norm"):
        assert np.asarray(nnx_metrics[key]).tobytes() == np.asarray(direct[key]).tobytes()
        assert np.asarray(linen_metrics[key]).tobytes() == np.asarray(direct[key]).tobytes()
    stepped = TrainState(nnx_params, nnx_opt, 2)
    assert_bit_exact(
        linen_form(stepped, "nnx"), jax.device_get(({"params": linen_params}, linen_opt))
    )


# ------------------------------------------------------------------ errors


def _largest_file(path: Path) -> Path:
    return max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(ckpt: Path) -> None:
    big = _largest_file(ckpt / "params")
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 3])


def _flip_bytes(ckpt: Path) -> None:
    big = _largest_file(ckpt / "opt_state")
    data = bytearray(big.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    big.write_bytes(bytes(data))


def _break_manifest(ckpt: Path) -> None:
    (ckpt / "params" / "manifest.ocdbt").write_bytes(b"\0" * 10)


def _break_meta(ckpt: Path) -> None:
    (ckpt / "meta" / "metadata").write_text('{"format": ')


def _drop_item(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "opt_state")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "cannot restore the arrays"),
        (_flip_bytes, "does not match its recorded checksum"),
        (_break_manifest, "cannot read the arrays' metadata"),
        (_break_meta, "cannot read the checkpoint's meta item"),
        (_drop_item, "item(s) opt_state missing"),
    ],
)
def test_damaged_checkpoint_is_refused_and_nothing_is_written(
    damage, message, linen_ckpt, tmp_path
):
    cfg, _ = setup()
    src = tmp_path / "src"
    shutil.copytree(linen_ckpt, src)
    damage(src)
    with pytest.raises(CheckpointError, match=r"corrupt|missing") as error:
        checkpoint.convert_checkpoint(src, tmp_path / "dst", cfg, "linen", "nnx")
    assert message in str(error.value) and str(src) in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    gc.collect()  # the reads Orbax abandoned, here rather than in a later test


def test_missing_checkpoint_is_named(tmp_path):
    cfg, _ = setup()
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        checkpoint.convert_checkpoint(tmp_path / "nope", tmp_path / "dst", cfg, "linen", "nnx")


def test_config_mismatch_names_the_first_paths_and_shapes(linen_ckpt, tmp_path):
    cfg, _ = setup()
    wider = cfg.replace(base_mlp_dim=256)
    with pytest.raises(CheckpointError) as error:
        checkpoint.convert_checkpoint(linen_ckpt, tmp_path / "dst", wider, "linen", "nnx")
    text = str(error.value)
    assert "does not match the config" in text
    assert (
        "params/params/pipeline/layers/layers_0/mlp/wi_0/kernel: checkpoint (2, 4, 64, 128) "
        "float32, config expects (2, 4, 64, 256) float32"
    ) in text
    assert "... and" in text  # more than the first few, counted
    assert "base_mlp_dim=128 (config: 256)" in text
    assert not (tmp_path / "dst").exists()


def test_wrong_framework_is_named(linen_ckpt, tmp_path):
    cfg, _ = setup()
    with pytest.raises(CheckpointError, match="holds linen trees, not nnx"):
        checkpoint.convert_checkpoint(linen_ckpt, tmp_path / "dst", cfg, "nnx", "linen")


def test_dtype_change_needs_dtype(linen_ckpt, tmp_path):
    cfg, mesh = setup()
    bf16 = {"weight_dtype": "bfloat16"}
    with pytest.raises(CheckpointError, match="pass --dtype=bfloat16 to cast"):
        checkpoint.convert_checkpoint(linen_ckpt, tmp_path / "x", cfg, "linen", "nnx", changes=bf16)
    assert not (tmp_path / "x").exists()

    out = checkpoint.convert_checkpoint(
        linen_ckpt, tmp_path / "bf16", cfg, "linen", "nnx", dtype="bfloat16"
    )
    assert out.target.cfg.weight_dtype == "bfloat16"
    state = checkpoint_io.restore(tmp_path / "bf16", out.target, mesh)
    params, opt_state = linen_form(state, "nnx")
    cast = lambda t: jax.tree.map(lambda x: np.asarray(x).astype("bfloat16"), t)
    original = jax.device_get(trained_linen())
    assert_bit_exact(nn.meta.unbox(params), cast(nn.meta.unbox(original.params)))
    assert_bit_exact(
        nn.meta.unbox(opt_state[1][0].mu), cast(nn.meta.unbox(original.opt_state[1][0].mu))
    )
    assert np.asarray(opt_state[1][0].count).dtype == np.int32  # counts are not weights


def test_destination_safety(linen_ckpt, tmp_path):
    cfg, _ = setup()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    # Without --force too, and without advising a --force that would then be refused.
    with pytest.raises(CheckpointError, match=r"not a checkpoint this tool wrote.*even with"):
        checkpoint.convert_checkpoint(linen_ckpt, dst, cfg, "linen", "nnx")
    assert (dst / "keep.txt").read_text() == "mine"

    # --force replaces only a checkpoint this tool wrote, never a directory of other files.
    with pytest.raises(CheckpointError, match=r"not a checkpoint this tool wrote.*even with"):
        checkpoint.convert_checkpoint(linen_ckpt, dst, cfg, "linen", "nnx", force=True)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert (dst / "keep.txt").read_text() == "mine"
    ours = tmp_path / "ours"
    checkpoint.convert_checkpoint(linen_ckpt, ours, cfg, "linen", "nnx")
    with pytest.raises(CheckpointError, match="already exists; pass --force"):
        checkpoint.convert_checkpoint(linen_ckpt, ours, cfg, "linen", "nnx")
    checkpoint.convert_checkpoint(linen_ckpt, ours, cfg, "linen", "nnx", force=True)
    assert meta.read_meta(ours)["framework"] == "nnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "ours"]  # no staging left

    for bad in (linen_ckpt, linen_ckpt / "inner", linen_ckpt.parent):
        with pytest.raises(CheckpointError, match="must not be, contain or lie inside"):
            checkpoint.convert_checkpoint(linen_ckpt, bad, cfg, "linen", "nnx", force=True)
    assert (linen_ckpt / "params").is_dir()


def test_a_checkpoint_manager_step_is_a_checkpoint(tmp_path):
    """Training loops can write checkpoints with their own CheckpointManager."""
    cfg, mesh = setup()
    spec = Spec("nnx", "pipeline", cfg)
    state = random_state(spec, mesh, seed=1)
    with ocp.CheckpointManager(tmp_path, item_names=("params", "opt_state", "meta")) as manager:
        manager.save(42, args=checkpoint_io.save_args(spec, state))
        manager.wait_until_finished()
    restored = checkpoint_io.restore(tmp_path / "42", spec, mesh)
    assert restored.step == 42
    assert_bit_exact(linen_form(restored, "nnx"), linen_form(state, "nnx"))


# ------------------------------------------------------------------ weight tying


def test_a_tied_checkpoint_converts_with_one_shared_leaf_and_refuses_an_untied_config(
    linen_ckpt, tmp_path
):
    """llama2-tiny-tied: the table is one leaf on each side (no logits head leaf, in the
    weights and in both moments), re-staged and verified bit for bit; reading it for the untied
    config, or an untied checkpoint for the tied config, is refused naming the key."""
    cfg, mesh = setup("llama2-tiny-tied")
    spec = Spec("linen", "pipeline", cfg)
    checkpoint_io.save(tmp_path / "tied", spec, random_state(spec, mesh))
    out = checkpoint.convert_checkpoint(
        tmp_path / "tied", tmp_path / "nnx", cfg, "linen", "nnx", changes=RESTAGED, verify=True
    )
    assert out.checks == ("bit-exact",) and not out.differences
    assert out.arrays == 37 - 3  # no logits_dense kernel, nor its two moments
    arrays = meta.read_meta(tmp_path / "nnx")["arrays"]
    assert not any("logits_dense" in key for key in arrays)
    assert sum("token_embedder" in key for key in arrays) == 3  # the weight and its moments

    untied = cfg.replace(logits_via_embedding=False)
    for src, config, written in ((tmp_path / "tied", untied, "true"), (linen_ckpt, cfg, "false")):
        with pytest.raises(CheckpointError) as error:
            checkpoint.convert_checkpoint(src, tmp_path / "dst", config, "linen", "nnx")
        assert f"written with logits_via_embedding={written}" in str(error.value)
        assert f"pass logits_via_embedding={written}" in str(error.value)
        assert not (tmp_path / "dst").exists()


def test_restaging_between_a_subset_and_all_pipelined(tmp_path):
    """N=10: 8 pipelined (S=4 R=2) plus 2 after the pipeline -> all 10 pipelined (S=2 R=5) ->
    the reference layout -> back to the subset, on random values: every layer lands where
    `migrate.common.placement` puts it, bit for bit."""
    cfg, mesh = setup("llama2-tiny-subset")
    spec = Spec("nnx", "pipeline", cfg)
    state = random_state(spec, mesh)
    checkpoint_io.save(tmp_path / "src", spec, state)
    all_pipelined = {
        "ici_pipeline_parallelism": 2,
        "num_pipeline_repeats": 5,
        "pipeline_parallel_layers": -1,
    }
    hop = checkpoint.convert_checkpoint(
        tmp_path / "src", tmp_path / "hop", cfg, "nnx", "linen", changes=all_pipelined
    )
    assert hop.target.describe() == "linen, pipeline S=2 R=5 L=1"
    hop_cfg = hop.target.cfg
    hop_mesh = sharding.make_mesh(hop_cfg)
    mid = checkpoint_io.restore(tmp_path / "hop", hop.target, hop_mesh)
    assert "layers_after_pipeline" not in mid.params["params"]
    host_params, host_opt = linen_form(state, "nnx")
    expected = convert.linen_pipeline_to_reference(host_params, cfg)
    assert_bit_exact(
        convert.linen_pipeline_to_reference(jax.device_get(mid.params), hop_cfg), expected
    )
    checkpoint.convert_checkpoint(
        tmp_path / "hop", tmp_path / "ref", cfg, "linen", "linen", "reference"
    )
    ref = checkpoint_io.restore(tmp_path / "ref", Spec("linen", "reference", cfg), mesh)
    assert_bit_exact(jax.device_get(ref.params), expected)
    mu = convert.linen_pipeline_to_reference({"params": host_opt[1][0].mu}, cfg)["params"]
    assert_bit_exact(jax.device_get(ref.opt_state[1][0].mu), mu)
    back = checkpoint.convert_checkpoint(
        tmp_path / "ref",
        tmp_path / "back",
        cfg,
        "linen",
        "nnx",
        "pipeline",
        changes=train_state.layout_keys(cfg),
        verify=True,
    )
    assert back.target.describe() == "nnx, pipeline S=4 R=2 L=1 +2 after"
    assert not back.differences
    restored = checkpoint_io.restore(tmp_path / "back", spec, mesh)
    assert_bit_exact(linen_form(restored, "nnx"), linen_form(state, "nnx"))
