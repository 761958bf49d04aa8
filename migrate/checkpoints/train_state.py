"""The train state of either twin as a checkpoint sees it: what a checkpoint holds (`Spec`), the
twin's objects (`TrainState`), their on-disk (pure) form, per-array descriptions, and abstract
and fresh states placed on a mesh.

Linen trees hold `LogicallyPartitioned` boxes, NNX trees `nnx.Variable`s and `nnx.State`s; the
helpers here read and rebuild both, so that `migrate.checkpoints.checkpoint_io` (the on-disk
format) and `migrate.checkpoints.restage` (conversion between frameworks and layouts) never branch
on the wrapper.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from migrate.checkpoints import convert
from migrate.checkpoints.meta import (
    FRAMEWORKS,
    LAYOUT_KEYS,
    LAYOUTS,
    REFERENCE_KEYS,
    CheckpointError,
)
from migrate.common import optim, sharding
from migrate.config.contract import Config, ConfigError
from migrate.config.loading import SCHEDULE_DEFAULTS, with_changes
from migrate.linen import decoder as linen_decoder
from migrate.nnx import decoder as nnx_decoder

MAX_LISTED = 5  # mismatching paths named in one error

Path_ = tuple[str, ...]
Names = tuple[str | None, ...] | None


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a checkpoint holds: which twin's trees, in which layout, for which config."""

    framework: str
    layout: str
    cfg: Config

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise CheckpointError(
                f"framework {self.framework!r}: must be one of {', '.join(FRAMEWORKS)}"
            )
        if self.layout not in LAYOUTS:
            raise CheckpointError(f"layout {self.layout!r}: must be one of {', '.join(LAYOUTS)}")
        if self.layout == "pipeline" and not self.cfg.using_pipeline:
            raise CheckpointError(
                f"layout 'pipeline' needs a config that pipelines, but S={self.cfg.num_stages} "
                "(ici_pipeline_parallelism x dcn_pipeline_parallelism); use layout 'reference'"
            )

    @property
    def use_pipeline(self) -> bool:
        return self.layout == "pipeline"

    def describe(self) -> str:
        """`nnx, pipeline S=4 R=2 L=1` or `linen, reference N=8`."""
        c = self.cfg
        if self.layout == "reference":
            return f"{self.framework}, reference N={c.base_num_decoder_layers}"
        scanned = " scanned" if c.scan_layers_per_stage else ""
        after = f" +{c.num_layers_after_pipeline} after" if c.num_layers_after_pipeline else ""
        return (
            f"{self.framework}, pipeline S={c.num_stages} R={c.num_repeats} "
            f"L={c.layers_per_stage}{scanned}{after}"
        )


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a checkpoint restores to, as the twin's own objects.

    Linen: `params` is `{'params': ...}` of `LogicallyPartitioned` boxes and the optimizer
    moments are boxed the same way. NNX: `params` is the Param `nnx.State` and the moments are
    States of Params. Either way `opt_state` is `optim.make_optimizer(cfg).init(...)`'s tree.
    """

    params: Any
    opt_state: Any
    step: int


# ------------------------------------------------------------------ configs


def layout_keys(cfg: Config) -> dict[str, Any]:
    """The config's values of `LAYOUT_KEYS`."""
    return {k: getattr(cfg, k) for k in LAYOUT_KEYS}


def reference_config(cfg: Config) -> Config:
    """`cfg` without a pipeline (S=1): the decoder runs its layers as the reference does."""
    return with_changes(cfg, REFERENCE_KEYS)


def plan(
    meta: Mapping[str, Any],
    cfg: Config,
    source: str,
    target: str,
    layout: str | None = None,
    changes: Mapping[str, Any] = {},
    dtype: str | None = None,
) -> tuple[Spec, Spec]:
    """(source spec, target spec) of a conversion.

    The source keeps the checkpoint's recorded layout keys; the target takes them and then
    `changes` (for example `ici_pipeline_parallelism=2 num_pipeline_repeats=4`). Non-layout keys
    in `changes` apply to both sides. With `dtype` the source is read in its stored dtype and the
    target cast to `dtype`.
    """
    model = {k: v for k, v in changes.items() if k not in LAYOUT_KEYS}
    recorded = dict(meta["layout_keys"])
    src_dtype = {"weight_dtype": meta["weight_dtype"]} if dtype else {}
    tgt_dtype = {"weight_dtype": dtype} if dtype else {}
    try:
        src_cfg = with_changes(cfg, {**model, **recorded, **src_dtype})
        tgt_cfg = with_changes(cfg, {**model, **recorded, **changes, **tgt_dtype})
    except ConfigError as e:
        raise CheckpointError(f"the layout asked for is invalid: {e}") from None
    return (
        Spec(source, meta["layout"], src_cfg),
        Spec(target, layout or meta["layout"], tgt_cfg),
    )


# ------------------------------------------------------------------ wrapped leaves


def is_box(x: Any) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def is_wrapped(x: Any) -> bool:
    return isinstance(x, (nn.LogicallyPartitioned, nnx.Variable))


def names_of(x: Any) -> Names:
    if is_box(x):
        return tuple(x.names)
    if isinstance(x, nnx.Variable):
        return convert.nnx_names(x)
    return None


def value_of(x: Any) -> Any:
    if is_box(x):
        return x.value
    if isinstance(x, nnx.Variable):
        return x.get_value()
    return x


def rewrap(x: Any, value: Any) -> Any:
    if is_box(x):
        return x.replace_boxed(value)
    if isinstance(x, nnx.Variable):
        return x.replace(value)
    return value


def keystr(path: tuple) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key))
    return "/".join(parts)


def to_pure(tree: Any) -> Any:
    """The on-disk form: boxes and Variables -> their arrays, NNX States -> nested dicts."""

    def one(x):
        if isinstance(x, nnx.State):
            return nnx.to_pure_dict(x)
        return value_of(x)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.State) or is_wrapped(x))


def _state_from_pure(template: nnx.State, pure: Mapping[str, Any]) -> nnx.State:
    flat = convert.flatten_dict(pure)
    with nnx.use_eager_sharding(False):
        return nnx.from_flat_state(
            {
                path: var.replace(flat[tuple(str(k) for k in path)])
                for path, var in nnx.to_flat_state(template)
            }
        )


def from_pure(template: Any, pure: Any) -> Any:
    """Inverse of `to_pure`: `template`'s boxes, Variables and States around `pure`'s arrays."""

    def one(t, p):
        if isinstance(t, nnx.State):
            return _state_from_pure(t, p)
        return rewrap(t, p)

    is_leaf = lambda x: isinstance(x, nnx.State) or is_wrapped(x)
    return jax.tree.map(one, template, pure, is_leaf=is_leaf)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array as a checkpoint records it."""

    shape: tuple[int, ...]
    dtype: str
    names: Names

    def text(self) -> str:
        return f"{self.shape} {self.dtype}"


def describe(tree: Any) -> dict[str, Leaf]:
    """Key ('a/b/kernel', as Orbax nests it) -> shape, dtype, logical names, for every array."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_wrapped)
    out = {}
    for path, x in flat:
        value = value_of(x)
        out[keystr(path)] = Leaf(tuple(value.shape), str(np.dtype(value.dtype)), names_of(x))
    return out


def mismatches(where: str, expected: Mapping[str, Leaf], actual: Mapping[str, Leaf]) -> list:
    """Missing, extra and differently shaped keys, in path order."""
    problems = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            problems.append(f"{where}/{key}: missing (config expects {expected[key].text()})")
        elif key not in expected:
            problems.append(f"{where}/{key}: {actual[key].text()}, not in the config's model")
        elif expected[key].shape != actual[key].shape:
            problems.append(
                f"{where}/{key}: checkpoint {actual[key].text()}, config expects "
                f"{expected[key].text()}"
            )
    return problems


def listing(problems: list[str]) -> str:
    shown = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED])
    more = len(problems) - MAX_LISTED
    return shown + (f"\n  ... and {more} more" if more > 0 else "")


# ------------------------------------------------------------------ templates


def _nnx_mode() -> tuple[bool, bool]:
    return nnx.set_graph_mode.current_value(), nnx.set_graph_updates.current_value()


@functools.cache
def _abstract_linen(cfg: Config, mesh: Mesh, use_pipeline: bool) -> dict:
    model = linen_decoder.Decoder(cfg, mesh, use_pipeline=use_pipeline)
    tokens = jax.ShapeDtypeStruct((cfg.global_batch_size, cfg.max_target_length), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)  # key traced too


@functools.cache
def _abstract_nnx(cfg: Config, mesh: Mesh, use_pipeline: bool, mode: tuple) -> nnx.State:
    del mode  # part of the cache key only
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(
            lambda: nnx_decoder.Decoder(cfg, mesh, use_pipeline, rngs=nnx.Rngs(0))
        )
        return nnx.from_flat_state(convert.nnx_flat_params(nnx.state(model)))


def leaf_sharding(names: Names, shape: tuple[int, ...], mesh: Mesh, cfg: Config) -> NamedSharding:
    """The sharding `names` resolve to on `mesh`; a dim its mesh axes do not divide is replicated
    (a re-staged source, S=4 restored onto an S=2 mesh, still lands sharded where it can)."""
    return sharding.fitted_sharding(names, shape, mesh, cfg.logical_axis_rules)


def _place_abstract(tree: Any, mesh: Mesh, cfg: Config) -> Any:
    def one(x):
        value = value_of(x)
        target = leaf_sharding(names_of(x), tuple(value.shape), mesh, cfg)
        return rewrap(x, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=target))

    return jax.tree.map(one, tree, is_leaf=is_wrapped)


def _optimizer_input(spec: Spec, params: Any) -> Any:
    return params["params"] if spec.framework == "linen" else params


def abstract_state(spec: Spec, mesh: Mesh) -> TrainState:
    """The twin's params and optimizer state as `ShapeDtypeStruct`s, each carrying the sharding
    its logical names resolve to on `mesh` (the restore target)."""
    # Weights do not depend on the schedule or the name: configs that differ only there share
    # one traced template.
    cfg = with_changes(spec.cfg, {**SCHEDULE_DEFAULTS, "model_name": "weights", "seed": 0})
    if spec.framework == "linen":
        params = _abstract_linen(cfg, mesh, spec.use_pipeline)
    else:
        params = _abstract_nnx(cfg, mesh, spec.use_pipeline, _nnx_mode())
    opt_state = jax.eval_shape(optim.make_optimizer(cfg).init, _optimizer_input(spec, params))
    return TrainState(_place_abstract(params, mesh, cfg), _place_abstract(opt_state, mesh, cfg), 0)


def init_state(spec: Spec, mesh: Mesh) -> TrainState:
    """Freshly initialised weights (the twin's own init, placed on `mesh`), the optimizer's
    initial state, step 0."""
    if spec.framework == "linen":
        params = linen_decoder.init_model(spec.cfg, mesh, use_pipeline=spec.use_pipeline)
    else:
        model = nnx_decoder.init_model(spec.cfg, mesh, use_pipeline=spec.use_pipeline)
        with nnx.use_eager_sharding(False):
            params = nnx.from_flat_state(convert.nnx_flat_params(nnx.state(model, nnx.Param)))
    opt_state = optim.make_optimizer(spec.cfg).init(_optimizer_input(spec, params))
    return TrainState(params, opt_state, 0)
