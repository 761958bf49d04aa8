"""The worker's factory for MaxText's own decoder (`parity.maxtext.decoder_factory:make`), run
in a MaxText environment (`bench/maxtext/install.sh`): 0.2.3's Linen `TransformerLinenPure`, or
0.2.5's NNX `Transformer`, each built from MaxText's own `configs/base.yml` plus the
overrides, on MaxText's own mesh and logical rules.

What this side computes, on both releases alike (only the model code and the optimizer's
construction are MaxText's; the rest is this module's, the same on both sides):
- the common form: `{'params': tree}` keyed by MaxText's parameter paths (identical in 0.2.3 and
  0.2.5), each leaf boxed with the logical names its release declares;
- `run`: logits, and the loss as MaxText's trainer normalises it (cross-entropy summed over the
  target tokens whose `targets_segmentation` is non-zero, divided by their count), gradients
  w.r.t. every parameter, their global norm on device;
- `trainer`: the optimizer of `maxtext.optimizers.optimizers.get_optimizer` (its learning-rate
  schedule from `maxtext_utils.create_learning_rate_schedule`) in a jitted step of this module.

Options: `framework` (`linen`, `nnx`: a pure decoder of that kind, else `make` raises
`WrongRelease`), `overrides` (MaxText keys), `patch` (`module:function` called first: a test's
injected bug).
Imports MaxText only inside `make` (the harness imports this module's name, never MaxText).

The capture its `layers` drill-down runs: `parity.maxtext.call_recorder`.

Longer than 500 lines: `MaxTextSide` is one release's decoder serving every request the gate
sends its worker (run, layers, programs, trainer, weights in and out), each on the decoder,
mesh and rules this module builds from MaxText's config; split, each part would reach back
into the others' state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
from importlib import metadata
from typing import Any

from parity.maxtext.call_recorder import CallRecorder
from parity.remote import protocol
from parity.remote.worker import first_line

# What the worker reads beside `make` (`parity.remote.worker`): the calls that read MaxText's
# config and build its mesh (an exception inside them is the config's fault: bad input, not a
# bug), and the package whose version names the release.
CONFIG_READERS = (
    ("maxtext.configs.pyconfig", "initialize"),
    ("maxtext.utils.maxtext_utils", "get_mesh_from_config"),
)
PACKAGES = ("maxtext",)
# What a fork server of the release's environment imports before it forks workers
# (`parity.remote.forkserver`): MaxText's modules `make` reaches, about 8 CPU-s of imports
# (transformers and its model configs) a worker would otherwise pay each. None starts JAX.
PRELOAD = (
    "maxtext.configs.pyconfig",
    "maxtext.utils.maxtext_utils",
    "maxtext.utils.model_creation_utils",
    "maxtext.optimizers.optimizers",
)
DEFAULTS = {  # what every gate run needs whatever the shape: CPU, no cloud, no checkpoints
    "run_name": "parity",
    "hardware": "cpu",
    "skip_jax_distributed_system": True,
    "enable_checkpointing": False,
    "jax_cache_dir": "",
    "dataset_type": "synthetic",
    "enable_dropout": False,
    "dropout_rate": 0.0,
}


_UNKNOWN_KEY = re.compile(r"""^["']?'([^']+)' not in '""")
_PYDANTIC = re.compile(r"^(\d+) validation errors? for \w+$")


def config_error_line(message: str) -> str:
    """MaxText's refusal of a config as one short line: of a pydantic validation error its
    first field line (`field: message`, without pydantic's `[type=...]` tail), of an unknown key
    (MaxText lists every valid key after it) just the key, else the first line; shortened as
    the worker shortens any config error (`worker.first_line`)."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return first_line(message)
    if match := _UNKNOWN_KEY.match(lines[0]):
        return f"unknown key {match[1]!r}"
    header = _PYDANTIC.match(lines[0].strip())
    if header and len(lines) > 1:
        field, text = "", lines[1]
        if not lines[1].startswith(" ") and len(lines) > 2:  # `field` then its indented message
            field, text = lines[1].strip() + ": ", lines[2]
        text = re.sub(r"\s*\[type=.*$", "", text.strip())
        more = int(header[1]) - 1
        return first_line(field + text + (f" (and {more} more validation errors)" if more else ""))
    return first_line(message)


def _names(variable: Any) -> tuple | None:
    """An NNX Variable's logical axis names (`out_sharding`, or an older key)."""
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for key in ("out_sharding", "sharding", "sharding_names"):
        names = metadata.get(key)
        if names is not None:
            return tuple(names)
    return None


class MaxTextSide:
    """One MaxText release's decoder, as the engine's `Side` protocol asks (served by the
    worker; the harness sees a `RemoteSide`)."""

    def __init__(self, framework: str, config: Any, mesh: Any, batch: Any) -> None:
        import jax
        from flax.linen import partitioning as nn_partitioning
        from maxtext.optimizers import optimizers
        from maxtext.utils import maxtext_utils

        self.framework, self.config, self.mesh, self.batch = framework, config, mesh, batch
        self.rules = config.logical_axis_rules
        self._context = lambda: _both(jax.set_mesh(mesh), nn_partitioning.axis_rules(self.rules))
        schedule = maxtext_utils.create_learning_rate_schedule(config)
        self.tx = optimizers.get_optimizer(config, schedule)
        self._own: Any = None
        self._forward_backward: Any = None
        self._references: dict[str, Any] = {}
        self._programs: dict[int, tuple[Any, Any, Any]] = {}

    # ------------------------------------------------------------ building

    def _build(self) -> Any:
        """(native boxed variables or NNX Param state, the apply function over plain params)."""
        import jax
        from flax import nnx
        from maxtext.utils import model_creation_utils

        shape = self.batch["inputs"].shape
        with self._context():
            if self.framework == "linen":
                model = model_creation_utils.from_config(self.config, mesh=self.mesh)
                keys, ones = _init_inputs(shape)
                boxed = jax.jit(lambda: model.init(keys, ones, ones))()

                def call(plain: Any, batch: Any) -> tuple[Any, Any]:
                    logits, mutated = model.apply(
                        plain,
                        batch["inputs"],
                        batch["inputs_position"],
                        decoder_segment_ids=batch["inputs_segmentation"],
                        enable_dropout=False,
                        rngs={"dropout": keys["dropout"], "params": keys["aqt"]},
                        mutable=["intermediates"],
                    )
                    return logits, mutated.get("intermediates", {})

                self._call = call
                return {"params": boxed["params"]}
            rngs = nnx.Rngs(params=0, dropout=1, aqt=2)
            model = model_creation_utils.from_config(self.config, mesh=self.mesh, rngs=rngs)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            self._graph = (graphdef, params, rest)

            def call(plain: Any, batch: Any) -> tuple[Any, Any]:
                state = jax.tree.map(lambda x: x, params)
                nnx.replace_by_pure_dict(state, plain["params"])
                merged = nnx.merge(graphdef, state, rest, copy=True)
                out = merged(
                    batch["inputs"],
                    batch["inputs_position"],
                    decoder_segment_ids=batch["inputs_segmentation"],
                    enable_dropout=False,
                )
                sown = nnx.to_pure_dict(nnx.state(merged, nnx.Intermediate))
                return (out[0] if isinstance(out, tuple) else out), sown

            self._call = call
            return params

    # ------------------------------------------------------------ weights

    def own_weights(self) -> Any:
        """This release's initialisation, each parameter placed as MaxText's trainer places
        it: its logical names resolved by the release's own rules on its mesh."""
        if self._own is None:
            self._own = self._placed(self._build())
        return self._own

    def _placed(self, native: Any) -> Any:
        import flax.linen as nn
        import jax
        from flax import nnx
        from jax.sharding import PartitionSpec

        def place(value: Any, names: tuple | None) -> Any:
            if names is None:
                return value
            spec = nn.logical_to_mesh_sharding(PartitionSpec(*names), self.mesh, self.rules)
            return jax.device_put(value, spec)

        if self.framework == "linen":
            is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
            return jax.tree.map(
                lambda b: b.replace_boxed(place(b.value, tuple(b.names))) if is_box(b) else b,
                native,
                is_leaf=is_box,
            )
        for variable in jax.tree.leaves(native, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            if isinstance(variable, nnx.Variable):
                value = variable.get_value() if hasattr(variable, "get_value") else variable.value
                variable.set_value(place(value, _names(variable)))
        return native

    def to_common(self, weights: Any) -> dict[str, Any]:
        import flax.linen as nn
        import jax
        from flax import nnx

        if self.framework == "linen":
            return weights
        is_variable = lambda x: isinstance(x, nnx.Variable)
        flat = {}
        for path, variable in jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_variable)[0]:
            key = tuple(str(getattr(p, "key", p)) for p in path)
            value = variable.get_value() if hasattr(variable, "get_value") else variable.value
            names = _names(variable)
            flat[key] = value if names is None else nn.LogicallyPartitioned(value, names)
        return {"params": protocol.nest(flat)}

    def from_common(self, variables: dict[str, Any]) -> Any:
        """The common form as this release's weights: every path, shape and dtype of its own
        tree (else `ConversionError`), each array placed as its own initialisation's; the
        logical names stay this release's (the `sharding` check compares them). A leaf of
        zero elements holds no value: one this release lacks is left out (0.2.3 builds
        deepseek's `dense_layers` with no layer, 0.2.5 builds none), one it has and `variables`
        lack is its own; present in both, it is held to its shape and dtype like any other."""
        import flax.linen as nn
        import jax
        import numpy as np
        from flax import nnx

        own = self.to_common(self.own_weights())
        own_flat = _flat(nn.meta.unbox(own))
        given = _flat(nn.meta.unbox(variables))
        given = {p: x for p, x in given.items() if p in own_flat or np.size(x)}
        given |= {p: x for p, x in own_flat.items() if p not in given and not np.size(x)}
        problems = [f"missing: {'/'.join(p)}" for p in own_flat if p not in given]
        problems += [
            f"not in this release's tree: {'/'.join(p)}" for p in given if p not in own_flat
        ]
        for path in set(own_flat) & set(given):
            mine, theirs = own_flat[path], given[path]
            if tuple(mine.shape) != tuple(theirs.shape) or str(mine.dtype) != str(theirs.dtype):
                problems.append(
                    f"{'/'.join(path)}: {tuple(theirs.shape)} {theirs.dtype} where this release "
                    f"has {tuple(mine.shape)} {mine.dtype}"
                )
        if problems:
            from migrate.checkpoints.convert import ConversionError

            raise ConversionError(f"into maxtext ({self.framework})", sorted(problems))
        placed = {p: jax.device_put(given[p], own_flat[p].sharding) for p in own_flat}
        if self.framework == "linen":
            boxes = _flat(own, keep_boxes=True)
            return protocol.nest({p: boxes[p].replace_boxed(placed[p]) for p in boxes})
        state = jax.tree.map(lambda x: x, self.own_weights())
        nnx.replace_by_pure_dict(state, protocol.nest(placed)["params"])
        return state

    def plain(self, tree: Any) -> Any:
        import jax

        return jax.device_get(self._plain_params(tree))

    def _plain_params(self, weights: Any) -> Any:
        import flax.linen as nn
        from flax import nnx

        if isinstance(weights, nnx.State):
            return {"params": nnx.to_pure_dict(weights)}
        return nn.meta.unbox(weights)

    # ------------------------------------------------------------ running

    def _loss(self, plain: Any, batch: Any) -> tuple[Any, Any]:
        import jax
        import jax.numpy as jnp

        logits = self._call(plain, batch)[0]
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        xent = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
        mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
        return jnp.sum(xent * mask) / jnp.sum(mask), logits

    def _grad_fn(self) -> Any:
        """The jitted forward and backward (one per side: every run reuses its program)."""
        import jax
        import optax

        if self._forward_backward is None:

            def forward_backward(plain: Any, batch: Any) -> Any:
                (loss, logits), grads = jax.value_and_grad(self._loss, has_aux=True)(plain, batch)
                return loss, logits, grads, optax.global_norm(grads)

            self._forward_backward = jax.jit(forward_backward)
        return self._forward_backward

    def run(self, weights: Any) -> Any:
        import jax

        from parity.engine.side import Run

        with self._context():
            loss, logits, grads, norm = self._grad_fn()(self._plain_params(weights), self.batch)
        loss, logits, grads, norm = jax.device_get((loss, logits, grads, norm))
        return Run(loss=loss, outputs=logits, grads=grads, grad_norm=norm)

    def lowered(self, weights: Any) -> Any:
        with self._context():
            return self._grad_fn().lower(self._plain_params(weights), self.batch)

    def compiled(self, weights: Any) -> Any:
        key = id(weights)
        if key not in self._programs:
            self._programs[key] = (weights, None, self.lowered(weights).compile())
        return self._programs[key][2]

    def program_shardings(self, compiled: Any) -> dict[str, tuple[Any, int, Any]]:
        """Each input and output array of the compiled program by its path, with its rank. An
        input the program never reads has no sharding (jit drops unused arguments: both
        releases' llama4 never read `inputs_position`) and no label: one side's program
        reading an input the other's drops is then a one-sided record."""
        import jax

        out = {}
        parts = {"input": ("params", "batch"), "output": ("loss", "logits", "grads", "grad_norm")}
        for io, actual, avals in (
            ("input", compiled.input_shardings[0], compiled.args_info[0]),
            ("output", compiled.output_shardings, compiled.out_info),
        ):
            ranks = {
                path: len(aval.shape)
                for path, aval in jax.tree_util.tree_flatten_with_path(avals)[0]
            }
            for path, sharding in jax.tree_util.tree_flatten_with_path(actual)[0]:
                head = parts[io][path[0].idx]
                rest = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path[1:])
                label = f"forward+backward {io}: {head}" + (f"/{rest}" if rest else "")
                out[label] = (sharding, ranks[path], None)
        return out

    def trainer(self, weights: Any) -> Any:
        import jax
        import optax

        from parity.engine.side import Trainer

        params = jax.tree.map(lambda x: x.copy(), self._plain_params(weights))

        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            (loss, _), grads = jax.value_and_grad(self._loss, has_aux=True)(params, batch)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
            return optax.apply_updates(params, updates), opt_state, metrics

        def evaluate(params: Any, batch: Any) -> Any:
            return self._loss(params, batch)[0]

        with self._context():
            opt_state = self.tx.init(params)
        return Trainer(
            params,
            opt_state,
            _in_context(jax.jit(step), self._context),
            _in_context(jax.jit(evaluate), self._context),
        )

    def drill_stages(self, weights: Any) -> list:
        return []

    remote_methods = ("captures", "pipeline_reference", "pipeline_captures")

    def layout(self) -> Any:
        """How this release places the pipelined decoder's layers (`pipeline_layout.Layout`),
        from its own config's derived counts."""
        from parity.maxtext import pipeline_layout

        config = self.config
        deepseek = str(config.decoder_block).lower().endswith("deepseek")
        layers = config.num_decoder_layers - (config.first_num_dense_layers if deepseek else 0)
        return pipeline_layout.Layout(
            stages=config.ici_pipeline_parallelism * max(config.dcn_pipeline_parallelism, 1),
            repeats=config.num_pipeline_repeats,
            per_stage=config.num_layers_per_pipeline_stage,
            pipelined=config.pipeline_parallel_layers,
            layers=layers,
            scan_axis=config.param_scan_axis,
            moe_first=deepseek,
        )

    def pipeline_reference(
        self, weights_file: str, overrides: dict[str, Any]
    ) -> tuple[dict[tuple[str, ...], Any], dict[str, Any]]:
        """This release's pipelined decoder against its own decoder without pipelining
        (`overrides`: `pipeline_layout.reference_overrides` of this side's keys, built in this
        worker beside the pipelined one), on the weights in `weights_file` (an `.npz` of the
        common form's plain arrays by `/`-joined path: the pipelined layout) re-laid as the
        reference's layer stack (`pipeline_layout.to_reference`), on the same batch: each
        run's loss, logits, global gradient norm and gradients, the reference's gradients laid
        back on the pipelined paths. Arrays keyed `(run, part, *path)`, run `pipelined` or
        `reference`; facts: the layout, the reference's mesh."""
        import jax
        import numpy as np

        from parity.maxtext import pipeline_layout

        flat = _stored(weights_file)
        layout = self.layout()
        reference_flat = pipeline_layout.to_reference(flat, layout)
        reference = self._reference(overrides)
        arrays: dict[tuple[str, ...], Any] = {}
        for name, side, weights in (
            ("pipelined", self, flat),
            ("reference", reference, reference_flat),
        ):
            plain = side._plain_params(side.from_common(protocol.nest(weights)))
            with side._context():
                loss, logits, grads, norm = side._grad_fn()(plain, side.batch)
            loss, logits, grads, norm = jax.device_get((loss, logits, grads, norm))
            grads = _flat(grads)
            if name == "reference":
                grads = pipeline_layout.from_reference(grads, layout, flat)
            arrays |= {(name, "loss"): np.asarray(loss), (name, "logits"): np.asarray(logits)}
            arrays |= {(name, "grad_norm"): np.asarray(norm)}
            arrays |= {(name, "grads", *path): np.asarray(g) for path, g in grads.items()}
        facts = {
            "layout": dataclasses.asdict(layout),
            "reference_mesh": dict(reference.mesh.shape),
        }
        return arrays, facts

    def _reference(self, overrides: dict[str, Any]) -> MaxTextSide:
        """This release's decoder of `overrides` (the reference: built once, on its own mesh,
        with this side's batch)."""
        import jax
        from maxtext.configs import pyconfig
        from maxtext.utils import maxtext_utils

        key = repr(sorted(overrides.items()))
        if self._references.get("key") != key:
            config = pyconfig.initialize([None, _base_yml()], **{**DEFAULTS, **overrides})
            mesh = maxtext_utils.get_mesh_from_config(config)
            side, _ = _on_mesh(self.framework, config, mesh, jax.device_get(self.batch))
            self._references = {"key": key, "side": side}
        return self._references["side"]

    def pipeline_captures(
        self, weights_file: str, overrides: dict[str, Any]
    ) -> tuple[dict[tuple[str, ...], Any], dict[str, Any]]:
        """`captures` of the pipelined decoder and of its reference (`pipeline_reference`'s),
        on the weights in `weights_file` (the pipelined layout; the reference's re-laid):
        arrays keyed `(run, module path, call, leaf)`; facts: each run's module order, the
        layout, the forwarding delay, the microbatches."""
        from parity.maxtext import pipeline_layout

        flat = _stored(weights_file)
        layout = self.layout()
        reference = self._reference(overrides)
        arrays: dict[tuple[str, ...], Any] = {}
        facts: dict[str, Any] = {"layout": dataclasses.asdict(layout)}
        for name, side, weights in (
            ("pipelined", self, flat),
            ("reference", reference, pipeline_layout.to_reference(flat, layout)),
        ):
            captured, order = side._captured(weights)
            arrays |= {(name, *key): value for key, value in captured.items()}
            facts[f"{name}_order"] = order
        facts["delay"] = 2 if self.config.pipeline_delay_activation_forwarding else 1
        facts["microbatches"] = self.config.num_pipeline_microbatches
        return arrays, facts

    def captures(self, weights_file: str) -> tuple[dict[tuple[str, ...], Any], dict[str, Any]]:
        """The forward pass on the weights in `weights_file` (an `.npz` of the common form's
        plain arrays, keyed by `/`-joined path), every module call's output captured
        (`CallRecorder`), in the order the program ran them: (arrays keyed `(module path, call
        index, leaf)`, `{"order": [module path, ...]}` in first-call order). The logits come
        as `("logits", "0", "0")`."""

        arrays, order = self._captured(_stored(weights_file))
        return arrays, {"order": order}

    def _captured(
        self, flat: dict[tuple[str, ...], Any]
    ) -> tuple[dict[tuple[str, ...], Any], list[str]]:
        import jax
        import numpy as np

        plain = self._plain_params(self.from_common(protocol.nest(flat)))
        recorder = CallRecorder(self.framework)
        with recorder, self._context():
            logits = jax.jit(lambda p, b: self._call(p, b)[0])(plain, self.batch)
            logits = np.asarray(jax.device_get(logits))
            jax.effects_barrier()
        arrays = {
            (path, str(k), str(i)): leaf
            for path, calls in recorder.calls.items()
            for k, leaves in enumerate(calls)
            for i, leaf in enumerate(leaves)
        }
        arrays[("logits", "0", "0")] = logits
        return arrays, [*recorder.calls, "logits"]

    def jaxpr(self, weights: Any) -> Any:
        return None


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Any:
    """Two context managers as one."""
    with first, second:
        yield


def _in_context(fn: Any, context: Any) -> Any:
    """A jitted function called under MaxText's mesh and rules."""

    def call(*args: Any) -> Any:
        with context():
            return fn(*args)

    return call


def _stored(weights_file: str) -> dict[tuple[str, ...], Any]:
    """The plain arrays of an `.npz` keyed by `/`-joined path, by path."""
    import numpy as np

    with np.load(weights_file) as stored:
        return {tuple(key.split("/")): stored[key] for key in stored.files}


def _flat(tree: Any, keep_boxes: bool = False) -> dict[tuple[str, ...], Any]:
    import flax.linen as nn
    import jax

    is_box = (lambda x: isinstance(x, nn.LogicallyPartitioned)) if keep_boxes else None
    return {
        tuple(str(getattr(p, "key", p)) for p in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
    }


def make(options: dict[str, Any], batch: Any) -> tuple[MaxTextSide, Any]:
    """The side for `options` (see the module docstring) and how to place a host batch."""
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    if options.get("patch"):
        module_name, _, function = options["patch"].partition(":")
        getattr(importlib.import_module(module_name), function)()
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils

    overrides = {**DEFAULTS, **options.get("overrides", {})}
    config = pyconfig.initialize([None, _base_yml()], **overrides)
    mesh = maxtext_utils.get_mesh_from_config(config)
    side, place_batch = _on_mesh(options["framework"], config, mesh, batch)
    with side._context():  # a release that builds the other kind of decoder: bad input
        _check_release(options["framework"], config, mesh, batch["inputs"].shape)
    return side, place_batch


def _base_yml() -> str:
    import maxtext

    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def _on_mesh(framework: str, config: Any, mesh: Any, batch: Any) -> tuple[MaxTextSide, Any]:
    """The side of a MaxText config on its mesh, and how to place a host batch there."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    data = NamedSharding(mesh, PartitionSpec(*[tuple(a) for a in config.data_sharding]))
    place_batch = lambda host: {k: jax.device_put(v, data) for k, v in host.items()}
    return MaxTextSide(framework, config, mesh, place_batch(batch)), place_batch


class WrongRelease(ValueError):
    """This release does not build its side's kind of decoder (the harness: bad input)."""


def _init_inputs(shape: tuple) -> tuple[dict, Any]:
    import jax

    keys, ones = jax.random.split(jax.random.key(0), 3), jax.numpy.ones(shape, "int32")
    return dict(zip(("params", "dropout", "aqt"), keys, strict=True)), ones


def _check_release(framework: str, config: Any, mesh: Any, shape: tuple) -> None:
    """`WrongRelease` where this release builds no pure `framework` decoder. 0.2.5's Linen
    `TransformerLinen` is a `ToLinen` over its NNX `Transformer` (init: plain params); flax's
    bridge leaves `NNXMeta` boxes; 0.2.3's NNX `Transformer` holds a `ToNNX` decoder."""
    import flax.linen as nn
    import jax
    from flax import nnx
    from maxtext.utils import model_creation_utils as creation

    kinds = ("Linen side", "NNX") if framework == "linen" else ("NNX side", "Linen")
    with contextlib.suppress(metadata.PackageNotFoundError):  # else: no metadata installed
        kinds = (f"{kinds[0]} (maxtext {metadata.version('maxtext')})", kinds[1])
    side = f"the {kinds[0]} builds"
    bridge = lambda node, name: any(c.__name__ == name for c in type(node).__mro__)
    if framework == "linen":
        model = creation.from_config(config, mesh=mesh)
        if not isinstance(model, nn.Module):
            raise WrongRelease(f"{side} {type(model).__name__}, not a Linen module")
        inside = [f"{type(model).__name__} is a ToLinen"] if bridge(model, "ToLinen") else []
        if not inside:  # flax's own bridge: NNX state in `NNXMeta` boxes, or an `nnx` collection
            keys, ones = _init_inputs(shape)
            shapes = jax.eval_shape(lambda: model.init(keys, ones, ones))
            is_meta = lambda x: isinstance(x, nn.meta.AxisMetadata)
            for path, leaf in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_meta)[0]:
                where = "/".join(str(getattr(p, "key", p)) for p in path)
                if type(leaf).__module__.startswith("flax.nnx") or where.startswith("nnx/"):
                    inside.append(f"{where}: {type(leaf).__name__}")
    else:
        rngs = lambda: nnx.Rngs(params=0, dropout=1, aqt=2)  # made inside the abstract trace
        build = lambda: creation.from_config(config, mesh=mesh, rngs=rngs())
        try:
            model = nnx.eval_shape(build)
        except Exception:  # a build this trace alone cannot place: shapes only
            # Under MaxText's mesh `nnx.eval_shape` gives each abstract Variable a sharding
            # resolved as NNX resolves names (an unmatched one as a mesh axis), and 0.2.5
            # names the axis of the layers after a pipelined subset `layers_outside_pipeline`,
            # which no rule maps (its real build places them by its rules, as MaxText's trainer
            # does). Shapes alone, on a one-device mesh, say which decoder it builds. (0.2.3's
            # `ToNNX` decoder needs MaxText's mesh: its Linen constraints name its axes.)
            one_device = jax.make_mesh((1,), ("none",), devices=jax.devices()[:1])
            with jax.set_mesh(one_device):
                model = nnx.eval_shape(build)
        if not isinstance(model, nnx.Module):
            raise WrongRelease(f"{side} {type(model).__name__}, not an NNX module")
        # The decoder itself: 0.2.5's NNX decoder wraps Linen leaves of its own (AQT, TE).
        inside = ["ToNNX at decoder"] if bridge(getattr(model, "decoder", None), "ToNNX") else []
    if inside:
        raise WrongRelease(f"{side} a decoder with {kinds[1]} modules inside ({inside[0]})")
