"""Any Linen module and its NNX port as the two `Side`s of a pair (`compare_modules`).

`LinenModuleSide` initialises (or is given) Linen variables and applies the module to the
pair's inputs; `NNXModuleSide` splits the constructed NNX module into its Params and the rest
and runs `nnx.merge` inside `jax.jit` and `jax.grad` (the functional form, so that the pair is
judged the same way with NNX graph mode on or off). The program a module side exposes is its
jitted `value_and_grad` of `loss_fn(outputs)` with respect to the parameters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from migrate import convert
from migrate.config import Rules
from parity import distributed
from parity.engine.side import DrillStage, ProgramArray, Run, Side, Trainer

Path = tuple[str, ...]
LossFn = Callable[[Any], jax.Array]


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


def to_linen_path(path: Path, renames: Mapping[Path, Path]) -> Path:
    """An NNX path in Linen's naming (the inverse of the `renames` prefix map)."""
    for linen_prefix, nnx_prefix in renames.items():
        if path[: len(nnx_prefix)] == tuple(nnx_prefix):
            return (*linen_prefix, *path[len(nnx_prefix) :])
    return path


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat_grads(grads_params: Any) -> dict[str, Any]:
    """Gradients in Linen's form (`params` tree, boxed or not) flat by Linen path."""
    flat = convert.flatten_dict(nn.meta.unbox(grads_params))
    return {"/".join(path): value for path, value in flat.items()}


class ModuleSide(Side):
    """What both module sides share: inputs, loss, rules and mesh, and the optimizer."""

    def __init__(
        self,
        inputs: tuple[Any, ...],
        loss_fn: LossFn,
        rules: Rules | None,
        mesh: Mesh | None,
        optimizer: optax.GradientTransformation,
    ) -> None:
        self.inputs, self.loss_fn = inputs, loss_fn
        self.rules, self.mesh, self.optimizer = rules, mesh, optimizer

    def context(self) -> contextlib.AbstractContextManager:
        """The logical axis rules (one context for Linen and NNX) while tracing, when given."""
        return nn.logical_axis_rules(self.rules) if self.rules else contextlib.nullcontext()

    # Each side: `(weights, *inputs) -> (loss, outputs)`, pure.
    def loss(self, weights: Any, *inputs: Any) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def grads_common(self, grads: Any) -> dict[str, Any]:
        """Gradients as returned -> flat by Linen path."""
        raise NotImplementedError

    def args(self, weights: Any) -> tuple[Any, ...]:
        """The positional arguments of `loss` (weights first, then the inputs)."""
        return (weights, *self.inputs)

    @functools.cached_property
    def step(self) -> Callable:
        return jax.jit(jax.value_and_grad(self.loss, has_aux=True))

    def run(self, weights: Any) -> Run:
        with self.context():
            (loss, outputs), grads = self.step(*self.args(weights))
        return Run(loss, outputs, self.grads_common(grads))

    def lowered(self, weights: Any) -> jax.stages.Lowered:
        with self.context():
            return self.step.lower(*self.args(weights))

    def jaxpr(self, weights: Any) -> Any:
        with self.context():
            return jax.make_jaxpr(self.loss)(*self.args(weights)).jaxpr

    def program_shardings(self, compiled: jax.stages.Compiled) -> dict[str, ProgramArray]:
        """Parameters and inputs as the compiled program takes them, its loss, outputs and
        gradients as it returns them; parameters and gradients named by Linen path."""
        out: dict[str, ProgramArray] = {}
        for (path, sharding), aval in zip(
            jax.tree_util.tree_flatten_with_path(compiled.input_shardings[0])[0],
            jax.tree.leaves(compiled.args_info[0]),
            strict=True,
        ):
            label = self.input_label(path)
            if label is not None:
                out[f"compiled input {label}"] = (sharding, len(aval.shape), None)
        (loss_and_outputs, grads) = compiled.output_shardings
        (_, outputs) = loss_and_outputs
        output_infos = jax.tree.leaves(compiled.out_info[0][1])
        for i, (sharding, aval) in enumerate(
            zip(jax.tree.leaves(outputs), output_infos, strict=True)
        ):
            out[f"compiled output {i}"] = (sharding, len(aval.shape), None)
        grad_infos = jax.tree.leaves(compiled.out_info[1])
        for (path, sharding), aval in zip(
            jax.tree_util.tree_flatten_with_path(grads)[0], grad_infos, strict=True
        ):
            out[f"compiled grad {self.param_label(path)}"] = (sharding, len(aval.shape), None)
        return out

    def input_label(self, path: tuple) -> str | None:
        raise NotImplementedError

    def param_label(self, path: tuple) -> str:
        raise NotImplementedError

    def trainer(self, weights: Any) -> Trainer:
        tx = self.optimizer
        params = self.trainable(weights)

        def step(params, opt_state, inputs):
            (loss, _), grads = jax.value_and_grad(self.loss, has_aux=True)(
                self.with_params(weights, params), *inputs
            )
            updates, opt_state = tx.update(grads, opt_state, params)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
            return optax.apply_updates(params, updates), opt_state, metrics

        def evaluate(params, inputs):
            return self.loss(self.with_params(weights, params), *inputs)[0]

        with self.context():
            compiled = jax.jit(step).lower(params, tx.init(params), self.inputs).compile()
        return Trainer(params, tx.init(params), compiled, jax.jit(evaluate))

    def trainable(self, weights: Any) -> Any:
        """The part of `weights` the optimizer updates."""
        return weights

    def with_params(self, weights: Any, params: Any) -> Any:
        """`weights` with its trainable part replaced by `params`."""
        del weights
        return params


class LinenModuleSide(ModuleSide):
    """A Linen module: variables from the given tree or `init`, placed by their boxes."""

    framework = "linen"

    def __init__(
        self,
        module: nn.Module,
        variables: Mapping[str, Any] | None,
        seed: int,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.module, self.given, self.seed = module, variables, seed

    def own_weights(self) -> Any:
        if self.given is not None:
            return dict(self.given)
        key = jax.random.key(self.seed)
        init = self.module.init
        with self.context():
            if self.mesh is None:
                return dict(jax.jit(init)(key, *self.inputs))
            abstract = jax.eval_shape(init, key, *self.inputs)
            shardings = nn.logical_to_mesh_sharding(
                nn.get_partition_spec(abstract), self.mesh, self.rules
            )
            return dict(jax.jit(init, out_shardings=shardings)(key, *self.inputs))

    @functools.cached_property
    def _target(self) -> Any:
        if self.given is not None:
            return self.given
        with self.context():
            return jax.eval_shape(self.module.init, jax.random.key(self.seed), *self.inputs)

    def to_common(self, weights: Any) -> dict[str, Any]:
        return weights

    def from_common(self, variables: dict[str, Any]) -> Any:
        return convert.check_linen(variables, self._target)

    def plain(self, tree: Any) -> Any:
        if isinstance(tree, Mapping) and "params" in tree:
            tree = tree["params"]
        return distributed.to_host(nn.meta.unbox(tree))

    def loss(self, variables: Any, *inputs: Any) -> tuple[jax.Array, Any]:
        outputs = self.module.apply(variables, *inputs)
        return self.loss_fn(outputs), outputs

    def grads_common(self, grads: Any) -> dict[str, Any]:
        return _flat_grads(grads["params"])

    def input_label(self, path: tuple) -> str | None:
        if path[0].idx == 0:
            keys = [_key(k) for k in path[1:]]
            if keys[0] != "params":
                return None
            return "params " + "/".join(k for k in keys[1:] if k != "value")
        return f"input {path[0].idx - 1}"

    def param_label(self, path: tuple) -> str:
        keys = [_key(k) for k in path]
        return "/".join(k for k in keys[1:] if k != "value")

    def trainable(self, weights: Any) -> Any:
        return weights["params"]

    def with_params(self, weights: Any, params: Any) -> Any:
        return {**weights, "params": params}

    def drill_stages(self, weights: Any) -> list[DrillStage]:
        def apply(_):
            with self.context():
                out, state = self.module.apply(
                    weights, *self.inputs, capture_intermediates=True, mutable=["intermediates"]
                )
            return out, captures(state["intermediates"])

        return [DrillStage("module", apply)]


class NNXModuleSide(ModuleSide):
    """A constructed NNX module, split into its Params (the weights) and the rest."""

    framework = "nnx"

    def __init__(self, module: nnx.Module, renames: Mapping[Path, Path], **common: Any) -> None:
        super().__init__(**common)
        self.renames = dict(renames)
        self.graphdef, self.params, self.rest = nnx.split(module, nnx.Param, ...)

    def own_weights(self) -> Any:
        return self.params

    def to_common(self, weights: Any) -> dict[str, Any]:
        return convert.nnx_to_linen(weights, renames=self.renames)

    def from_common(self, variables: dict[str, Any]) -> Any:
        return convert.linen_to_nnx(variables, self.params, self.renames)

    def plain(self, tree: Any) -> Any:
        tree = jax.tree.map(
            lambda x: self.to_common(x)["params"] if isinstance(x, nnx.State) else x,
            tree,
            is_leaf=lambda x: isinstance(x, nnx.State),
        )
        return distributed.to_host(nn.meta.unbox(tree))

    def args(self, weights: Any) -> tuple[Any, ...]:
        return (weights, self.rest, *self.inputs)

    def loss(self, params: Any, rest: Any, *inputs: Any) -> tuple[jax.Array, Any]:
        outputs = nnx.merge(self.graphdef, params, rest)(*inputs)
        return self.loss_fn(outputs), outputs

    def grads_common(self, grads: Any) -> dict[str, Any]:
        return _flat_grads(convert.nnx_to_linen(grads, renames=self.renames)["params"])

    def input_label(self, path: tuple) -> str | None:
        index = path[0].idx
        if index == 0:
            keys = tuple(k for k in (_key(k) for k in path[1:]) if k != "value")
            return "params " + "/".join(to_linen_path(keys, self.renames))
        if index == 1:
            return None  # RNG state and other non-Param variables: no Linen counterpart
        return f"input {index - 2}"

    def param_label(self, path: tuple) -> str:
        keys = tuple(k for k in (_key(k) for k in path) if k != "value")
        return "/".join(to_linen_path(keys, self.renames))

    def trainer(self, weights: Any) -> Trainer:
        tx = self.optimizer
        rest = self.rest

        def step(params, opt_state, inputs):
            (loss, _), grads = jax.value_and_grad(self.loss, has_aux=True)(params, rest, *inputs)
            updates, opt_state = tx.update(grads, opt_state, params)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
            return optax.apply_updates(params, updates), opt_state, metrics

        def evaluate(params, inputs):
            return self.loss(params, rest, *inputs)[0]

        with self.context():
            compiled = jax.jit(step).lower(weights, tx.init(weights), self.inputs).compile()
        return Trainer(weights, tx.init(weights), compiled, jax.jit(evaluate))

    def drill_stages(self, weights: Any) -> list[DrillStage]:
        def apply(_):
            model = nnx.merge(self.graphdef, weights, self.rest)
            with self.context():
                out, captured = nnx.capture(
                    model, nnx.Intermediate, method_outputs=nnx.Intermediate
                )(*self.inputs)
            return out, captures(nnx.to_pure_dict(captured))

        return [DrillStage("module", apply)]


def captures(tree: Any) -> dict[str, Any]:
    """Captured submodule outputs (Linen `capture_intermediates`, NNX `nnx.capture`) by
    module path: `('mlp', 'up', '__call__', 0)` -> `mlp/up`; the module's own output is
    `output`; repeated calls keep their index (`mlp/up/1`)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [_key(k).strip("[]") for k in path if _key(k) != "intermediates"]
        if "__call__" not in keys:
            continue
        call = keys.index("__call__")
        name = "/".join(keys[:call]) or "output"
        index = keys[call + 1] if call + 1 < len(keys) else "0"
        out[name if index == "0" else f"{name}/{index}"] = leaf
    return out
