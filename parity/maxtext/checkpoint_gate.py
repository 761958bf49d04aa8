"""A MaxText 0.2.3 checkpoint across the release boundary, gated: written by 0.2.3's own
`train.py`, restored by 0.2.5's own restore path, compared leaf by leaf, then trained one more
step by each release (`parity.maxtext.train_factory` in each release's worker).

    python -m parity.maxtext.checkpoint_gate configs/maxtext/pp4.yml [key=value ...]

What the check compares (one `CheckResult`, `checkpoint`, exact: the releases run the same
arithmetic, `docs/maxtext.md`):
- `restored/...`: the state 0.2.5 restores (its `TrainStateNNX`, mapped onto the Linen layout
  by the declared `migrate.checkpoints.maxtext_layouts.NNX_TO_LINEN`) against the state 0.2.3
  restores from the same files: every parameter, both Adam moments, the counts, the step
  (its value; the dtype difference is declared); NNX-only leaves (RNG state) are listed;
- `restored/logits`: each release's restored model's own logits on the same tokens;
- `restored/first_step`: the step each release's loop executes first;
- `step N/...`: one more step of each release's `train.py` from its restored state: the loss,
  the grad norm (raw and clipped) as MaxText logs them, and every leaf of the state each
  release then restores from its new checkpoint;
- `reverse/...`: 0.2.3 restoring the checkpoint 0.2.5 wrote after that step, against 0.2.5's
  own restore of it, and the step 0.2.3 would execute first.
A leaf present on one side only is a failed record naming the path; a differing one has both
values' largest difference.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from migrate.checkpoints import maxtext_layouts
from parity.analysis import compare
from parity.engine import result
from parity.maxtext import train_worker
from parity.maxtext.gate_batch import batch
from parity.maxtext.gate_config import CHECKPOINT_STEPS, MaxTextConfig
from parity.maxtext.train_factory import LOGITS
from parity.remote.client import WorkerSet
from parity.reports.progress import progress

METRICS = ("learning/loss", "learning/grad_norm", "learning/raw_grad_norm")
TOLERANCE = compare.EXACT  # the same program on both releases: no looser tier


def as_linen(nnx_flat: dict) -> tuple[dict, list]:
    """The NNX state's leaves on the Linen layout's paths, and the NNX-only paths."""
    only = [p for p in nnx_flat if maxtext_layouts.nnx_only(p)]
    kept = {p: a for p, a in nnx_flat.items() if not maxtext_layouts.nnx_only(p)}
    return maxtext_layouts.NNX_TO_LINEN.forward(kept), only


def state_records(prefix: str, linen: dict, nnx_flat: dict) -> list[dict]:
    """Each Linen-layout leaf: 0.2.5's (mapped) against 0.2.3's, bit for bit; the step's
    declared dtype difference noted, any other dtype difference failed; leaves on one side
    only failed (NNX-only RNG state: declared, listed)."""
    mapped, only = as_linen(nnx_flat)
    records = []
    for path in [*linen, *(p for p in mapped if p not in linen)]:
        tensor = f"{prefix}/{'/'.join(path)}"
        if path not in linen or path not in mapped:
            side = "0.2.3 (Linen)" if path in linen else "0.2.5 (NNX)"
            records.append(result.one_sided_record(tensor, f"in {side} only"))
            continue
        ours, theirs = np.asarray(mapped[path]), np.asarray(linen[path])
        if ours.shape != theirs.shape:
            note = f"shape: 0.2.3 {theirs.shape} vs 0.2.5 {ours.shape}"
            records.append(result.one_sided_record(tensor, note))
            continue
        record = result.numeric_records(
            prefix, [compare.leaf_diff("/".join(path), ours, theirs)], TOLERANCE
        )[0]
        record["kind"] = maxtext_layouts.leaf_kind(path)
        record["mapped"] = True  # every leaf has another path in the NNX state (NNX_TO_LINEN)
        record["passed"] = record["passed"] and record["mismatches"] == 0
        if str(ours.dtype) != str(theirs.dtype):
            record["dtype"] = f"0.2.3 {theirs.dtype} vs 0.2.5 {ours.dtype}"
            declared = path == ("step",) and (str(theirs.dtype), str(ours.dtype)) == (
                maxtext_layouts.STEP_DTYPES["linen"],
                maxtext_layouts.STEP_DTYPES["nnx"],
            )
            record["passed"] = record["passed"] and declared
            record["note"] = "declared dtype difference" if declared else "dtype differs"
        records.append(record)
    for path in only:
        records.append(
            {
                "tensor": f"{prefix}/nnx-only/{'/'.join(path)}",
                "passed": True,
                "max_rel": 0.0,
                "max_abs": 0.0,
                "kind": "rng",
                "mapped": False,
                "note": "0.2.5 RNG state (nnx_aux on disk); 0.2.3 has none",
            }
        )
    return records


def metric_records(prefix: str, linen: list[dict], nnx: list[dict], step: int) -> list[dict]:
    """The last logged step's loss and grad norms, exact; the step both logged must be `step`."""
    records = [
        result.fact_record(
            f"{prefix}/logged step",
            linen[-1]["step"] == nnx[-1]["step"] == step,
            linen[-1]["step"],
            nnx[-1]["step"],
        )
    ]
    for name in METRICS:
        diff = compare.leaf_diff(name, np.float32(nnx[-1][name]), np.float32(linen[-1][name]))
        record = result.numeric_records(prefix, [diff], TOLERANCE)[0]
        record.update(linen=linen[-1][name], nnx=nnx[-1][name])
        records.append(record)
    return records


def vacuity(linen_restored: dict, metrics: list[dict]) -> list[str]:
    """A checkpoint that proves nothing: moments still zero, or a loss that is not finite."""
    problems = []
    for moment in ("mu", "nu"):
        leaves = [a for p, a in linen_restored.items() if maxtext_layouts.leaf_kind(p) == moment]
        if not leaves or all(not np.any(a) for a in leaves):
            problems.append(f"the written checkpoint's Adam {moment} is all zero")
    if not all(np.isfinite(m["learning/loss"]) for m in metrics):
        problems.append("a logged loss is not finite")
    return problems


def cross_release(
    config: MaxTextConfig, environments: dict, directory: Path, steps: int = CHECKPOINT_STEPS
) -> tuple[result.CheckResult, dict[str, Any]]:
    """Write with 0.2.3 (`steps` steps, the last checkpointed), restore with both releases,
    one more step on each; the `checkpoint` verdict and the facts (first steps, metrics). Each
    stage says so on stderr, and a call to a worker that runs long says so every 30 s (each
    `train.py` run compiles MaxText's model: minutes here)."""
    workers = WorkerSet()
    variables = {
        "DECOUPLE_GCLOUD": "TRUE",
        "XLA_FLAGS": train_worker.simulated_device_flags(config.num_devices),
    }
    try:
        trainers = train_worker.start(workers, config, environments, variables)
        linen, nnx = trainers["linen"], trainers["nnx"]
        root = str(directory)
        trains = f"{steps} step{'s' if steps > 1 else ''}"
        progress(f"checkpoint: 0.2.3's train.py trains {trains}, checkpointing the last")
        written = linen.train(root, "written", steps, checkpoint_period=steps)
        progress("checkpoint: 0.2.3 and 0.2.5 each restore it with their own restore path")
        for side in ("linen", "nnx"):
            shutil.copytree(directory / "written", directory / f"resumed-{side}")
        tokens = batch(config.keys, config.num_devices, 0, 0, "eval")["inputs"].tolist()
        restored_l, facts_l = linen.restore(root, "resumed-linen", steps + 1, tokens)
        restored_n, facts_n = nnx.restore(root, "resumed-nnx", steps + 1, tokens)
        logits_l, logits_n = restored_l.pop(LOGITS), restored_n.pop(LOGITS)
        progress(f"checkpoint: step {steps} on each release's train.py, from what it restored")
        trained_l = linen.train(root, "resumed-linen", steps + 1, checkpoint_period=steps)
        trained_n = nnx.train(root, "resumed-nnx", steps + 1, checkpoint_period=steps)
        progress("checkpoint: each release restores its new checkpoint; 0.2.3 restores 0.2.5's")
        after_l, _ = linen.restore(root, "resumed-linen", steps + 2)
        after_n, _ = nnx.restore(root, "resumed-nnx", steps + 2)
        # the reverse: 0.2.3 restores what 0.2.5 wrote (it ignores 0.2.5's nnx_aux)
        reverse_l, reverse_facts = linen.restore(root, "resumed-nnx", steps + 2)
    finally:
        workers.close()
    records = state_records("restored", restored_l, restored_n)
    logits = compare.leaf_diff("logits", logits_n, logits_l)
    records += result.numeric_records("restored", [logits], TOLERANCE)
    first = (facts_l["first_step"], facts_n["first_step"])
    records.append(
        result.fact_record("restored/first_step", first[0] == first[1] == steps, first[0], first[1])
    )
    records += metric_records(f"step {steps}", trained_l["metrics"], trained_n["metrics"], steps)
    records += state_records(f"step {steps}", after_l, after_n)
    records += state_records("reverse", reverse_l, after_n)
    records.append(
        result.fact_record(
            "reverse/first_step",
            reverse_facts["first_step"] == steps + 1,
            reverse_facts["first_step"],
            steps + 1,
        )
    )
    problems = vacuity(restored_l, written["metrics"] + trained_l["metrics"])
    if np.ptp(logits_l) == 0:
        problems.append("the restored model's logits are constant")
    verdict = result.verdict(
        "checkpoint",
        records,
        TOLERANCE,
        problems,
        note="0.2.3's checkpoint restored and trained by 0.2.5: bit-exact",
    )
    facts = {
        "first_step": first,
        "written": written["metrics"],
        "trained": {"linen": trained_l["metrics"], "nnx": trained_n["metrics"]},
    }
    return verdict, facts


def kind_table(records: tuple[dict, ...] | list[dict]) -> list[dict]:
    """Per prefix and leaf kind: leaves, how many are equal bit for bit, how many were mapped
    (another path or dtype), how many differ, the largest difference; `one_side`: leaves only
    one release has (0.2.5's RNG state)."""
    rows: dict[tuple[str, str], dict] = {}
    for record in records:
        if "kind" not in record:
            continue
        prefix = record["tensor"].split("/", 1)[0]
        row = rows.setdefault(
            (prefix, record["kind"]),
            {
                "where": prefix,
                "kind": record["kind"],
                "leaves": 0,
                "equal": 0,
                "mapped": 0,
                "differs": 0,
                "max_abs": 0.0,
                "dtype": "",
            },
        )
        row["leaves"] += 1
        if record["kind"] == "rng":  # on the NNX side only: neither equal nor different
            row["one_side"] = row.get("one_side", 0) + 1
            continue
        row["equal"] += int(record["passed"] and record.get("mismatches", 0) == 0)
        row["mapped"] += int(bool(record.get("mapped")) or "dtype" in record)
        row["differs"] += int(not record["passed"])
        row["max_abs"] = max(row["max_abs"], float(record.get("max_abs", 0.0)))
        row["dtype"] = record.get("dtype", row["dtype"])
    return list(rows.values())


def main(argv: list[str]) -> int:
    """`python -m parity.maxtext.checkpoint_gate CONFIG [key=value ...]`: the exit status."""
    from migrate.errors import BadInput
    from migrate.runtime import cli_support
    from parity.maxtext import gate_config
    from parity.remote.environments import Environment
    from parity.reports import report

    def run() -> int:
        if len(argv) < 2:
            raise BadInput("usage: maxtext_checkpoint CONFIG [key=value ...]")
        config = gate_config.load(argv[1], argv[2:])
        environments = {}
        for side, release in gate_config.RELEASES.items():
            python = gate_config.default_python(side)
            if python is None:
                raise BadInput(f"no MaxText {release} environment: make maxtext-envs")
            environments[side] = Environment(python)
        with tempfile.TemporaryDirectory(prefix="maxtext-checkpoint-") as directory:
            verdict, facts = cross_release(config, environments, Path(directory))
        for row in kind_table(verdict.details):
            print(
                f"{row['where']:>10} {row['kind']:>7}: {row['leaves']:3d} leaves, "
                f"{row['equal']} equal, {row['mapped']} mapped, {row['differs']} differ, "
                f"{row.get('one_side', 0)} on one side only, max_abs {row['max_abs']:.3g}"
                + (f" ({row['dtype']})" if row["dtype"] else ""),
                file=sys.stderr,
            )
        print(f"first step (0.2.3, 0.2.5): {facts['first_step']}", file=sys.stderr)
        report.render_table([verdict], config.model_name)
        return result.EXIT_STATUS[verdict.status]

    return cli_support.guarded("maxtext_checkpoint", run, lambda: False)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
