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

from typing import Any

from migrate.checkpoints.weight_map import Entry, WeightMap
from migrate.errors import BadInput
from parity.analysis import compare
from parity.engine.pair import Pair, lm_vacuity_problems
from parity.engine.side import Run
from parity.maxtext import gate_config
from parity.maxtext.gate_config import MaxTextConfig, batch
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
# places them, `MaxTextSide.own_weights`) the difference is gone, so no looser tier exists.
TOLERANCE = compare.EXACT


class MaxTextPair(Pair):
    """MaxText's two decoders, each in the worker of its environment."""

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
    ) -> None:
        """`started`: sides already running for this config and seed (another pair's, e.g. one
        Linen release against several NNX builds): used as they are, not restarted, and left
        running when the other side fails to start. `checkpoint_steps`: the steps 0.2.3's
        `train.py` trains before it checkpoints (`checkpoint`)."""
        self.config, self.keys = config, config.keys
        self.environments, self.seed = environments, seed
        self.devices = config.num_devices
        self.checkpoint_steps = checkpoint_steps
        self.workers = WorkerSet()
        started = started or {}
        for framework, side in started.items():
            self.workers[framework] = side.worker
        with self.workers.closed_on_failure():  # one side failed: the other one stops too
            sides = [started.get(f) or self._side(f) for f in ("linen", "nnx")]
        super().__init__(*sides, TOLERANCE)

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

    @property
    def own_checks(self) -> dict[str, Any]:
        """The checks this pair computes its own way (`gate_config.OWN_CHECKS`)."""
        from parity.maxtext import compile_check

        return {"compile": compile_check.compile_check, "layers": layers, "checkpoint": checkpoint}

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
    from parity.decoder import runner

    pair = MaxTextPair(config, environments, checkpoint_steps=checkpoint_steps)
    try:
        progress(f"{config.describe()}; sides: {pair.workers.describe(environments)}")
        results, costs = runner.run_checks(pair, selected, steps, drill_down=False)
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
            {"DECOUPLE_GCLOUD": "TRUE"},
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


# What MaxText exposes for a drill-down, measured on pp4 with `record_internal_nn_metrics=true`
# (each decoder layer sows its output's mean, stdev and fraction of zeros): 0.2.5's NNX pipeline
# returns them per iteration and stage (7 x 4 each), 0.2.3's Linen pipeline returns none (its
# `intermediates` collection comes back empty). And the decoder layer is the same NNX module in
# both releases (0.2.3 wraps `LlamaDecoderLayer` with `to_linen_class`), so a layer-by-layer
# run would compare one code with itself: what migrated is the pipeline and the decoder around
# it, which `forward` (logits, loss) and `grads` (every parameter) gate whole.
LAYERS_NOT_EXPOSED = (
    "MaxText 0.2.3's Linen pipeline returns no intermediates (record_internal_nn_metrics: empty; "
    "0.2.5 returns per-iteration, per-stage activation statistics), and both releases run the "
    "same NNX decoder layer: no per-layer or per-iteration drill-down is possible; forward and "
    "grads gate the pipeline whole"
)


def layers(pair: MaxTextPair) -> Any:
    """`layers` on MaxText: skipped, saying why (`LAYERS_NOT_EXPOSED`)."""
    from parity.engine.result import skipped

    return skipped("layers", "max_rel", pair.tolerance.max_rel, LAYERS_NOT_EXPOSED)


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
