"""MaxText checkpoints across a real migration: written by MaxText 0.2.3's own `train.py`,
restored by 0.2.5's own restore path and trained one more step by each release (bit-exact),
then converted into the twins (Linen and NNX, pipeline and reference) and back (bit-exact).
One checkpoint, written once per session, serves every test here; skipped, saying why, where
the MaxText environments were not built. The map's own facts run everywhere."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
from conftest import session_root
from hostile import CONFIGS, TINY

from migrate.checkpoints import maxtext_layouts
from migrate.checkpoints.meta import CheckpointError
from migrate.checkpoints.weight_map import WeightMapError
from parity.maxtext import gate_config

MISSING = [s for s in gate_config.RELEASES if gate_config.default_python(s) is None]
if sys.version_info < (3, 12):
    WHY = "MaxText runs on the default stack (Python 3.12)"
else:
    WHY = f"MaxText environments not built ({MISSING}): run make maxtext-envs"
needs_envs = pytest.mark.skipif(bool(MISSING) or sys.version_info < (3, 12), reason=WHY)
# The twins' config with the dims of configs/maxtext/pp4.yml (MaxText's keys, the same names).
TWIN_KEYS = [
    "ici_pipeline_parallelism=4", "num_pipeline_repeats=1", "num_pipeline_microbatches=4",
    "base_num_decoder_layers=4", "base_num_kv_heads=4", "vocab_size=128",
]  # fmt: skip
WRITTEN_STEPS = 3  # 0.2.3 trains steps 0..2 and checkpoints the last: RUN/checkpoints/2


@pytest.fixture(scope="session")
def crossed(tmp_path_factory):
    """0.2.3 writes, both restore, both train one more step: (verdict, facts, checkpoint).
    Run once per session, whatever the pytest-xdist workers: the first one to take the lock
    writes it into the session's shared temporary root, the others read its result."""
    import dataclasses
    import json

    from filelock import FileLock

    from parity.engine.result import CheckResult
    from parity.maxtext import checkpoint_gate
    from parity.remote.environments import Environment

    shared = session_root(tmp_path_factory) / "maxtext-checkpoint"
    directory, saved = shared / "run", shared / "result.json"
    with FileLock(str(shared) + ".lock"):
        if not saved.exists():
            shared.mkdir(exist_ok=True)
            config = gate_config.load(CONFIGS / "maxtext" / "pp4.yml", [])
            environments = {s: Environment(gate_config.default_python(s)) for s in ("linen", "nnx")}
            directory.mkdir()
            verdict, facts = checkpoint_gate.cross_release(
                config, environments, directory, WRITTEN_STEPS
            )
            saved.write_text(json.dumps({"verdict": dataclasses.asdict(verdict), "facts": facts}))
    data = json.loads(saved.read_text())
    verdict = CheckResult(**{**data["verdict"], "details": tuple(data["verdict"]["details"])})
    checkpoint = directory / "written" / "checkpoints" / str(WRITTEN_STEPS - 1)
    return verdict, data["facts"], checkpoint


def twin_config(more=()):
    from migrate.config.loading import load_config

    return load_config(TINY, [*TWIN_KEYS, *more])


# ------------------------------------------------------------------ the map (no MaxText)


def test_the_query_scale_is_a_power_of_two_and_moves_both_moments_by_the_chain_rule():
    assert maxtext_layouts.twins_map(16).exact and maxtext_layouts.twins_map(64, "nu").exact
    assert maxtext_layouts.query_scale(16) == 4.0
    assert (
        maxtext_layouts.query_scale(16, "mu") == 0.25
        and maxtext_layouts.query_scale(16, "nu") == 1 / 16
    )
    assert not maxtext_layouts.twins_map(32).exact  # sqrt(32): not exact both ways, refused
    with pytest.raises(CheckpointError, match="head_dim 32"):
        maxtext_layouts.to_twins({}, 32)


def test_the_map_moves_maxtexts_scan_axis_and_scales_only_the_query():
    rng = np.random.default_rng(0)
    query = rng.standard_normal((64, 4, 4, 16)).astype(np.float32)  # [embed, layers, heads, kv]
    key = rng.standard_normal((64, 4, 4, 16)).astype(np.float32)
    source = {
        ("decoder", "layers", "self_attention", "query", "kernel"): query,
        ("decoder", "layers", "self_attention", "key", "kernel"): key,
    }
    twins = maxtext_layouts.twins_map(16, "params", "scan").forward(source)
    assert np.array_equal(twins[("layers", "self_attention", "query", "kernel")],
                          np.moveaxis(query, 1, 0) * 4)  # fmt: skip
    assert np.array_equal(twins[("layers", "self_attention", "key", "kernel")],
                          np.moveaxis(key, 1, 0))  # fmt: skip
    back = maxtext_layouts.twins_map(16, "params", "scan").backward(twins)
    assert all(back[p].tobytes() == source[p].tobytes() for p in source)
    with pytest.raises(WeightMapError, match="decoder/extra"):
        maxtext_layouts.twins_map(16).forward({("decoder", "extra", "kernel"): key})


# ------------------------------------------------------------------ MaxText's own runs


@needs_envs
@pytest.mark.slow
def test_a_0_2_3_checkpoint_restored_and_trained_by_0_2_5_is_bit_exact(crossed):
    """Every parameter, both Adam moments, the counts and the step restore bit for bit (the
    step's dtype difference declared), each release's restored model gives the same logits,
    both loops resume at the step after the written one,
    and one more step gives the same loss, grad norms and every updated leaf."""
    from parity.maxtext.checkpoint_gate import kind_table

    verdict, facts, _ = crossed
    assert verdict.passed, (verdict.where, verdict.message)
    assert tuple(facts["first_step"]) == (WRITTEN_STEPS, WRITTEN_STEPS)
    rows = {(r["where"], r["kind"]): r for r in kind_table(verdict.details)}
    for where in ("restored", f"step {WRITTEN_STEPS}", "reverse"):
        for kind, leaves in (("params", 12), ("mu", 12), ("nu", 12), ("count", 2), ("step", 1)):
            row = rows[where, kind]
            assert (row["leaves"], row["equal"], row["differs"]) == (leaves, leaves, 0), row
        assert rows[where, "step"]["dtype"] == "0.2.3 int32 vs 0.2.5 uint32"
        assert rows[where, "rng"]["one_side"] == 12  # 0.2.5's RNG state, listed
    tensors = {r["tensor"]: r for r in verdict.details}
    assert tensors["restored/logits"]["mismatches"] == 0  # each restored model's own logits
    loss = tensors[f"step {WRITTEN_STEPS}/learning/loss"]
    assert loss["linen"] == loss["nnx"] and 0 < loss["linen"] < np.log(128) + 1


@needs_envs
@pytest.mark.slow
@pytest.mark.parametrize(("framework", "layout"), [("linen", "pipeline"), ("nnx", "reference")])
def test_a_maxtext_checkpoint_into_the_twins_and_back_is_bit_exact(
    crossed, framework, layout, tmp_path
):
    from migrate.checkpoints import maxtext_commands
    from migrate.checkpoints.checkpoint_io import restore
    from migrate.checkpoints.meta import read_meta
    from migrate.checkpoints.train_state import Spec, to_pure
    from migrate.common import sharding

    _, _, checkpoint = crossed
    cfg = twin_config()
    outcome = maxtext_commands.into_twins(checkpoint, tmp_path / "twins", cfg, framework, layout)
    assert (outcome.release, outcome.step, outcome.stacking) == ("0.2.3", 3, "pipeline")
    assert read_meta(tmp_path / "twins")["framework"] == framework
    state = restore(tmp_path / "twins", Spec(framework, layout, cfg), sharding.make_mesh(cfg))
    query = maxtext_layouts.read(checkpoint)[
        ("params", "params", "decoder", "pipeline_module", "layers", "self_attention", "query",
         "kernel")]  # fmt: skip
    flat = {"/".join(map(str, k)): v for k, v in _flat(to_pure(state.params)).items()}
    twin_query = next(v for k, v in flat.items() if k.endswith("query/kernel"))
    if layout == "reference":  # the query scaled by sqrt(head_dim), exactly
        assert np.array_equal(np.asarray(twin_query), query * 4)

    maxtext_commands.from_twins(tmp_path / "twins", tmp_path / "back", cfg, verify=True)
    original, again = (
        maxtext_layouts.read(checkpoint),
        maxtext_layouts.read(tmp_path / "back" / "2"),
    )
    assert set(again) == set(original)
    for path in original:
        assert original[path].dtype == again[path].dtype, path
        assert original[path].tobytes() == again[path].tobytes(), path


def _flat(tree, prefix=()):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, (*prefix, k)))
        return out
    return {prefix: tree}


@needs_envs
@pytest.mark.slow
def test_a_doctored_or_mismatched_maxtext_checkpoint_is_refused_and_nothing_is_written(
    crossed, tmp_path
):
    from migrate.checkpoints import maxtext_commands
    from migrate.config.loading import load_config

    _, _, checkpoint = crossed
    wrong = load_config(TINY, [*TWIN_KEYS, "vocab_size=256"])
    with pytest.raises(CheckpointError, match="token_embedder/embedding"):
        maxtext_commands.into_twins(checkpoint, tmp_path / "a", wrong, "nnx", "reference")
    doctored = tmp_path / "doctored"
    shutil.copytree(checkpoint, doctored)
    for data in (doctored / "items").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: len(data.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        maxtext_commands.into_twins(doctored, tmp_path / "b", twin_config(), "nnx", "reference")
    with pytest.raises(CheckpointError, match="not a MaxText checkpoint"):
        maxtext_commands.into_twins(tmp_path, tmp_path / "c", twin_config(), "nnx", "reference")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doctored"]  # nothing written


@needs_envs
@pytest.mark.slow
def test_the_twins_logits_on_maxtext_trained_weights_match_maxtexts_within_the_f32_tier(crossed):
    """MaxText 0.2.3's own logits and loss on its checkpoint's weights against the twins'
    (mapped, the reference layout): the same math on other programs, within float32's
    reshaped tier (measured 5.2e-7 relative, docs/checkpoints.md), and not vacuous."""
    import maxtext_twins_logits as twins_logits

    from parity.remote.environments import Environment

    _, _, checkpoint = crossed
    config = gate_config.load(CONFIGS / "maxtext" / "pp4.yml", [])
    environment = Environment(gate_config.default_python("linen"))
    measured = twins_logits.measure(
        checkpoint, config, twin_config(["per_device_batch_size=1"]), environment, "linen",
        layouts=("reference",),  # the twins' pipeline equals their reference (test_train.py)
    )  # fmt: skip
    for layout in ("reference",):
        for name in ("logits", "loss"):
            diff = measured[layout][name]
            assert diff.passes(twins_logits.TOLERANCE), (layout, name, diff)


@needs_envs
@pytest.mark.slow
def test_migrate_converts_and_compares_maxtext_checkpoints_with_its_exit_codes(crossed, tmp_path):
    from hostile import run

    _, _, checkpoint = crossed
    common = ["--config=" + TINY]
    status = lambda result: (result.returncode, result.stderr.decode()[-2000:])
    twins, back = str(tmp_path / "twins"), str(tmp_path / "back")
    into = run("migrate", "convert", *common, "--from=maxtext", "--to=nnx", "--verify",
               str(checkpoint), twins, *TWIN_KEYS, timeout=300)  # fmt: skip
    assert status(into)[0] == 0, status(into)
    assert b"MaxText 0.2.3, step 3" in into.stdout
    out = run("migrate", "convert", *common, "--from=nnx", "--to=maxtext", "--verify",
              twins, back, *TWIN_KEYS, timeout=300)  # fmt: skip
    assert status(out)[0] == 0, status(out)
    same = run("migrate", "compare", *common, str(checkpoint), back + "/2", *TWIN_KEYS,
               timeout=300)  # fmt: skip
    assert status(same)[0] == 0 and b"bit-identical" in same.stdout, status(same)
    later = checkpoint.parent.parent.parent / "resumed-linen" / "checkpoints" / "3"
    differ = run("migrate", "compare", *common, twins, str(later), *TWIN_KEYS, timeout=300)
    assert status(differ)[0] == 1 and b"values differ" in differ.stdout, status(differ)
    again = run("migrate", "convert", *common, "--from=maxtext", "--to=nnx", str(checkpoint),
                twins, *TWIN_KEYS, timeout=300)  # fmt: skip
    assert status(again)[0] == 2 and "already exists" in status(again)[1], status(again)


# ------------------------------------------------------------------ the gate's comparison


def _states(rng):
    """A Linen-layout state and the same state as 0.2.5's TrainStateNNX would hold it."""
    kernel = rng.standard_normal((4, 8)).astype(np.float32)
    mu, nu = kernel * 0.1, kernel**2
    linen = {
        ("step",): np.int32(3),
        ("params", "params", "decoder", "w", "kernel"): kernel,
        ("opt_state", "0", "count"): np.int32(3),
        ("opt_state", "0", "mu", "params", "decoder", "w", "kernel"): mu,
        ("opt_state", "0", "nu", "params", "decoder", "w", "kernel"): nu,
    }
    nnx = {
        ("optimizer", "step"): np.uint32(3),
        ("model", "decoder", "w", "kernel"): kernel.copy(),
        ("model", "decoder", "rngs", "dropout", "key"): np.zeros(4, np.uint32),
        ("optimizer", "opt_state", "0", "count"): np.int32(3),
        ("optimizer", "opt_state", "0", "mu", "decoder", "w", "kernel"): mu.copy(),
        ("optimizer", "opt_state", "0", "nu", "decoder", "w", "kernel"): nu.copy(),
    }
    return linen, nnx


def test_the_gate_names_a_differing_leaf_a_missing_leaf_and_an_undeclared_dtype():
    from parity.maxtext.checkpoint_gate import state_records, vacuity

    linen, nnx = _states(np.random.default_rng(0))
    records = state_records("restored", linen, nnx)
    assert all(r["passed"] for r in records), [r for r in records if not r["passed"]]
    assert [r["kind"] for r in records if r["tensor"].startswith("restored/nnx-only")] == ["rng"]
    assert vacuity(linen, [{"learning/loss": 5.0}]) == []

    moved = dict(nnx)
    moved[("optimizer", "opt_state", "0", "mu", "decoder", "w", "kernel")] = nnx[
        ("optimizer", "opt_state", "0", "mu", "decoder", "w", "kernel")
    ] * np.float32(1 + 2**-20)
    failing = [r for r in state_records("restored", linen, moved) if not r["passed"]]
    assert [r["tensor"] for r in failing] == ["restored/opt_state/0/mu/params/decoder/w/kernel"]
    assert failing[0]["max_abs"] > 0

    missing = {k: v for k, v in nnx.items() if k[-1] != "count"}
    failing = [r for r in state_records("restored", linen, missing) if not r["passed"]]
    assert [(r["tensor"], r["note"]) for r in failing] == [
        ("restored/opt_state/0/count", "in 0.2.3 (Linen) only")
    ]
    wide = {**nnx, ("optimizer", "step"): np.int64(3)}
    failing = [r for r in state_records("restored", linen, wide) if not r["passed"]]
    assert [(r["tensor"], r["note"]) for r in failing] == [("restored/step", "dtype differs")]

    zeros = {k: (np.zeros_like(v) if "mu" in k else v) for k, v in linen.items()}
    assert vacuity(zeros, [{"learning/loss": 5.0}]) == [
        "the written checkpoint's Adam mu is all zero"
    ]
