"""MaxText 0.2.5's NNX decoder against the project's NNX twin of the same llama2 shape:
`parity --maxtext CONFIG --against=twin`.

The pair's two sides run in workers: the twin (this module's `make`, in the harness's own
environment) in the reference slot (`linen`), MaxText 0.2.5 (`release_pair.start_side`, its
release's environment) in the slot under test (`nnx`). Both speak MaxText's common form
(`{'params': ...}` on MaxText's paths with MaxText 0.2.3's logical names): the twin's side holds
its weights in that form and maps them, inside its jitted program, onto the twin's pipeline
layout (`migrate.checkpoints.maxtext_layouts.pipeline_map`: the paths, `embed_vocab` named
`embed`, the query kernel times `sqrt(head_dim)`, exact for a power of two), so gradients and
the optimizer act on MaxText's parameters on both sides and every check compares leaf by leaf.

What each side computes is its own model's logits; the rest is the same code on both sides:
the loss as MaxText's trainer normalises it, the gradients, their global norm, and AdamW with
a constant learning rate (`TRAIN_KEYS`, set on MaxText's side so that its schedule is
constant; no clipping on either side, as the release gate's trainer).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from migrate.errors import BadInput
from parity.analysis import compare
from parity.engine.registry import Check, Front
from parity.maxtext.gate_batch import batch
from parity.maxtext.gate_config import MaxTextConfig
from parity.maxtext.release_pair import MaxTextPair, start_side

FACTORY = "parity.maxtext.twin_gate:make"
# Keys of a MaxText config the twins' config has no field for, with the only values the twin
# computes the same way (others: refused before any worker starts).
MAXTEXT_ONLY = {
    "decoder_block": ("llama2",),
    "attention": ("dot_product",),
    "model_name": ("default",),
    "scan_layers": (True,),
}
# The optimizer both sides train with: MaxText's AdamW with a constant learning rate (its WSD
# schedule without warmup or decay: `optax.constant_schedule` inside `join_schedules`), and the
# twins' hyperparameters where the config sets none.
TRAIN_KEYS = {
    "opt_type": "adamw",
    "lr_schedule_type": "wsd",
    "warmup_steps_fraction": 0.0,
    "wsd_decay_steps_fraction": 0.0,
    "adam_eps_root": 0.0,
}
HYPERPARAMETERS = ("learning_rate", "adam_b1", "adam_b2", "adam_eps", "adam_weight_decay")
# Measured (docs/maxtext.md, "MaxText 0.2.5 against the NNX twin"): the two decoders are
# different programs (MaxText's attention op and its query scale folded into the kernel, the
# twins' einsum attention scaling the query in the forward pass), so they are held to
# float32's reshaped tier, never looser.
TOLERANCE = compare.F32_RESHAPED


def twins_overrides(keys: dict[str, Any]) -> list[str]:
    """The twins' `key=value` overrides for a MaxText config's keys (BadInput naming a key the
    twin cannot compute as MaxText does)."""
    from migrate.config.contract import Config

    fields = {f.name for f in dataclasses.fields(Config)}
    out = []
    for key, value in keys.items():
        if key in MAXTEXT_ONLY:
            if value not in MAXTEXT_ONLY[key]:
                allowed = " or ".join(map(str, MAXTEXT_ONLY[key]))
                raise BadInput(f"--against=twin: {key}={value}: the twin computes {allowed} only")
            continue
        if key in TRAIN_KEYS:
            continue
        if key not in fields:
            raise BadInput(f"--against=twin: {key}: a MaxText key the twins' config does not have")
        out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def twins_config(keys: dict[str, Any]) -> Any:
    """The twins' config of a MaxText config's keys (over the shipped `configs/base.yml`)."""
    from migrate.config.loading import SHIPPED, load_config

    cfg = load_config(SHIPPED / "base.yml", [*twins_overrides(keys), "model_name=twin"])
    if not cfg.using_pipeline or cfg.scan_layers_per_stage:
        raise BadInput(
            "--against=twin: a pipelined config whose layers per stage are not scanned "
            "(the twins map MaxText's pipeline stacking only)"
        )
    if cfg.num_layers_after_pipeline:
        raise BadInput(
            f"--against=twin: pipeline_parallel_layers={cfg.pipeline_parallel_layers} of "
            f"{cfg.base_num_decoder_layers} layers: the twins' map carries no MaxText "
            "layers_outside_pipeline (the pipeline check holds each release to its own reference)"
        )
    return cfg


def pair_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """The config's keys with the optimizer both sides train with (`TRAIN_KEYS`; the twins'
    hyperparameters where the config sets none)."""
    cfg = twins_config(keys)
    return {**keys, **TRAIN_KEYS, **{k: keys.get(k, getattr(cfg, k)) for k in HYPERPARAMETERS}}


# ------------------------------------------------------------ the twin's side, in its worker


class TwinSide:
    """The project's NNX twin as a Side of MaxText's common form (served by a worker)."""

    framework = "linen"  # the reference slot

    def __init__(self, keys: dict[str, Any], batch: Any) -> None:
        import jax
        import optax
        from jax.sharding import NamedSharding

        from migrate.checkpoints import maxtext_layouts
        from migrate.common import axes, sharding
        from parity.decoder import twins

        self.cfg = cfg = twins_config(keys)
        self.mesh = sharding.make_mesh(cfg)
        self.map = maxtext_layouts.pipeline_map(cfg.head_dim, cfg.layers_per_stage)
        self.batch_sharding: NamedSharding = sharding.named_sharding(
            axes.BATCH_LENGTH_EMBED[:2], self.mesh, cfg.logical_axis_rules
        )
        self.batch = self.place_batch(batch)
        self.graphdef, self.abstract = twins.nnx_abstract(cfg, self.mesh)
        self.tx = optax.adamw(
            optax.constant_schedule(float(keys["learning_rate"])),
            b1=float(keys["adam_b1"]),
            b2=float(keys["adam_b2"]),
            eps=float(keys["adam_eps"]),
            eps_root=0.0,
            weight_decay=float(keys["adam_weight_decay"]),
        )
        self._own: Any = None
        self._programs: dict[int, Any] = {}
        self._jit = jax.jit

    def place_batch(self, host: dict) -> dict:
        import jax

        return {k: jax.device_put(v, self.batch_sharding) for k, v in host.items()}

    # ------------------------------------------------------------ weights

    def own_weights(self) -> Any:
        """The twin's own initialisation, as MaxText's parameters (placed as the twin's)."""
        if self._own is None:
            import flax.linen as nn

            from migrate.checkpoints import convert
            from parity.decoder import twins
            from parity.remote import protocol

            boxed = convert.nnx_to_linen(twins.nnx_initial_state(self.cfg, self.mesh))
            flat = _flat(boxed["params"], keep_boxes=True)
            values = self.map.backward({p: b.value for p, b in flat.items()})
            names = self.map.names({p: tuple(b.names) for p, b in flat.items()}, forward=False)
            self._own = {
                "params": protocol.nest(
                    {p: nn.LogicallyPartitioned(v, names[p]) for p, v in values.items()}
                )
            }
        return self._own

    def to_common(self, weights: Any) -> Any:
        return weights

    def from_common(self, variables: dict[str, Any]) -> Any:
        """MaxText's common form as this side's weights: every path, shape and dtype of its own
        (else `ConversionError`), placed as its own."""
        import flax.linen as nn
        import jax

        from migrate.checkpoints.convert import ConversionError
        from parity.remote import protocol

        own = _flat(self.own_weights(), keep_boxes=True)
        given = _flat(nn.meta.unbox(variables))
        problems = [f"missing: {'/'.join(p)}" for p in own if p not in given]
        problems += [f"not in the twin's tree: {'/'.join(p)}" for p in given if p not in own]
        for path in set(own) & set(given):
            mine, theirs = own[path].value, given[path]
            if tuple(mine.shape) != tuple(theirs.shape) or str(mine.dtype) != str(theirs.dtype):
                problems.append(
                    f"{'/'.join(path)}: {tuple(theirs.shape)} {theirs.dtype} where the twin has "
                    f"{tuple(mine.shape)} {mine.dtype}"
                )
        if problems:
            raise ConversionError("into the twin (MaxText's form)", sorted(problems))
        return protocol.nest(
            {p: b.replace_boxed(jax.device_put(given[p], b.value.sharding)) for p, b in own.items()}
        )

    def plain(self, tree: Any) -> Any:
        import flax.linen as nn
        import jax

        return jax.device_get(nn.meta.unbox(tree))

    # ------------------------------------------------------------ running

    def _logits(self, plain: Any, batch: Any) -> Any:
        """The twin's logits on MaxText's parameters, mapped onto its pipeline layout; with
        `packing`, on the batch's segment ids and positions (`migrate.common.packing`)."""
        import jax
        from flax import nnx

        from migrate.common import packing
        from parity.remote import protocol

        flat = _flat(plain["params"])
        state = jax.tree.map(lambda x: x, self.abstract)
        nnx.replace_by_pure_dict(state, protocol.nest(self.map.forward(flat)))
        packed = packing.decoder_inputs(batch) if self.cfg.packing else {}
        logits, _ = nnx.merge(self.graphdef, state)(batch["inputs"], **packed)
        return logits

    def _loss(self, plain: Any, batch: Any) -> tuple[Any, Any]:
        import jax
        import jax.numpy as jnp

        logits = self._logits(plain, batch)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        xent = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
        mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
        return jnp.sum(xent * mask) / jnp.sum(mask), logits

    def _grad_fn(self) -> Any:
        import jax
        import optax

        def forward_backward(plain: Any, batch: Any) -> Any:
            (loss, logits), grads = jax.value_and_grad(self._loss, has_aux=True)(plain, batch)
            return loss, logits, grads, optax.global_norm(grads)

        # kept: the positions and segment ids MaxText reads (unpacked, the twin implies them),
        # so that both programs take the same arrays
        return jax.jit(forward_backward, keep_unused=True)

    def run(self, weights: Any) -> Any:
        import flax.linen as nn
        import jax

        from parity.engine.side import Run

        loss, logits, grads, norm = jax.device_get(
            self._grad_fn()(nn.meta.unbox(weights), self.batch)
        )
        return Run(loss=loss, outputs=logits, grads=grads, grad_norm=norm)

    def lowered(self, weights: Any) -> Any:
        import flax.linen as nn

        return self._grad_fn().lower(nn.meta.unbox(weights), self.batch)

    def compiled(self, weights: Any) -> Any:
        if id(weights) not in self._programs:
            self._programs[id(weights)] = (weights, self.lowered(weights).compile())
        return self._programs[id(weights)][1]

    def program_shardings(self, compiled: Any) -> dict[str, tuple[Any, int, Any]]:
        """Per input and output array, labelled as MaxText's side labels its own."""
        import jax

        out = {}
        parts = {"input": ("params", "batch"), "output": ("loss", "logits", "grads", "grad_norm")}
        for io, actual, avals in (
            ("input", compiled.input_shardings[0], compiled.args_info[0]),
            ("output", compiled.output_shardings, compiled.out_info),
        ):
            flat, _ = jax.tree_util.tree_flatten_with_path(actual)
            for (path, sharding), aval in zip(flat, jax.tree.leaves(avals), strict=True):
                head = parts[io][path[0].idx]
                rest = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path[1:])
                label = f"forward+backward {io}: {head}" + (f"/{rest}" if rest else "")
                out[label] = (sharding, len(aval.shape), None)
        return out

    def trainer(self, weights: Any) -> Any:
        import flax.linen as nn
        import jax
        import optax

        from parity.engine.side import Trainer

        params = jax.tree.map(lambda x: x.copy(), nn.meta.unbox(weights))

        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            (loss, _), grads = jax.value_and_grad(self._loss, has_aux=True)(params, batch)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
            return optax.apply_updates(params, updates), opt_state, metrics

        evaluate = jax.jit(lambda params, batch: self._loss(params, batch)[0])
        return Trainer(params, self.tx.init(params), jax.jit(step), evaluate)

    def drill_stages(self, weights: Any) -> list:
        return []

    def jaxpr(self, weights: Any) -> Any:
        return None


def _flat(tree: Any, keep_boxes: bool = False) -> dict[tuple[str, ...], Any]:
    import flax.linen as nn
    import jax

    is_box = (lambda x: isinstance(x, nn.LogicallyPartitioned)) if keep_boxes else None
    return {
        tuple(str(getattr(p, "key", p)) for p in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
    }


def make(options: dict[str, Any], host_batch: Any) -> tuple[TwinSide, Any]:
    """The worker's factory: the twin of `options['keys']` (a MaxText config's keys)."""
    side = TwinSide(options["keys"], host_batch)
    return side, side.place_batch


# ------------------------------------------------------------ the pair, in the harness


def start_pair(config: MaxTextConfig, environments: dict[str, Any]) -> Any:
    """The pair: the twin's worker (this interpreter and checkout) in the reference slot,
    MaxText 0.2.5's (the `nnx` environment) under test; both stopped when either fails to
    start."""
    from parity.remote.client import WorkerSet
    from parity.remote.environments import Environment
    from parity.remote.proxy import RemoteSide

    nnx_env = environments["nnx"]
    twin_env = Environment(python=sys.executable, timeout_s=nnx_env.timeout_s)
    workers = WorkerSet()
    with workers.closed_on_failure():
        first = batch(config.keys, config.num_devices, 0, 0, "train")
        worker = workers.start("linen", twin_env, FACTORY, {"keys": config.keys}, first)
        sides = {
            "linen": RemoteSide(worker, "linen"),
            "nnx": start_side(config, "nnx", nnx_env, workers),
        }
    return TwinPair(config, environments, started=sides)


class TwinPair(MaxTextPair):
    """MaxText 0.2.5 (`nnx`) against the NNX twin (`linen`), each in its worker."""

    front = Front.MAXTEXT_TWIN

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tolerance = TOLERANCE
        self.oracle_sides = ("nnx",)  # `pipeline`: the release's own; the twin has its own gate

    def prepared(self, check: Check, function: Callable[..., Any]) -> Callable[..., Any]:
        """Every check as the registry gives it: held to `TOLERANCE`, no release-fault guard."""
        del check
        return function


def run_gate(
    config: MaxTextConfig, environments: dict[str, Any], selected: list[str], steps: int
) -> tuple[list, list, dict[str, dict[str, Any]]]:
    """`parity --maxtext CONFIG --against=twin`: the `selected` checks on `start_pair`'s pair,
    every worker stopped however the run ends. (results, costs, the sides' versions)."""
    from parity.engine import run_loop
    from parity.reports.progress import progress, workers_line

    config = dataclasses.replace(config, keys=pair_keys(config.keys))
    pair = start_pair(config, environments)
    try:
        progress(f"{config.describe()}; the NNX twin against MaxText 0.2.5")
        results, costs = run_loop.run_checks(pair, selected, steps)
        progress(workers_line(*pair.workers.call_and_transfer_seconds()))
        return results, costs, pair.sides()
    finally:
        pair.workers.close()
