"""Any Linen module and its NNX port as the two `Side`s of a pair (`compare_modules`).

`LinenModuleSide` initialises (or is given) Linen variables and calls `module.apply` with
every non-parameter collection mutable; `NNXModuleSide` splits the constructed NNX module
into its Params, its other mapped state (BatchStat, Cache, ...) and the rest (RNG state) and
runs `nnx.merge` inside `jax.jit` and `jax.grad` (the functional form, so that the pair is
judged the same way with NNX graph mode on or off), reading sown values with `nnx.capture`.
Both name everything by Linen collection and path, through `migrate.checkpoints.convert` and
`renames`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import DenyList
from flax.nnx import bridge

from migrate.checkpoints import convert
from migrate.common import sharding as sharding_lib
from parity.engine.side import SideError
from parity.module_pair import bridges, conversion, hints, order
from parity.module_pair import renames as rename_paths
from parity.module_pair.calls import is_sown
from parity.module_pair.conversion import Conversion
from parity.module_pair.module_base import (
    CallResult,
    LossFn,
    ModuleSide,
    captures,
    flat_paths,
    mean_square_loss,
    module_keys,
    unboxed_grads,
)
from parity.multiprocess import distributed

Path = tuple[str, ...]
__all__ = ["LinenModuleSide", "LossFn", "NNXModuleSide", "mean_square_loss", "to_linen_path"]


def to_linen_path(path: Path, renames: Mapping[Path, Path]) -> Path:
    """An NNX path in Linen's naming (the inverse of the `renames` prefix map): the longest
    matching NNX prefix wins."""
    return rename_paths.to_linen(path, renames)


def plain_common(variables: Mapping[str, Any]) -> Any:
    """Common-form variables as plain host arrays: the parameter tree alone when there is
    nothing else (records keep their `down/kernel` names), else every collection."""
    tree = variables["params"] if set(variables) == {"params"} else dict(variables)
    return distributed.to_host(nn.meta.unbox(tree))


class LinenModuleSide(ModuleSide):
    """A Linen module: variables from the given tree or `init`, placed by their boxes."""

    framework = "linen"

    def __init__(
        self,
        module: nn.Module,
        variables: Mapping[str, Any] | None,
        collections: Mapping[str, type],
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.module, self.given = module, variables
        self.sown = frozenset(c for c, t in collections.items() if is_sown(t))

    def _weights_only(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        out = {c: v for c, v in variables.items() if c not in self.sown}
        return {"params": {}, **out}

    def _init(self, key: jax.Array, arrays: dict[str, Any]) -> Any:
        """`module.init` on the first call (keys for `params` and every named stream)."""
        call, inputs = self.calls[0], self.call_inputs[0]
        args, kwargs = inputs.rebuild(arrays)
        params_key, stream_key = jax.random.split(key)
        streams = call.randomness.linen_streams if call.randomness else ()
        rngs = {"params": params_key, "dropout": stream_key} | dict.fromkeys(streams, stream_key)
        if call.randomness is not None and call.randomness.linen_arg:
            kwargs[call.randomness.linen_arg] = stream_key
        try:
            return self.module.init(rngs, *args, method=call.method, **kwargs)
        except Exception as error:
            raise SideError(self.framework, f"init ({call.name})", error) from error

    def own_weights(self) -> Any:
        if self.given is not None:
            return self._weights_only(self.given)
        key, arrays = jax.random.key(self.seed), self.call_inputs[0].arrays()
        with self.context():
            if self.mesh is None:
                return self._weights_only(jax.jit(self._init)(key, arrays))
            abstract = jax.eval_shape(self._init, key, arrays)
            shardings = nn.logical_to_mesh_sharding(
                nn.get_partition_spec(abstract), self.mesh, self.rules
            )
            return self._weights_only(jax.jit(self._init, out_shardings=shardings)(key, arrays))

    @functools.cached_property
    def _calls(self) -> tuple[tuple[str, ...], frozenset[str]]:
        try:
            with self.context():
                return order.linen_calls(
                    self._init, jax.random.key(self.seed), self.call_inputs[0].arrays()
                )
        except Exception:  # the checks themselves report a module that does not trace
            return (), frozenset()

    @property
    def execution_order(self) -> tuple[str, ...]:
        """Submodule paths in the order the first call's outputs are made (traced `init`);
        empty when it cannot be traced (the checks report why)."""
        return self._calls[0]

    def opaque(self, capture: str) -> bool:
        """Inside an NNX layer (`bridge.ToLinen`): Linen captures only its output."""
        return order.inside(capture, self._calls[1])

    @functools.cached_property
    def _target(self) -> Any:
        if self.given is not None:
            return self._weights_only(self.given)
        with self.context():
            abstract = jax.eval_shape(
                self._init, jax.random.key(self.seed), self.call_inputs[0].arrays()
            )
        return self._weights_only(abstract)

    def to_common(self, weights: Any) -> dict[str, Any]:
        return weights

    def leaf_shapes(self) -> dict[Path, tuple]:
        """`(collection, *path)` -> shape of every variable, in Linen's order."""
        flat = convert.flatten_dict(nn.meta.unbox(self._target))
        return {tuple(str(k) for k in path): tuple(x.shape) for path, x in flat.items()}

    def from_common(self, variables: dict[str, Any]) -> Any:
        same = sharding_lib.same_placement(self.rules)
        return convert.check_linen(variables, self._target, same_names=same)

    def plain(self, tree: Any) -> Any:
        if isinstance(tree, Mapping) and "params" in tree:
            return plain_common(tree)
        return distributed.to_host(nn.meta.unbox(tree))

    def split(self, weights: Any) -> tuple[Any, Any, Any]:
        return weights["params"], {c: v for c, v in weights.items() if c != "params"}, None

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
        call = self.calls[index]
        args, kwargs = self.call_inputs[index].rebuild(arrays)
        rngs = None
        if call.randomness is not None and key is not None:
            if call.randomness.linen_arg:
                kwargs[call.randomness.linen_arg] = key
            else:
                rngs = dict.fromkeys(call.randomness.linen_streams, key)
        try:
            out, mutated = self.module.apply(
                {"params": params, **state},
                *args,
                rngs=rngs,
                method=call.method,
                mutable=DenyList("params"),
                capture_intermediates=capture_all,
                **kwargs,
            )
        except Exception as error:
            raise SideError(self.framework, f"call {call.name!r}", error) from error
        mutated = dict(mutated)
        new_state = {c: v for c, v in mutated.items() if c not in self.sown}
        return out, new_state, rng, {c: v for c, v in mutated.items() if c in self.sown}

    def state_paths(self, state: Any) -> dict[str, Any]:
        return flat_paths(state)

    def sown_paths(self, sown: Any) -> dict[str, Any]:
        return flat_paths(sown)

    def captures(self, captured: Any) -> dict[str, Any]:
        return captures(captured.get("intermediates", {}))

    def capture_order(self) -> tuple[str, ...]:
        return (*self.execution_order, "output")

    def grads_common(self, grads: Any) -> dict[str, Any]:
        return unboxed_grads(grads)

    def param_label(self, path: tuple) -> str:
        return "/".join(module_keys(path))

    def state_label(self, path: tuple) -> str | None:
        return "state " + self.param_label(path)


class NNXModuleSide(ModuleSide):
    """A constructed NNX module, split into its Params, its other mapped state and the rest
    (RNG state: no Linen counterpart, carried from call to call). Native weights are one
    State of the Params and the mapped state."""

    framework = "nnx"

    def __init__(
        self,
        module: nnx.Module,
        renames: Mapping[Path, Path],
        collections: Mapping[str, type],
        conversion: Conversion | None = None,
        linen_target: Callable[[], Mapping[str, Any]] | None = None,
        **common: Any,
    ) -> None:
        """`linen_target`: the Linen side's variables (abstract), which a `conversion`'s output
        must match; needed with one."""
        super().__init__(**common)
        if conversion is not None and linen_target is None:
            raise ValueError("a conversion needs the Linen side's variables (linen_target)")
        self.renames, self.conversion, self.linen_target = dict(renames), conversion, linen_target
        self.collections = {c: t for c, t in collections.items() if not is_sown(t)}
        self.sown_collections = {c: t for c, t in collections.items() if is_sown(t)}
        self.state_types = tuple(t for t in self.collections.values() if t is not nnx.Param)
        self.graphdef, params, state, self.rest = nnx.split(
            module, nnx.Param, self.state_types, ...
        )
        self.template = nnx.merge_state(params, state)
        self.bridged = frozenset(  # Linen layers inside (`bridge.ToNNX`), by Linen path
            "/".join(to_linen_path(tuple(str(k) for k in path), self.renames))
            for path, m in nnx.iter_modules(module)
            if isinstance(m, bridge.ToNNX)
        )
        self.state_collections = {
            tuple(str(k) for k in path): convert.collection_of(type(v), self.collections)
            for path, v in nnx.to_flat_state(state)
        }

    def own_weights(self) -> Any:
        return self.template

    def leaf_shapes(self) -> dict[Path, tuple]:
        """`(collection, *Linen path)` -> shape of every variable (`renames` applied)."""
        return {
            (
                convert.collection_of(type(v), self.collections) or "?",
                *to_linen_path(module_keys(path), self.renames),
            ): tuple(v.get_value().shape)
            for path, v in nnx.to_flat_state(self.template)
        }

    def to_common(self, weights: Any) -> dict[str, Any]:
        if self.conversion is not None:
            return conversion.to_linen_variables(self.conversion, weights, self.linen_target())
        return convert.nnx_to_linen(weights, renames=self.renames, collections=self.collections)

    def from_common(self, variables: dict[str, Any]) -> Any:
        if self.conversion is not None:
            return conversion.to_nnx_state(self.conversion, variables, self.template)
        same = sharding_lib.same_placement(self.rules)
        return convert.linen_to_nnx(
            variables, self.template, self.renames, self.collections, same_names=same
        )

    def plain(self, tree: Any) -> Any:
        tree = jax.tree.map(
            lambda x: plain_common(self.to_common(x)) if isinstance(x, nnx.State) else x,
            tree,
            is_leaf=lambda x: isinstance(x, nnx.State),
        )
        return distributed.to_host(nn.meta.unbox(tree))

    def split(self, weights: Any) -> tuple[Any, Any, Any]:
        params, state = nnx.split_state(weights, nnx.Param, ...)
        return params, state, self.rest

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
        call = self.calls[index]
        args, kwargs = self.call_inputs[index].rebuild(arrays)
        if call.randomness is not None and call.randomness.nnx_arg and key is not None:
            kwargs[call.randomness.nnx_arg] = call.randomness.nnx_value(key)
        # copy: the merged Variables belong to this trace level (BatchNorm under jax.grad).
        model = nnx.merge(self.graphdef, params, state, rng, copy=True)
        bridges.shield_bridges(model)

        def method(module, *args, **kwargs):
            return (getattr(module, call.method) if call.method else module)(*args, **kwargs)

        sown = self.sown_collections or {"intermediates": nnx.Intermediate}
        try:
            if call.nnx_attributes:
                model.set_attributes(**call.nnx_attributes)
            with bridges.bridged_sown(model, sown) as bridged:
                out, *captured = nnx.capture(
                    method,
                    *sown.values(),
                    method_outputs=nnx.Intermediate if capture_all else None,
                )(model, *args, **kwargs)
        except Exception as error:
            nnx_arg = call.randomness.nnx_arg if call.randomness else None
            hint = hints.nnx_hint(error, nnx_arg)
            raise SideError(self.framework, f"call {call.name!r}", error, hint) from error
        _, new_state, new_rng = nnx.state(model, nnx.Param, self.state_types, ...)
        # one State per sown type, and what the Linen layers inside sowed, at their paths
        sown_state = nnx.merge_state(*captured, bridges.with_prefixes(bridged))
        return out, new_state, new_rng, sown_state

    def _linen_key(self, path: tuple, collection: str | None) -> str:
        keys = module_keys(path)
        return "/".join((collection or "?", *to_linen_path(keys, self.renames)))

    def state_paths(self, state: Any) -> dict[str, Any]:
        return {
            self._linen_key(path, convert.collection_of(type(v), self.collections)): v.get_value()
            for path, v in nnx.to_flat_state(state)
        }

    def sown_paths(self, sown: Any) -> dict[str, Any]:
        flat = {}
        for path, v in nnx.to_flat_state(sown):
            where = self._linen_key(path, convert.collection_of(type(v), self.sown_collections))
            flat.update(flat_paths(v.get_value(), (where,)))
        return flat

    def opaque(self, capture: str) -> bool:
        """Inside a Linen layer (`bridge.ToNNX`): NNX captures only its output."""
        return order.inside(capture, self.bridged)

    def captures(self, captured: Any) -> dict[str, Any]:
        """Captured outputs by Linen module path (`renames` applied)."""
        return {
            "/".join(to_linen_path(tuple(name.split("/")), self.renames)): value
            for name, value in captures(nnx.to_pure_dict(captured)).items()
        }

    def grads_common(self, grads: Any) -> dict[str, Any]:
        if self.conversion is not None:
            target = self.linen_target()
            return unboxed_grads(
                conversion.grads_to_linen(self.conversion, grads, self.template, target)
            )
        return unboxed_grads(convert.nnx_to_linen(grads, renames=self.renames)["params"])

    def param_label(self, path: tuple) -> str:
        keys = module_keys(path)
        return "/".join(to_linen_path(keys, self.renames))

    def state_label(self, path: tuple) -> str | None:
        keys = module_keys(path)
        collection = self.state_collections.get(keys)
        return None if collection is None else f"state {self._linen_key(path, collection)}"
