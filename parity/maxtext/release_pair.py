"""MaxText's Linen decoder (one release, in its environment) against its NNX decoder (another
release, in its own): `parity configs/maxtext/NAME.yml --maxtext --linen_python=...
--nnx_python=...`.

The config is a YAML of MaxText keys (MaxText's names and values, as its users type them on
`train.py`'s command line), `key=value` overrides on top; each side builds its model from its
own release's `base.yml` with them (`parity.maxtext.decoder_factory`). The weights travel as
MaxText's own parameter paths (identical in 0.2.3 and 0.2.5; `RELEASES` declares the logical
names that differ, by the kind of parameter); what differs between the releases is reported by
the checks, not mapped away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from migrate.checkpoints.weight_map import Entry, WeightMap
from migrate.errors import BadInput
from parity.analysis import compare
from parity.engine.pair import Pair, lm_vacuity_problems
from parity.engine.registry import Check, Front
from parity.engine.side import Run
from parity.maxtext import gate_config, release_fault
from parity.maxtext.gate_batch import batch
from parity.maxtext.gate_config import MaxTextConfig
from parity.remote.client import WorkerError, WorkerSet
from parity.remote.environments import Environment
from parity.remote.proxy import RemoteSide
from parity.reports.progress import progress, workers_line

FACTORY = "parity.maxtext.decoder_factory:make"
# MaxText 0.2.3 (Linen) -> 0.2.5 (NNX): every parameter keeps its path, shape and dtype
# (measured on every family of docs/maxtext.md). Two declared differences of logical names,
# each on every module of its kind whatever the family names it: 0.2.5 names the embed
# dimension of the attention kernels `embed_attn` (0.2.3: `embed`; gemma2's
# `self_attention_local`/`_global`, MLA's `wkv_a` included) and that of the MoE routers
# `embed_router` (0.2.3: `embed_moe`; deepseek's and llama4's; mixtral's router carries `embed`
# in both), logical names of their own that its rules shard as the old ones (the `sharding`
# check compares the placements themselves).
ATTENTION = r"params/{path...}/{attention~self_attention(_\w+)?}/{projection}/kernel"
ROUTER = r"params/{path...}/{router~MoeBlock_\d+}/gate/kernel"
RELEASES = WeightMap(
    "maxtext 0.2.3 -> 0.2.5",
    (
        Entry("{path...}", "{path...}"),
        Entry(
            ATTENTION,
            ATTENTION,
            names=(("embed", "embed_attn"),),
            note="0.2.5 names the attention kernels' embed dimension embed_attn",
        ),
        Entry(
            ROUTER,
            ROUTER,
            names=(("embed_moe", "embed_router"),),
            note="0.2.5 names the MoE routers' embed dimension embed_router",
        ),
    ),
)
# Linen (0.2.3) against NNX (0.2.5): bit-exact on every shape measured, circular repeats, the
# forwarding delay and ag-per-repeat with two microbatches per stage included (max_rel 0 in
# `forward`, `grads` and `train`; docs/maxtext.md). A hand probe had seen 1.5e-7 relative with
# M > S; with both releases' parameters placed by their logical names (as MaxText's trainer
# places them, `MaxTextSide.own_weights`) the difference is gone, so no looser tier exists by
# default. A family config may declare one beside its located cause (`gate:`, `tolerance`).
TOLERANCE = compare.EXACT
NUMERIC_CHECKS = ("forward", "grads", "train", "layers")  # held to the pair's tolerance


def tolerance(config: MaxTextConfig) -> compare.Tolerance:
    """The tier `config` declares (`gate_config.DeclaredTier`), else `TOLERANCE`."""
    if config.declared is None:
        return TOLERANCE
    tier = compare.TIERS[config.declared.tier]
    return compare.Tolerance(tier.max_rel, f"declared tier {config.declared.tier}: {tier.reason}")


def with_tiers(result: Any, declared: gate_config.DeclaredTier | None) -> Any:
    """A numeric check's result with each compared record's `tier` (`compare.tier`) and, where
    the config declares a tier, a first record `declared tier` (`tier`, `why`, and `held`: the
    tier of the check's largest difference) and both in the message."""
    import dataclasses

    if result.metric != "max_rel" or result.status not in ("passed", "failed"):
        return result
    details = tuple(
        r | {"tier": compare.tier(r["max_rel"])} if "ulp_at_scale" in r and "tier" not in r else r
        for r in result.details
    )
    if declared is None:
        return dataclasses.replace(result, details=details)
    numeric = [r for r in details if "ulp_at_scale" in r]
    worst = max(numeric, key=lambda r: r["max_rel"], default={"max_rel": 0.0, "ulp_at_scale": 0})
    held, ulp = compare.tier(worst["max_rel"]), worst["ulp_at_scale"]
    record = {
        "tensor": "declared tier",
        "passed": True,
        "max_rel": 0.0,
        "tier": declared.tier,
        "why": declared.why,
        "held": held,
    }
    message = f"{result.message}; held: {held} ({ulp:.3g} ulp at scale); why: {declared.why}"
    return dataclasses.replace(result, details=(record, *details), message=message)


class MaxTextPair(Pair):
    """MaxText's two decoders, each in the worker of its environment."""

    front = Front.MAXTEXT
    output_name = "logits"
    forward_parts = ("logits", "loss")
    program_name = "forward+backward"
    programs_on_mesh = True  # each side's own MaxText mesh, its shardings rebuilt here

    def __init__(
        self,
        config: MaxTextConfig,
        environments: dict[str, Environment],
        seed: int = 0,
        started: dict[str, RemoteSide] | None = None,
        checkpoint_steps: int = gate_config.CHECKPOINT_STEPS,
        drill_pipeline: bool = False,
    ) -> None:
        """`started`: sides already running for this config and seed (another pair's, e.g. one
        Linen release against several NNX builds): used as they are, not restarted, and left
        running when the other side fails to start. `checkpoint_steps`: the steps 0.2.3's
        `train.py` trains before it checkpoints (`checkpoint`). `drill_pipeline`: `pipeline`
        drills down module by module even where it passes (`layers` asked for beside it)."""
        self.config, self.keys = config, config.keys
        self.drill_pipeline = drill_pipeline
        self.oracle_sides = ("linen", "nnx")  # the releases `pipeline` holds to their own
        self.environments, self.seed = environments, seed
        self.devices = config.num_devices
        self.checkpoint_steps = checkpoint_steps
        self.workers = WorkerSet()
        started = started or {}
        for framework, side in started.items():
            self.workers[framework] = side.worker
        with self.workers.closed_on_failure():  # one side failed: the other one stops too
            sides = self._started(started)
        super().__init__(sides["linen"], sides["nnx"], tolerance(config))

    def _started(self, started: dict[str, RemoteSide]) -> dict[str, RemoteSide]:
        """Both sides, each started unless given; where a release's own code raises as it
        builds its side, `release_fault.Faults` once both have been tried (what the other
        release did with the same config is part of the finding)."""
        sides, faults = dict(started), {}
        for framework in ("linen", "nnx"):
            if framework in sides:
                continue
            try:
                sides[framework] = self._side(framework)
            except WorkerError as e:
                fault = release_fault.of(e, framework)
                if fault is None:
                    raise
                faults[framework] = fault
        if faults:
            raise release_fault.Faults("building its decoder", faults, list(sides))
        return sides

    def sides(self) -> dict[str, dict[str, Any]]:
        """Per side, what its worker runs: MaxText's, Python's, JAX's and flax's versions, and
        its interpreter (the JSON report's `sides`)."""
        return {
            side: {**worker.versions(), "interpreter": worker.python}
            for side, worker in self.workers.items()
        }

    def _side(self, framework: str) -> RemoteSide:
        env = self.environments[framework]
        return start_side(self.config, framework, env, self.workers, self.seed)

    def prepared(self, check: Check, function: Callable[..., Any]) -> Callable[..., Any]:
        """The numeric checks with each record's tier and the config's declared one
        (`with_tiers`); every check with a release's own exception as its verdict
        (`release_fault.guarded`)."""
        if check.name in NUMERIC_CHECKS:
            declared, plain = self.config.declared, function

            def function(pair: MaxTextPair, *args: Any) -> Any:
                return with_tiers(plain(pair, *args), declared)

        return release_fault.guarded(check.name, function)

    def batch(self, step: int = 0, split: str = "train") -> dict:
        return batch(self.keys, self.devices, self.seed, step, split)

    def vacuity(self, run: Run) -> list[str]:
        return lm_vacuity_problems(run, int(self.keys["vocab_size"]))


def run_gate(
    config: MaxTextConfig,
    environments: dict[str, Environment],
    selected: list[str],
    steps: int,
    checkpoint_steps: int = gate_config.CHECKPOINT_STEPS,
) -> tuple[list, list, dict[str, dict[str, Any]]]:
    """`parity --maxtext`'s run: both releases' workers started, the `selected` checks run on
    them (`steps`: the train check's), every worker stopped however the run ends (a side that
    fails to start, a lost worker, an interrupt). (results, costs, the sides' versions)."""
    from parity.engine import compiles, run_loop

    unbuilt: release_fault.Faults | None = None
    with compiles.measure() as cost:
        try:
            pair = MaxTextPair(
                config,
                environments,
                checkpoint_steps=checkpoint_steps,
                drill_pipeline="layers" in selected,
            )
        except release_fault.Faults as e:  # a release cannot build the config: no check runs
            if (bad := e.bad_input()) is not None:
                raise BadInput(bad) from None
            unbuilt = e
    if unbuilt is not None:
        progress(f"build: FAILED ({unbuilt})")
        return [unbuilt.result("build")], [cost.as_json()], {}
    try:
        progress(f"{config.describe()}; sides: {pair.workers.describe(environments)}")
        results, costs = run_loop.run_checks(pair, selected, steps)
        progress(workers_line(*pair.workers.call_and_transfer_seconds()))
        return results, costs, pair.sides()
    finally:
        pair.workers.close()


def start_side(
    config: MaxTextConfig, framework: str, env: Environment, workers: WorkerSet, seed: int = 0
) -> RemoteSide:
    """One release's side of `config`, in a worker of `env` added to `workers`."""
    options = {"framework": framework, "overrides": config.keys}
    first_batch = batch(config.keys, config.num_devices, seed, 0, "train")
    try:
        worker = workers.start(
            framework,
            env,
            FACTORY,
            options,
            first_batch,
            gate_config.worker_variables(),
            on_wait=gate_config.still_running,
        )
    except WorkerError as e:  # `decoder_factory.WrongRelease`: the release builds the other decoder
        if e.remote_type != "WrongRelease":
            raise
        kind = {"linen": "Linen", "nnx": "NNX"}[framework]
        raise BadInput(
            f"{e}: run the {kind} side on a release whose decoder is {kind} "
            f"({gate_config.RELEASES[framework]})"
        ) from None
    return RemoteSide(worker, framework, RELEASES if framework == "nnx" else None)


def layers(pair: MaxTextPair) -> Any:
    """`layers` on MaxText: both releases run the forward pass on the same weights (the Linen
    release's own initialisation) and inputs, every module call's output captured in the
    worker (`decoder_factory.MaxTextSide.captures`: Linen's method interception on 0.2.3's
    Linen modules, each NNX module's call wrapped on both), compared per module path, per
    pipeline iteration and stage, in the order the program ran them: the first record that
    differs is where the releases' values part. Each record names its tier
    (`compare.tier`); a capture one release alone makes (0.2.3's Linen `Dropout`s) is a note.
    (Each release against its own reference, module by module, is `pipeline`'s drill-down.)"""
    import dataclasses
    import tempfile
    from pathlib import Path

    import numpy as np

    from parity.engine.result import numeric_records, verdict
    from parity.remote import protocol

    plain = protocol.flatten(pair.linen.plain(pair.weights("linen", "linen")))
    with tempfile.TemporaryDirectory(prefix="parity-maxtext-layers-") as directory:
        weights_file = Path(directory) / "weights.npz"
        np.savez(weights_file, **{"/".join(path): value for path, value in plain.items()})
        captured = {}
        for framework in ("linen", "nnx"):
            worker = pair.side(framework).worker
            reply = worker.call(
                "call", method="captures", kwargs={"weights_file": str(weights_file)}
            )
            captured[framework] = (worker.receive_tree(reply["tree"])[0], reply["facts"]["order"])
    (linen, order), (nnx, _) = captured["linen"], captured["nnx"]
    stages = int(pair.keys.get("ici_pipeline_parallelism", 1)) * int(
        pair.keys.get("dcn_pipeline_parallelism", 1) or 1
    )
    first_pipelined = next((i for i, p in enumerate(order) if "/pipeline_module/" in p), None)
    calls: dict[str, int] = {}
    for path, call, _ in linen:
        calls[path] = max(calls.get(path, 0), int(call) + 1)
    # Every pipelined module runs once per stage per iteration, some more than once (RoPE):
    # the fewest calls of a pipelined module are the iterations times the stages.
    pipelined = [n for p, n in calls.items() if "/pipeline_module/" in p]
    iterations = max(min(pipelined, default=stages) // stages, 1)

    def place(key: tuple[str, ...]) -> tuple[tuple[int, ...], dict[str, Any], str]:
        """(data-flow rank, fields, label) of a capture `(module path, call, leaf)`."""
        path, call, leaf = key[0], int(key[1]), int(key[2])
        position = order.index(path) if path in order else len(order)
        label = path + (f" [{leaf}]" if leaf else "")
        if "/pipeline_module/" in path and stages > 1 and first_pipelined is not None:
            per_iteration = max(calls.get(path, 0) // iterations, stages)
            iteration, within = divmod(call, per_iteration)
            stage = within % stages
            fields = {"module": path, "iteration": iteration, "stage": stage}
            return (
                (first_pipelined, iteration, stage, position, leaf),
                fields,
                (f"{label} iteration {iteration} stage {stage}"),
            )
        return (
            (position, -1, -1, call, leaf),
            {"module": path},
            label + (f" call {call}" if call else ""),
        )

    records, notes = [], []
    for key in sorted(set(linen) | set(nnx), key=lambda k: place(k)[0]):
        _, fields, label = place(key)
        if key not in linen or key not in nnx:
            owner = "Linen (0.2.3)" if key in linen else "NNX (0.2.5)"
            notes.append(
                {
                    "tensor": label,
                    "passed": True,
                    "max_rel": 0.0,
                    **fields,
                    "note": f"captured on the {owner} side only: nothing to compare",
                }
            )
            continue
        diff = compare.leaf_diff(label, nnx[key], linen[key], ("NNX", "Linen"))
        record = numeric_records(label, [dataclasses.replace(diff, path="")], pair.tolerance)[0]
        records.append(record | fields | {"tier": compare.tier(diff.max_rel)})
    result = verdict("layers", records, pair.tolerance)
    parted = [r for r in records if r["max_rel"] > 0]
    tiers = sorted({r["tier"] for r in parted})
    held = f"; the differences' tier: {', '.join(tiers)}" if parted else ""
    return dataclasses.replace(
        result,
        message=result.message + held,
        details=(*records, *notes),
    )


def checkpoint(pair: MaxTextPair) -> Any:
    """`checkpoint` on MaxText: a checkpoint of 0.2.3's own `train.py` after the pair's
    `checkpoint_steps` steps, restored and trained one more step by both releases
    (`parity.maxtext.checkpoint_gate`), in a folder of its own."""
    import tempfile
    from pathlib import Path

    from parity.maxtext import checkpoint_gate

    with tempfile.TemporaryDirectory(prefix="parity-maxtext-checkpoint-") as directory:
        verdict, _ = checkpoint_gate.cross_release(
            pair.config, pair.environments, Path(directory), pair.checkpoint_steps
        )
    return verdict
