"""`compare_modules`' arguments, checked before anything is traced: one `PairArgumentError`
per mistake, saying what was passed and what is expected.

`PairArgumentError` is `BadInput` (exit status 2 wherever the project's exit-code contract
applies) and a `ValueError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from jax.sharding import Mesh

from migrate.checkpoints import convert
from migrate.errors import BadInput
from parity.analysis import compare
from parity.module_pair.calls import Call, Randomness, is_array
from parity.module_pair.conversion import Conversion

# Keyword arguments `Module.apply` takes itself: a Linen call cannot pass them to the module.
LINEN_APPLY_KEYWORDS = frozenset({"rngs", "method", "mutable", "capture_intermediates"})


class PairArgumentError(BadInput, ValueError):
    """An argument of `compare_modules` that does not fit: what was passed, what is expected."""


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, type) else f"the class {value.__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def modules(linen_module: Any, nnx_module: Any) -> None:
    """An unbound Linen module instance first, a constructed NNX module second."""
    if isinstance(linen_module, nnx.Module) and isinstance(nnx_module, nn.Module):
        raise PairArgumentError(
            "the modules are swapped: pass the Linen module first and the NNX module second "
            "(compare_modules(linen_module, nnx_module, inputs))"
        )
    for label, module, base, hint in (
        ("linen_module", linen_module, nn.Module, "e.g. nn.Dense(16)"),
        ("nnx_module", nnx_module, nnx.Module, "e.g. nnx.Linear(4, 16, rngs=nnx.Rngs(0))"),
    ):
        if isinstance(module, type) and issubclass(module, base):
            raise PairArgumentError(
                f"{label} is {_shown(module)}, not an instance: construct it ({hint})"
            )
        if not isinstance(module, base):
            other = nnx.Module if base is nn.Module else nn.Module
            kind = "an NNX" if isinstance(module, other) else f"a {type(module).__name__}"
            expected = (
                "a Linen module (flax.linen.Module)"
                if base is nn.Module
                else ("a constructed NNX module (flax.nnx.Module)")
            )
            raise PairArgumentError(f"{label} is {kind} object; expected {expected}")
    if linen_module.scope is not None:
        raise PairArgumentError(
            "linen_module is bound to variables; pass the unbound module "
            "(`module.clone()` or the module before `bind`)"
        )


def _leaves_are_arrays(where: str, tree: Any) -> None:
    def is_number_list(node: Any) -> bool:
        return isinstance(node, list) and all(isinstance(v, (int, float)) for v in node)

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_number_list)[0]:
        if is_number_list(leaf):
            at = compare.path_str(path)
            raise PairArgumentError(
                f"{where}{'/' + at if at else ''} is a list of numbers; pass an array "
                "(jnp.asarray(...))"
            )
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_array(leaf) or isinstance(leaf, (bool, int, float, complex, str)):
            continue
        at = compare.path_str(path)
        raise PairArgumentError(
            f"{where}{'/' + at if at else ''} is {_shown(leaf)}; inputs must be arrays "
            "(jax or numpy) or Python scalars"
        )


def _mapping(where: str, value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise PairArgumentError(f"{where} is {_shown(value)}; expected a dict of str -> value")


def call(item: Any, where: str) -> Call:
    """One `Call`, its fields checked."""
    if not isinstance(item, Call):
        raise PairArgumentError(f"{where} is {_shown(item)}; expected parity.pairs.Call")
    if not isinstance(item.args, (tuple, list)):
        raise PairArgumentError(
            f"{where}.args is {_shown(item.args)}; expected a tuple of positional arguments"
        )
    for field in ("kwargs", "linen", "nnx", "nnx_attributes"):
        _mapping(f"{where}.{field}", getattr(item, field))
    _leaves_are_arrays(f"{where}.args", tuple(item.args))
    for field in ("kwargs", "linen", "nnx"):
        _leaves_are_arrays(f"{where}.{field}", dict(getattr(item, field)))
    for side in ("linen", "nnx"):
        both = sorted(set(item.kwargs) & set(getattr(item, side)))
        if both:
            raise PairArgumentError(
                f"{where}: {both} given both in kwargs and in {side}; give each once"
            )
    clash = sorted(set(item.side_kwargs("linen")) & LINEN_APPLY_KEYWORDS)
    if clash:
        raise PairArgumentError(
            f"{where}: {clash} are Module.apply's own keywords; Linen cannot pass them to the "
            "module (randomness goes through Call.randomness)"
        )
    if item.method is not None and not isinstance(item.method, str):
        raise PairArgumentError(f"{where}.method is {_shown(item.method)}; expected a name")
    if item.randomness is not None:
        randomness(item.randomness, f"{where}.randomness", item)
    if not isinstance(item.name, str):
        raise PairArgumentError(f"{where}.name is {_shown(item.name)}; expected a str")
    return item


def randomness(value: Any, where: str, item: Call) -> None:
    if not isinstance(value, Randomness):
        raise PairArgumentError(f"{where} is {_shown(value)}; expected parity.pairs.Randomness")
    streams = value.linen_streams
    if not isinstance(streams, tuple) or not all(isinstance(s, str) for s in streams):
        raise PairArgumentError(
            f"{where}.linen_streams is {_shown(streams)}; expected a tuple of stream names"
        )
    for field, side in (("linen_arg", "linen"), ("nnx_arg", "nnx")):
        name = getattr(value, field)
        if name is not None and (not isinstance(name, str) or name in item.side_kwargs(side)):
            raise PairArgumentError(
                f"{where}.{field} is {_shown(name)}; expected the name of a keyword argument "
                "the call does not already pass"
            )
    if value.nnx_arg_as not in ("key", "rngs"):
        raise PairArgumentError(
            f"{where}.nnx_arg_as is {_shown(value.nnx_arg_as)}; expected 'key' (a raw key) or "
            "'rngs' (an nnx.Rngs)"
        )
    if value.nnx_arg_as == "rngs" and value.nnx_arg is None:
        raise PairArgumentError(
            f"{where}.nnx_arg_as is 'rngs' but nnx_arg is None; name the keyword argument the "
            "NNX module takes its nnx.Rngs in (nnx_arg='rngs')"
        )
    if not isinstance(value.draws, int) or value.draws < 8:
        raise PairArgumentError(f"{where}.draws is {_shown(value.draws)}; expected an int >= 8")


def calls(inputs: Any) -> tuple[Call, ...]:
    """`inputs` as calls: an array (one positional argument), a tuple or list of positional
    arguments, a `Call`, or a list of `Call`s."""
    if isinstance(inputs, Call):
        return (call(inputs, "inputs"),)
    if isinstance(inputs, Mapping):
        raise PairArgumentError(
            f"inputs is a {type(inputs).__name__}; pass positional arguments as a tuple, and "
            "keyword arguments with Call: inputs=Call((x,), {'mask': mask})"
        )
    if is_array(inputs):
        return (Call((inputs,)),)
    if isinstance(inputs, (tuple, list)):
        if inputs and all(isinstance(c, Call) for c in inputs):
            out = tuple(call(c, f"inputs[{i}]") for i, c in enumerate(inputs))
            names = [c.name for c in out if c.name]
            if len(names) != len(set(names)):
                raise PairArgumentError(f"call names repeat: {names}; give each call its own")
            return out
        if any(isinstance(c, Call) for c in inputs):
            raise PairArgumentError(
                "inputs mixes Call objects and arrays; give a list of Call, or positional arrays"
            )
        if not inputs:
            raise PairArgumentError("inputs is empty; give the module's positional arguments")
        return (call(Call(tuple(inputs)), "inputs"),)
    raise PairArgumentError(
        f"inputs is {_shown(inputs)}; expected an array, a tuple of positional arguments, a "
        "Call or a list of Call"
    )


def renames(value: Any) -> dict[tuple[str, ...], tuple[str, ...]]:
    if value is None:
        return {}
    example = "{('Dense_0',): ('up',)}"
    if not isinstance(value, Mapping):
        raise PairArgumentError(
            f"renames is {_shown(value)}; expected a dict of Linen path tuple -> NNX path "
            f"tuple, e.g. {example}"
        )
    for linen, nnx_path in value.items():
        for label, path in (("key", linen), ("value", nnx_path)):
            if not (isinstance(path, tuple) and path and all(isinstance(p, str) for p in path)):
                raise PairArgumentError(
                    f"renames {label} {_shown(path)} is not a tuple of names; write each path "
                    f"as a tuple, e.g. {example}"
                )
    checked = {tuple(k): tuple(v) for k, v in value.items()}
    sources: dict[tuple[str, ...], tuple[str, ...]] = {}
    for linen, nnx_path in checked.items():
        first = sources.setdefault(nnx_path, linen)
        if first != linen:
            raise PairArgumentError(
                f"renames maps both {first!r} and {linen!r} to {nnx_path!r}; the NNX path "
                "would have two Linen names: give each Linen prefix its own NNX prefix"
            )
    return checked


def collections(value: Any, defaults: Mapping[str, type]) -> dict[str, type]:
    """The defaults updated by `value` (Linen collection -> NNX Variable type)."""
    if value is None:
        return dict(defaults)
    _mapping("collections", value)
    for name, variable_type in value.items():
        if not (isinstance(variable_type, type) and issubclass(variable_type, nnx.Variable)):
            raise PairArgumentError(
                f"collections[{name!r}] is {_shown(variable_type)}; expected an nnx.Variable "
                "subclass, e.g. {'batch_stats': nnx.BatchStat}"
            )
    merged = {**defaults, **value}
    if merged.get("params") is not nnx.Param:
        raise PairArgumentError("collections['params'] must stay nnx.Param")
    _one_collection_per_type(merged, defaults)
    return merged


def _type_name(variable_type: type) -> str:
    flax_own = variable_type.__module__.startswith("flax.nnx")
    return f"nnx.{variable_type.__name__}" if flax_own else variable_type.__name__


def _one_collection_per_type(merged: Mapping[str, type], defaults: Mapping[str, type]) -> None:
    """Each NNX Variable type stands for one Linen collection: a type named twice would be
    read as the first collection only (`convert.collection_of`), the other left empty."""
    owner: dict[type, str] = {}
    for name, variable_type in merged.items():
        first = owner.setdefault(variable_type, name)
        if first == name:
            continue
        shown = _type_name(variable_type)
        fix = f"give {name!r} its own subclass of {shown}"
        if first in defaults and first != "params":
            fix = (
                f"override the default instead (collections={{{first!r}: <another Variable "
                f"type>, {name!r}: {shown}}}) or {fix}"
            )
            first = f"the default {first!r}"
        else:
            first = repr(first)
        raise PairArgumentError(
            f"collections maps both {first} and {name!r} to {shown}; one NNX Variable type "
            f"stands for one Linen collection: {fix}"
        )


def unmapped_state(nnx_module: nnx.Module, mapped: Mapping[str, type]) -> None:
    """Every NNX Variable of the module is RNG state or has a Linen collection."""
    unknown = sorted(
        {
            type(v).__name__
            for _, v in nnx.to_flat_state(nnx.state(nnx_module))
            if not isinstance(v, convert.NNX_ONLY_STATE)
            and convert.collection_of(type(v), mapped) is None
        }
    )
    if unknown:
        raise PairArgumentError(
            f"the NNX module holds {', '.join(unknown)} variables that no Linen collection maps "
            f"to; name their collection: collections={{'<collection>': {unknown[0]}}}"
        )


def boxed_values(nnx_module: nnx.Module) -> None:
    """No NNX Variable holds a Linen box (`LogicallyPartitioned`, `Partitioned`): an
    initializer wrapped by `nn.with_logical_partitioning` returns one, and the Variable then
    holds no array for any check to read."""
    boxed = [
        ("/".join(map(str, path)), type(v.get_value()).__name__)
        for path, v in nnx.to_flat_state(nnx.state(nnx_module))
        if isinstance(v.get_value(), meta.AxisMetadata)
    ]
    if boxed:
        path, box = boxed[0]
        raise PairArgumentError(
            f"the NNX module's variable {path} holds a Linen {box} box, not an array; build "
            "it from the bare initializer, the names as metadata: "
            "nnx.Param(init(rngs.params(), shape), out_sharding=names)"
        )


def on_mesh(nnx_module: nnx.Module, mesh: Mesh | None) -> None:
    """With a mesh, every array of the NNX module lives on that mesh's devices: one built
    outside `jax.set_mesh(mesh)` sits on one device, and every placement would differ from
    Linen's (which `init` places on the mesh) for a reason that is no migration's."""
    if mesh is None:
        return
    devices = set(mesh.devices.flat)
    elsewhere = [
        (path, v.get_value())
        for path, v in nnx.to_flat_state(nnx.state(nnx_module))
        if not isinstance(v, convert.NNX_ONLY_STATE)
        and isinstance(v.get_value(), jax.Array)
        and set(v.get_value().sharding.device_set) != devices
    ]
    if not elsewhere:
        return
    path, value = elsewhere[0]
    where = "/".join(str(k) for k in path)
    raise PairArgumentError(
        f"mesh is given, but {len(elsewhere)} array(s) of the NNX module are not on it "
        f"(e.g. {where} on {len(value.sharding.device_set)} device(s), the mesh has "
        f"{len(devices)}): it was built outside the mesh; build it under `with "
        "jax.set_mesh(mesh), nnx.logical_axis_rules(rules):`, or create its arrays placed "
        "(docs/migration-guide.md: create_placed)"
    )


def sized_for_inputs(
    linen_shapes: Mapping[tuple[str, ...], tuple[int, ...]],
    nnx_shapes: Mapping[tuple[str, ...], tuple[int, ...]],
    inputs: Sequence[Any],
) -> None:
    """The NNX module was built for the sizes of the inputs given. Linen sizes its layers from
    the first call's inputs; an NNX module is sized at construction: when every variable is
    on both sides and each shape that differs differs where Linen's size is an input's size
    (a kernel's input axis), the inputs are not what the NNX module was built for: bad input,
    not a migration bug."""
    if set(linen_shapes) != set(nnx_shapes):
        return
    input_sizes = {size for array in inputs for size in getattr(array, "shape", ())[1:]}
    differing = [
        (path, linen_shapes[path], nnx_shapes[path])
        for path in linen_shapes
        if linen_shapes[path] != nnx_shapes[path]
    ]
    if not differing or not input_sizes:
        return
    for _, linen_shape, nnx_shape in differing:
        if len(linen_shape) != len(nnx_shape) or any(
            a != b and a not in input_sizes for a, b in zip(linen_shape, nnx_shape, strict=True)
        ):
            return
    # An input size is read on a kernel's input axis, never its last (the output features a
    # port may have wrong whatever the inputs).
    if not any(
        a != b
        for _, linen_shape, nnx_shape in differing
        for a, b in zip(linen_shape[:-1], nnx_shape[:-1], strict=True)
    ):
        return
    path, linen_shape, nnx_shape = differing[0]
    shapes = ", ".join(str(tuple(getattr(a, "shape", ()))) for a in inputs)
    raise PairArgumentError(
        f"the inputs do not fit the NNX module as built: Linen sized {'/'.join(path[1:])} "
        f"{linen_shape} from them (inputs {shapes}), the NNX module holds {nnx_shape}: build "
        "the NNX module for these inputs, or pass inputs of the sizes it was built for"
    )


def fit(linen_module: nn.Module, nnx_module: nnx.Module, calls: Sequence[Call]) -> None:
    """Each call's method exists on both modules, and each NNX mode attribute on some
    submodule of the NNX module (`Module.set_attributes` would refuse it mid-trace)."""
    submodules = [m for _, m in nnx.iter_graph(nnx_module) if isinstance(m, nnx.Module)]
    for item in calls:
        for label, module in (("linen_module", linen_module), ("nnx_module", nnx_module)):
            if item.method is not None and not callable(getattr(module, item.method, None)):
                raise PairArgumentError(
                    f"call {item.name!r}: {label} ({type(module).__name__}) has no method "
                    f"{item.method!r}"
                )
        for name in item.nnx_attributes:
            if not any(hasattr(m, name) for m in submodules):
                raise PairArgumentError(
                    f"call {item.name!r}: nnx_attributes {name!r} is an attribute of no module "
                    f"in {type(nnx_module).__name__}; mode flags are e.g. 'deterministic', "
                    "'use_running_average'"
                )


def tolerance(value: Any) -> compare.Tolerance:
    """A Tolerance as given; a number is a relative tolerance; `(max_rel, max_abs)` adds an
    absolute one. Negative or non-finite bounds are refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = compare.Tolerance(float(value), f"given: max_rel {value:g}")
    elif (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        rel, abs_ = (float(v) for v in value)
        value = compare.Tolerance(rel, f"given: max_rel {rel:g} or max_abs {abs_:g}", abs_)
    if isinstance(value, compare.Tolerance):
        bounds = (value.max_rel, value.max_abs)
        if not all(isinstance(b, (int, float)) and math.isfinite(b) and b >= 0 for b in bounds):
            raise PairArgumentError(
                f"tolerance has max_rel={value.max_rel!r}, max_abs={value.max_abs!r}; expected "
                "finite numbers >= 0"
            )
        return value
    hint = f"parity.analysis.compare.Tolerance({value!r}, 'why the pair differs')"
    raise PairArgumentError(
        f"tolerance is {_shown(value)}; expected a number (max_rel), a (max_rel, max_abs) "
        f"pair, or a parity.analysis.compare.Tolerance, e.g. {hint}"
    )


def conversion(value: Any) -> Conversion | None:
    if value is None or isinstance(value, Conversion):
        if value is not None:
            for name in ("to_nnx", "to_linen"):
                if not callable(getattr(value, name)):
                    raise PairArgumentError(
                        f"conversion.{name} is {_shown(getattr(value, name))}; expected a "
                        "function of a plain nested dict of arrays"
                    )
        return value
    raise PairArgumentError(
        f"conversion is {_shown(value)}; expected parity.pairs.Conversion(to_nnx=..., "
        "to_linen=...), two functions between Linen's variables and the NNX state"
    )


def checks(value: Any, available: Iterable[str]) -> tuple[str, ...]:
    known = list(available)
    if isinstance(value, str) or not isinstance(value, (Sequence, set, frozenset)):
        raise PairArgumentError(
            f"checks is {_shown(value)}; expected a list of names, e.g. ['forward', 'grads']"
        )
    unknown = [c for c in value if c not in known]
    if unknown:
        raise PairArgumentError(f"unknown check(s) {unknown}; known: {', '.join(known)}")
    return tuple(value)


def options(
    linen_variables: Any, rules: Any, mesh: Any, loss_fn: Any, seed: Any, optimizer: Any
) -> None:
    if linen_variables is not None and not isinstance(linen_variables, Mapping):
        raise PairArgumentError(
            f"linen_variables is {_shown(linen_variables)}; expected Linen variables, a dict "
            "such as {'params': ...}"
        )
    if mesh is not None and not isinstance(mesh, Mesh):
        raise PairArgumentError(f"mesh is {_shown(mesh)}; expected a jax.sharding.Mesh")
    if mesh is not None and rules is None:
        raise PairArgumentError(
            "a mesh needs rules: logical names reach mesh axes only through rules"
        )
    if rules is not None and not (
        isinstance(rules, (tuple, list))
        and all(isinstance(r, (tuple, list)) and len(r) == 2 for r in rules)
    ):
        raise PairArgumentError(
            f"rules is {_shown(rules)}; expected logical axis rules, pairs of "
            "(logical name, mesh axis or None)"
        )
    if not callable(loss_fn):
        raise PairArgumentError(f"loss_fn is {_shown(loss_fn)}; expected outputs -> scalar")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PairArgumentError(f"seed is {_shown(seed)}; expected an int")
    if optimizer is not None and not all(hasattr(optimizer, a) for a in ("init", "update")):
        raise PairArgumentError(
            f"optimizer is {_shown(optimizer)}; expected an optax.GradientTransformation"
        )
