"""What both module sides share: the sequence of calls as one pure function, its program, the
optimizer steps, the drill-down and the `random` check's draws (`parity.module_pair.modules` holds
the Linen and NNX halves).

A side's weights split into three arguments: the parameters (differentiated), the state the
calls read and update (batch statistics, caches) and, for NNX, its RNG state (no Linen
counterpart; carried from call to call, never compared). `run` traces every call compared
exactly (deterministic, or stochastic with aligned keys) in order, the state each returns
carried into the next, under one `jax.jit(jax.value_and_grad(...))`: its loss is the sum of
`loss_fn(outputs)` over the calls.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from migrate.checkpoints import convert
from migrate.config.contract import Rules
from parity.engine.side import ByCall, DrillStage, ProgramArray, Run, Side, Trainer
from parity.module_pair.calls import Call, CallInputs, call_keys, draw_keys, is_float
from parity.multiprocess import distributed

LossFn = Callable[[Any], jax.Array]
# (outputs, state, rng state, sown values) of one call of one side
CallResult = tuple[Any, Any, Any, Any]


def mean_square_loss(outputs: Any) -> jax.Array:
    """The default loss: sum over the floating-point output leaves of `mean(leaf ** 2)`.

    Computed in float32. The mean keeps the scale independent of the batch size; non-float
    leaves (token ids, masks) are skipped.
    """
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree.leaves(outputs):
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
            total = total + jnp.mean(jnp.square(jnp.asarray(leaf, jnp.float32)))
    return total


def key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def module_keys(path: tuple) -> tuple[str, ...]:
    """A leaf's key path as names, without the box's or Variable's own `value` attribute (a
    `GetAttrKey`); a module or dict entry named `value` (attention's value projection) stays."""
    return tuple(
        key_str(k)
        for k in path
        if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")
    )


def flat_paths(tree: Any, prefix: Sequence[str] = ()) -> dict[str, Any]:
    """Leaves of a tree by `/`-joined path (box `value` levels dropped)."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nn.meta.unbox(tree))[0]:
        keys = [key_str(k) for k in path]
        flat["/".join([*prefix, *keys])] = leaf
    return flat


class ModuleSide(Side):
    """One module of a pair, called as `calls` say; the Linen and NNX halves implement
    `split`, `apply_call`, `state_paths`, `sown_paths` and the labels of their arguments."""

    def __init__(
        self,
        calls: Sequence[Call],
        loss_fn: LossFn,
        rules: Rules | None,
        mesh: Mesh | None,
        optimizer: optax.GradientTransformation,
        seed: int,
    ) -> None:
        self.calls, self.loss_fn, self.seed = tuple(calls), loss_fn, seed
        self.rules, self.mesh, self.optimizer = rules, mesh, optimizer
        self.call_inputs = [CallInputs.of(c, self.framework) for c in self.calls]
        self.keys = call_keys(self.calls, seed)
        self.compared = [i for i, c in enumerate(self.calls) if c.compared_exactly]
        self.input_grads_error: str | None = None  # why the inputs' gradients were not taken

    def context(self) -> contextlib.AbstractContextManager:
        """The logical axis rules (one context for Linen and NNX) while tracing, when given."""
        return nn.logical_axis_rules(self.rules) if self.rules else contextlib.nullcontext()

    # ------------------------------------------------------------ what each side implements

    def split(self, weights: Any) -> tuple[Any, Any, Any]:
        """Native weights -> (params, state, rng state)."""
        raise NotImplementedError

    def apply_call(
        self,
        index: int,
        params: Any,
        state: Any,
        rng: Any,
        arrays: Any,
        key: Any,
        capture_all: bool = False,
    ) -> CallResult:
        """Call `index` on traced arrays: (outputs, state after, rng state after, sown values
        as `sown_paths` reads them; with `capture_all` every submodule's output too)."""
        raise NotImplementedError

    def state_paths(self, state: Any) -> dict[str, Any]:
        """State -> `{'batch_stats/bn/mean': array}`, keyed by Linen collection and path."""
        raise NotImplementedError

    def sown_paths(self, sown: Any) -> dict[str, Any]:
        """Sown values -> `{'intermediates/block/h/0': array}`."""
        raise NotImplementedError

    def grads_common(self, grads: Any) -> dict[str, Any]:
        """Gradients as returned -> flat by Linen path."""
        raise NotImplementedError

    def param_label(self, path: tuple) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------ the calls as one function

    def inputs(self) -> tuple[tuple[dict[str, Any], Any], ...]:
        """The traced inputs of the compared calls: (arrays by label, aligned key or None)."""
        return tuple((self.call_inputs[i].arrays(), self.keys[i]) for i in self.compared)

    def loss(self, params: Any, state: Any, rng: Any, inputs: Any) -> tuple[jax.Array, Any]:
        """Every compared call in order, state carried: (sum of the losses, aux)."""
        total = jnp.zeros((), jnp.float32)
        outputs, states, sown = ByCall(), ByCall(), ByCall()
        for index, (arrays, key) in zip(self.compared, inputs, strict=True):
            out, state, rng, captured = self.apply_call(index, params, state, rng, arrays, key)
            # The state a call leaves is data for the next, as between training steps: no
            # gradient flows through it (NNX's BatchNorm stops it, Linen's does not).
            state = jax.lax.stop_gradient(state)
            name = self.calls[index].name
            total = total + self.loss_fn(out)
            outputs[name], states[name] = out, self.state_paths(state)
            sown[name] = self.sown_paths(captured)
        if len(self.calls) == 1:  # one call: records unnested (`outputs`, not `outputs/x`)
            (outputs,), (states,), (sown,) = outputs.values(), states.values(), sown.values()
        return total, {"outputs": outputs, "state": states, "sown": sown, "rng": rng}

    def args(self, weights: Any) -> tuple[Any, ...]:
        return (*self.split(weights), self.inputs())

    @functools.cached_property
    def step(self) -> Callable:
        """`(params, state, rng, inputs) -> ((loss, aux), (parameter grads, input grads))`:
        the input gradients of the floating-point arrays both sides get (`input_grads`)."""
        shared = [self.call_inputs[i].shared for i in self.compared]

        def value_and_grads(params, state, rng, inputs):
            wrt = tuple(
                {k: a for k, a in arrays.items() if k in labels and is_float(a)}
                for (arrays, _), labels in zip(inputs, shared, strict=True)
            )

            def loss(params, wrt):
                merged = tuple(
                    ({**arrays, **w}, key) for (arrays, key), w in zip(inputs, wrt, strict=True)
                )
                return self.loss(params, state, rng, merged)

            try:
                return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, wrt)
            except Exception as error:  # e.g. reverse mode through a while_loop of an input
                self.input_grads_error = f"{type(error).__name__}: {str(error).strip()[:200]}"
            (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, wrt)
            return (value, aux), (grads, tuple({} for _ in wrt))

        return jax.jit(value_and_grads)

    def input_grads(self, grads: tuple[dict[str, Any], ...]) -> dict[str, Any]:
        """Input gradients by label (`0`, `mask`; `train/0` with several calls)."""
        one = len(self.calls) == 1
        return {
            label if one else f"{self.calls[index].name}/{label}": g
            for index, per_call in zip(self.compared, grads, strict=True)
            for label, g in per_call.items()
        }

    def run(self, weights: Any) -> Run:
        with self.context():
            (loss, aux), (grads, input_grads) = self.step(*self.args(weights))
        return Run(
            loss,
            aux["outputs"],
            self.grads_common(grads),
            state=aux["state"],
            sown=aux["sown"],
            input_grads=self.input_grads(input_grads),
        )

    def lowered(self, weights: Any) -> jax.stages.Lowered:
        with self.context():
            return self.step.lower(*self.args(weights))

    def jaxpr(self, weights: Any) -> Any:
        with self.context():
            return jax.make_jaxpr(self.loss)(*self.args(weights)).jaxpr

    # ------------------------------------------------------------ labels of the program

    def input_label(self, path: tuple) -> str | None:
        """A compiled input's label: `params up/kernel`, `state batch_stats/bn/mean`,
        `input 0` (`input train/0` with several calls); None for what has no counterpart on
        the other side (RNG state, keys, arguments only this side gets)."""
        argument = path[0].idx
        if argument == 0:
            return "params " + self.param_label(path[1:])
        if argument == 1:
            return self.state_label(path[1:])
        if argument == 3 and path[2].idx == 0:
            index = self.compared[path[1].idx]
            label = key_str(path[3])
            if label not in self.call_inputs[index].shared:
                return None
            name = self.calls[index].name
            return f"input {label}" if len(self.calls) == 1 else f"input {name}/{label}"
        return None

    def state_label(self, path: tuple) -> str | None:
        raise NotImplementedError

    def program_shardings(self, compiled: jax.stages.Compiled) -> dict[str, ProgramArray]:
        """Parameters, state and inputs as the compiled program takes them; its outputs,
        updated state, sown values and gradients as it returns them."""
        out: dict[str, ProgramArray] = {}
        for (path, sharding), aval in zip(
            jax.tree_util.tree_flatten_with_path(compiled.input_shardings[0])[0],
            jax.tree.leaves(compiled.args_info[0]),
            strict=True,
        ):
            label = self.input_label(path)
            if label is not None:
                out[f"compiled input {label}"] = (sharding, len(aval.shape), None)
        (_, aux), (grads, input_grads) = compiled.output_shardings
        aux_infos = jax.tree.leaves(compiled.out_info[0][1])
        count = 0
        for (path, sharding), aval in zip(
            jax.tree_util.tree_flatten_with_path(aux)[0], aux_infos, strict=True
        ):
            part = key_str(path[0])
            if part == "outputs":
                out[f"compiled output {count}"] = (sharding, len(aval.shape), None)
                count += 1
            elif part in ("state", "sown"):
                where = "/".join(key_str(k) for k in path[1:])
                out[f"compiled {part} {where}"] = (sharding, len(aval.shape), None)
        for (path, sharding), aval in zip(
            jax.tree_util.tree_flatten_with_path(grads)[0],
            jax.tree.leaves(compiled.out_info[1][0]),
            strict=True,
        ):
            out[f"compiled grad {self.param_label(path)}"] = (sharding, len(aval.shape), None)
        input_infos = self.input_grads(compiled.out_info[1][1])
        for label, sharding in self.input_grads(input_grads).items():
            out[f"compiled input grad {label}"] = (sharding, len(input_infos[label].shape), None)
        return out

    # ------------------------------------------------------------ training

    def grad_leaves(self, grads: Any) -> list[tuple[str, Any]]:
        """Gradient leaves by Linen path, in Linen path order: the one order both sides
        reduce in (each tree's own order differs where names differ)."""
        flat = jax.tree_util.tree_flatten_with_path(grads)[0]
        return sorted(((self.param_label(path), g) for path, g in flat), key=lambda x: x[0])

    def grad_norm(self, grads: Any) -> jax.Array:
        """The global gradient norm (`optax.global_norm`'s sum of squares) over
        `grad_leaves`: float sums depend on their order, so a sum in each side's own leaf
        order differs by an ulp between two identical gradient trees."""
        squares = [jnp.sum(jnp.square(g)) for _, g in self.grad_leaves(grads)]
        return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))

    def trainer(self, weights: Any) -> Trainer:
        """Optimizer steps on the parameters; every step starts from the weights' state."""
        tx = self.optimizer
        params, state, rng = self.split(weights)

        inputs = self.inputs()

        def loss(params):  # the pair's batch is this side's calls (`ModulePair.batch`: None)
            return self.loss(params, state, rng, inputs)

        def step(params, opt_state, batch):
            del batch
            (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            metrics = {"loss": value, "grad_norm": self.grad_norm(grads)}
            return optax.apply_updates(params, updates), opt_state, metrics

        def evaluate(params, batch):
            del batch
            return loss(params)[0]

        with self.context():
            compiled = jax.jit(step).lower(params, tx.init(params), None).compile()
        return Trainer(params, tx.init(params), compiled, jax.jit(evaluate))

    # ------------------------------------------------------------ drill-down and draws

    def drill_stages(self, weights: Any) -> list[DrillStage]:
        """One stage per compared call, each capturing every submodule's output; the state
        a stage leaves is the next stage's (the stages run in order)."""
        params, state, rng = self.split(weights)
        carried = {"state": state, "rng": rng}

        def stage(index: int, arrays: Any, key: Any) -> DrillStage:
            def apply(_):
                with self.context():
                    out, carried["state"], carried["rng"], captured = self.apply_call(
                        index, params, carried["state"], carried["rng"], arrays, key, True
                    )
                # The call's own output, also where a capture misses it (NNX's capture of
                # method outputs skips a method the module's class inherits).
                return out, {**self.captures(captured), "output": out}

            name = self.calls[index].name
            # With several calls, a record says which call it was captured in.
            fields = (lambda _capture: {"call": name}) if len(self.compared) > 1 else None
            if fields is None:
                return DrillStage(name, apply, order=self.capture_order())
            return DrillStage(name, apply, order=self.capture_order(), fields=fields)

        return [stage(i, *inputs) for i, inputs in zip(self.compared, self.inputs(), strict=True)]

    def captures(self, captured: Any) -> dict[str, Any]:
        raise NotImplementedError

    def capture_order(self) -> tuple[str, ...]:
        """Capture names in execution order (the Linen side knows it; `layers` reads it)."""
        return ()

    def stochastic_calls(self) -> dict[int, tuple[str, Any]]:
        return {i: (c.name, c.randomness) for i, c in enumerate(self.calls) if c.randomness}

    def draws(self, weights: Any, index: int) -> Any:
        """`randomness.draws` independent calls of stochastic call `index` from `weights`
        (the state of each draw is the weights', the RNG state is carried), stacked on a
        leading draw axis, on the host: `{"outputs": ..., "sites": {capture: ...}}`, the
        sites (every submodule's output, by Linen path) only where the sides' keys are not
        aligned (the distributions are compared site by site)."""
        params, state, rng = self.split(weights)
        keys = draw_keys(self.seed, index, self.calls[index].randomness.draws)
        with self.context():
            stacked = self._draw_fn(index)(
                params, state, rng, self.call_inputs[index].arrays(), keys
            )
        return distributed.to_host(stacked)

    @functools.cache  # noqa: B019 (one side per pair; compiled once per call)
    def _draw_fn(self, index: int) -> Callable:
        sites = not self.calls[index].randomness.aligned

        def all_draws(params, state, rng, arrays, keys):
            def body(rng, key):
                out, _, rng, captured = self.apply_call(
                    index, params, state, rng, arrays, key, capture_all=sites
                )
                found = self.captures(captured) if sites else {}
                found.pop("output", None)  # the outputs themselves, compared as such
                return rng, {"outputs": out, "sites": found}

            return jax.lax.scan(body, rng, keys)[1]

        return jax.jit(all_draws)


def unboxed_grads(grads_params: Any) -> dict[str, Any]:
    """Gradients in Linen's form (`params` tree, boxed or not) flat by Linen path."""
    flat = convert.flatten_dict(nn.meta.unbox(grads_params))
    return {"/".join(path): value for path, value in flat.items()}


def captures(tree: Any) -> dict[str, Any]:
    """Captured submodule outputs (Linen `capture_intermediates`, NNX `nnx.capture`) by
    module path: `('mlp', 'up', '__call__', 0)` -> `mlp/up`; the module's own output is
    `output`; repeated calls keep their index (`mlp/up/1`)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [key_str(k).strip("[]") for k in path if key_str(k) != "intermediates"]
        if "__call__" not in keys:
            continue
        call = keys.index("__call__")
        name = "/".join(keys[:call]) or "output"
        index = keys[call + 1] if call + 1 < len(keys) else "0"
        out[name if index == "0" else f"{name}/{index}"] = leaf
    return out
