"""The worker's factory for MaxText's own training loop and checkpoints
(`parity.maxtext.train_factory:make`), run in a MaxText environment: train with the release's
`train.py` (`train.main`, its loop, its `checkpointing.maybe_save_checkpoint`), restore with its
own `train_utils.setup_train_loop` (the path a resumed `train.py` run takes), and read the
restored state back as plain arrays.

How `train.py` runs here (the MaxText environments hold exactly what the gate's imports need,
`bench/maxtext/install.sh`): 0.2.3's `train.py` imports tensorflow at the top for one call,
`tf.config.set_visible_devices([], "GPU")` (hiding GPUs from TF's data loaders), and its data
pipeline module imports the grain, Hugging Face and OLMo loaders at the top (`ml_collections`,
not installed). With `dataset_type=synthetic` none of them is used: while `train` is imported a
stand-in `tensorflow` module answers that one call (removed again at once, so that other code
still sees TF absent), and the three loader modules are stand-ins that raise if called.
MaxText's own model, optimizer, train step, synthetic data and checkpointing run unchanged.

Options: `framework` (`linen` for 0.2.3, `nnx` for 0.2.5), `overrides` (MaxText keys).
Only `remote_methods` are callable from the harness (the worker's `call` op).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

# What every run needs on this machine: CPU, no cloud, synthetic data, synchronous checkpoints.
DEFAULTS = {
    "hardware": "cpu",
    "skip_jax_distributed_system": True,
    "dataset_type": "synthetic",
    "enable_checkpointing": True,
    "async_checkpointing": False,
    "enable_dropout": False,
    "dropout_rate": 0.0,
    "jax_cache_dir": "",
}
LOGITS = ("__logits__",)  # where `restore` puts the model's logits among the state's paths
LOADERS = {  # MaxText data modules that synthetic data never calls, and what they export
    "grain_data_processing": ("make_grain_train_iterator", "make_grain_eval_iterator"),
    "hf_data_processing": ("make_hf_train_iterator", "make_hf_eval_iterator"),
    "olmo_grain_data_processing": (
        "make_olmo_grain_train_iterator",
        "make_olmo_grain_eval_iterator",
    ),
}


def _not_here(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this data loader is not installed in the gate's MaxText environment")


def _import_train() -> Any:
    """MaxText's `train` module, importable without tensorflow and the real-data loaders."""
    import maxtext.common.checkpointing  # noqa: F401  (sees tensorflow absent, as it is)

    for name, functions in LOADERS.items():
        full = f"maxtext.input_pipeline.{name}"
        if full not in sys.modules:
            module = types.ModuleType(full)
            for function in functions:
                setattr(module, function, _not_here)
            sys.modules[full] = module
    stand_in = None
    if "tensorflow" not in sys.modules:
        stand_in = types.ModuleType("tensorflow")
        stand_in.config = types.SimpleNamespace(set_visible_devices=lambda *a, **k: None)
        sys.modules["tensorflow"] = stand_in
    try:
        from maxtext.trainers.pre_train import train
    finally:
        if stand_in is not None and sys.modules.get("tensorflow") is stand_in:
            del sys.modules["tensorflow"]
    return train


def _argv(base_yml: str, keys: dict[str, Any]) -> list[str]:
    def text(value: Any) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return ["train.py", base_yml, *(f"{k}={text(v)}" for k, v in keys.items())]


def _plain(tree: Any) -> dict[tuple[str, ...], Any]:
    """`{path: host array}` of a restored state; typed PRNG keys as their key data."""
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
        if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[key] = np.asarray(jax.device_get(leaf))
    return out


class MaxTextTraining:
    """One MaxText release's training loop and restore path, on the gate's keys."""

    remote_methods = ("train", "restore", "train_compile")

    def __init__(self, framework: str, overrides: dict[str, Any]) -> None:
        import maxtext

        self.framework = framework
        self.keys = {**DEFAULTS, **overrides}
        self.base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
        self.trainer = _import_train()

    def _run_keys(self, directory: str, run_name: str, steps: int, **more: Any) -> list[str]:
        keys = {**self.keys, "base_output_directory": directory, "run_name": run_name}
        return _argv(self.base_yml, {**keys, "steps": steps, **more})

    def train(
        self, directory: str, run_name: str, steps: int, checkpoint_period: int
    ) -> tuple[dict, dict]:
        """`train.py` until `steps` (resuming from the run's latest checkpoint, if any), a
        checkpoint every `checkpoint_period` steps and at the end; each executed step's
        metrics as MaxText logs them (`metrics_file`)."""
        metrics = Path(directory) / f"{run_name}.{self.framework}.{steps}.metrics.jsonl"
        metrics.unlink(missing_ok=True)
        argv = self._run_keys(
            directory, run_name, steps, checkpoint_period=checkpoint_period, metrics_file=metrics
        )
        self.trainer.main(argv)
        lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return {}, {"metrics": lines}

    def restore(
        self, directory: str, run_name: str, steps: int, tokens: list | None = None
    ) -> tuple[dict, dict]:
        """The state this release's `train.py` would resume `run_name` from (its own
        `setup_train_loop`: checkpoint manager, restore, shardings), as plain arrays keyed by
        the release's own state paths, and the step its loop would execute first; with
        `tokens` (`[batch, length]`), also the restored model's own logits on them, under
        `LOGITS`."""
        import jax
        from flax import nnx

        config, recorder = self.trainer.initialize(self._run_keys(directory, run_name, steps))
        setup = self.trainer.train_utils.setup_train_loop(config, recorder)
        model, mesh, state = setup[3], setup[4], setup[10]
        first_step = self.trainer.get_first_step(model, state)
        if self.framework == "nnx":
            tree = nnx.to_pure_dict(nnx.state(state))
        else:
            tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
        flat = _plain(tree)
        dtypes = {"/".join(k): str(v.dtype) for k, v in flat.items()}
        if tokens is not None:
            flat[LOGITS] = self._logits(model, mesh, config, state, tokens)
        jax.clear_caches()
        return flat, {"first_step": int(first_step), "dtypes": dtypes}

    def train_compile(self, topology: str, num_slices: int) -> tuple[dict, dict]:
        """This release's `train_compile.py` for a TPU slice (`compile_topology`), as shipped:
        its own topology devices, mesh, shaped train state and train step, compiled by XLA:TPU
        from this host. The facts of the compiled step (memory, cost, optimised HLO, mesh
        shape, compile seconds), or the compiler's refusal (`overflow`: its words) when one
        device's HBM cannot hold it."""
        import jax
        from maxtext.trainers.pre_train import train_compile

        caught: dict[str, Any] = {}
        shipped = train_compile.jit_and_compile

        def kept(*args: Any, **kwargs: Any) -> Any:
            caught["mesh_shape"] = {str(k): int(v) for k, v in dict(args[3].shape).items()}
            start = time.perf_counter()
            caught["compiled"] = shipped(*args, **kwargs)
            caught["seconds"] = time.perf_counter() - start
            return caught["compiled"]

        keys = {k: v for k, v in self.keys.items() if k != "hardware"}  # a TPU's program
        keys |= {"compile_topology": topology, "compile_topology_num_slices": num_slices}
        train_compile.jit_and_compile = kept
        # XLA:TPU executables of compile-only devices cannot be read back (no TPU client): a
        # minimum compile time no compile reaches keeps them out of the persistent cache.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
        try:
            train_compile.main(_argv(self.base_yml, keys))
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            return {}, {"overflow": str(error), "mesh_shape": caught.get("mesh_shape", {})}
        finally:
            train_compile.jit_and_compile = shipped
        compiled = caught["compiled"]
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        facts = {
            "memory": {
                name: int(getattr(memory, name))
                for name in (
                    "argument_size_in_bytes",
                    "output_size_in_bytes",
                    "temp_size_in_bytes",
                    "alias_size_in_bytes",
                    "generated_code_size_in_bytes",
                )
            },
            "cost": {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))},
            "compiled_text": compiled.as_text(),
            "mesh_shape": caught["mesh_shape"],
            "compile_seconds": caught["seconds"],
            "compile_source": f"its train_compile, XLA:TPU compiled in {caught['seconds']:.1f}s",
        }
        jax.clear_caches()
        return {}, facts

    def _logits(self, model: Any, mesh: Any, config: Any, state: Any, tokens: list) -> Any:
        """The restored model's logits (no dropout), under MaxText's mesh and rules, the batch
        placed by its data sharding; positions 0.. and one segment per row."""
        import jax
        import numpy as np
        from flax import nnx
        from flax.linen import partitioning as nn_partitioning
        from jax.sharding import NamedSharding, PartitionSpec

        ids = np.asarray(tokens, np.int32)
        positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
        data = NamedSharding(mesh, PartitionSpec(*[tuple(a) for a in config.data_sharding]))
        ids, positions, segments = (jax.device_put(x, data) for x in (ids, positions, ids * 0 + 1))
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
            if self.framework == "nnx":
                graphdef, weights = nnx.split(state.model)

                def forward(weights: Any, *inputs: Any) -> Any:
                    out = nnx.merge(graphdef, weights)(
                        inputs[0], inputs[1], decoder_segment_ids=inputs[2], enable_dropout=False
                    )
                    return out[0] if isinstance(out, tuple) else out

                logits = jax.jit(forward)(weights, ids, positions, segments)
            else:
                key = jax.random.key(0)

                def forward(params: Any, *inputs: Any) -> Any:
                    return model.apply(
                        {"params": params},
                        inputs[0],
                        inputs[1],
                        decoder_segment_ids=inputs[2],
                        enable_dropout=False,
                        rngs={"dropout": key, "params": key},
                        mutable=["intermediates"],
                    )[0]

                logits = jax.jit(forward)(state.params["params"], ids, positions, segments)
        return np.asarray(jax.device_get(logits))


def make(options: dict[str, Any], batch: Any) -> tuple[MaxTextTraining, Any]:
    """The training side for `options` (see the module docstring); batches are not used."""
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    return MaxTextTraining(options["framework"], dict(options.get("overrides", {}))), None
