"""Orbax checkpoints of either twin, and their migration between frameworks and layouts.

A checkpoint is one Orbax composite directory with three items:

    DIR/params     PyTreeSave: the parameters as plain arrays (Linen: the `{'params': ...}`
                   tree with its `LogicallyPartitioned` boxes stripped; NNX: the Param state as
                   a pure dict)
    DIR/opt_state  PyTreeSave: the state of `migrate.optim.make_optimizer(cfg)`, its moments
                   stripped the same way (Linen boxes or NNX States -> nested dicts)
    DIR/meta       JsonSave: format, framework, layout, step, the config keys that define the
                   layout, the model's shape keys, and per array its logical names, shape, dtype
                   and CRC32 (so boxes and Variables can be rebuilt, and corruption is caught)

That is also what an Orbax `CheckpointManager` with items `params`, `opt_state` and `meta` writes
under `ROOT/<step>/`, so such a step directory is a checkpoint here.

Restores land with the sharding of the mesh they are given (each leaf's logical names resolved
by `migrate.sharding`). Conversion changes framework by moving arrays (`migrate.convert`) and
changes layout leaf by leaf (`migrate.layout`, each new array built and its source dropped
before the next), so that peak memory stays near one copy of the checkpoint; it writes into a
staging directory that is moved into place only when complete (`migrate.destination`: what
`--force` may replace, signals, stale staging directories). `meta` is read and validated
without JAX by `migrate.meta`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from migrate import cli_support, convert, destination, optim, sharding
from migrate.config import SCHEDULE_DEFAULTS, Config, ConfigError, with_changes
from migrate.linen import decoder as linen_decoder
from migrate.meta import (
    ARRAY_ITEMS,
    FORMAT,
    FRAMEWORKS,
    LAYOUT_KEYS,
    LAYOUTS,
    MODEL_KEYS,
    REFERENCE_KEYS,
    VERSION,
    CheckpointError,
    read_meta,
)
from migrate.nnx import decoder as nnx_decoder

MAX_LISTED = 5  # mismatching paths named in one error
# OCDBT data files are written when they reach this size: the default buffers a whole item in
# memory before writing it (measured: 0.7x the checkpoint's bytes; 64 MiB files: 0.3x).
OCDBT_FILE_BYTES = 64 * 2**20

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
        return (
            f"{self.framework}, pipeline S={c.num_stages} R={c.num_repeats} "
            f"L={c.layers_per_stage}{scanned}"
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


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def _is_wrapped(x: Any) -> bool:
    return isinstance(x, (nn.LogicallyPartitioned, nnx.Variable))


def _names(x: Any) -> Names:
    if _is_box(x):
        return tuple(x.names)
    if isinstance(x, nnx.Variable):
        return convert.nnx_names(x)
    return None


def _value(x: Any) -> Any:
    if _is_box(x):
        return x.value
    if isinstance(x, nnx.Variable):
        return x.get_value()
    return x


def _rewrap(x: Any, value: Any) -> Any:
    if _is_box(x):
        return x.replace_boxed(value)
    if isinstance(x, nnx.Variable):
        return x.replace(value)
    return value


def _keystr(path: tuple) -> str:
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
        return _value(x)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.State) or _is_wrapped(x))


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
        return _rewrap(t, p)

    is_leaf = lambda x: isinstance(x, nnx.State) or _is_wrapped(x)
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
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_wrapped)
    out = {}
    for path, x in flat:
        value = _value(x)
        out[_keystr(path)] = Leaf(tuple(value.shape), str(np.dtype(value.dtype)), _names(x))
    return out


def _mismatches(where: str, expected: Mapping[str, Leaf], actual: Mapping[str, Leaf]) -> list:
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


def _listing(problems: list[str]) -> str:
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
    return jax.eval_shape(model.init, jax.random.key(0), tokens)


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
    spec = sharding.logical_to_spec(names, cfg.logical_axis_rules) if names else PartitionSpec()
    entries = []
    for dim, entry in zip(shape, (*spec, *(None,) * (len(shape) - len(spec))), strict=True):
        axes = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        entries.append(entry if dim % math.prod(mesh.shape[a] for a in axes) == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*entries))


def _place_abstract(tree: Any, mesh: Mesh, cfg: Config) -> Any:
    def one(x):
        value = _value(x)
        target = leaf_sharding(_names(x), tuple(value.shape), mesh, cfg)
        return _rewrap(x, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=target))

    return jax.tree.map(one, tree, is_leaf=_is_wrapped)


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
        cfg = spec.cfg
        model = linen_decoder.Decoder(cfg, mesh, use_pipeline=spec.use_pipeline)
        tokens = jnp.zeros((cfg.global_batch_size, cfg.max_target_length), jnp.int32)
        params = linen_decoder.init_variables(model, tokens)
    else:
        model = nnx_decoder.init_model(spec.cfg, mesh, use_pipeline=spec.use_pipeline)
        with nnx.use_eager_sharding(False):
            params = nnx.from_flat_state(convert.nnx_flat_params(nnx.state(model, nnx.Param)))
    opt_state = optim.make_optimizer(spec.cfg).init(_optimizer_input(spec, params))
    return TrainState(params, opt_state, 0)


# ------------------------------------------------------------------ reading and writing


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            params=ocp.PyTreeCheckpointHandler(),
            opt_state=ocp.PyTreeCheckpointHandler(),
            meta=ocp.JsonCheckpointHandler(),
        )
    )


def _first_line(error: BaseException) -> str:
    """The innermost cause of an Orbax or TensorStore error, on one line (it names the file)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    text = lines[0].split(" [tensorstore_spec=")[0] if lines else ""
    return f"{type(error).__name__}: {text[:400]}"


def host_copy(array: Any) -> np.ndarray:
    """A fresh host copy of one array, assembled from its shards: unlike `np.asarray`, it
    leaves no cached host copy on the jax.Array, so memory returns once the copy is dropped."""
    if not isinstance(array, jax.Array):
        return np.array(array)
    host = np.empty(array.shape, array.dtype)
    for shard in array.addressable_shards:
        if shard.replica_id == 0:
            host[shard.index] = np.asarray(shard.data)
    return host


def crc32(array: Any) -> int:
    """CRC32 of an array's bytes in C order, whatever its sharding (one leaf on the host at a
    time)."""
    return zlib.crc32(host_copy(array).reshape(-1).view(np.uint8))


def save_args(spec: Spec, state: TrainState) -> ocp.args.Composite:
    """Orbax args that write `state` as a checkpoint: for `save`, or for a training loop's own
    `ocp.CheckpointManager(..., item_names=('params', 'opt_state', 'meta'))`.

    Items are written with `PyTreeSave`, the format `StandardSave` also writes."""
    pure = {"params": to_pure(state.params), "opt_state": to_pure(state.opt_state)}
    arrays: dict[str, dict[str, Any]] = {}
    for item in ARRAY_ITEMS:
        leaves = describe(getattr(state, item))
        flat, _ = jax.tree_util.tree_flatten_with_path(pure[item])
        values = {_keystr(p): v for p, v in flat}
        assert values.keys() == leaves.keys(), f"{item}: on-disk keys differ from the tree's"
        for key, leaf in leaves.items():
            arrays[f"{item}/{key}"] = {
                "shape": list(leaf.shape),
                "dtype": leaf.dtype,
                "names": None if leaf.names is None else list(leaf.names),
                "crc32": crc32(values[key]),
            }
    cfg = spec.cfg
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "framework": spec.framework,
        "layout": spec.layout,
        "step": int(state.step),
        "layout_keys": layout_keys(cfg),
        "stages": {"S": cfg.num_stages, "R": cfg.num_repeats, "L": cfg.layers_per_stage},
        "model": {k: getattr(cfg, k) for k in MODEL_KEYS},
        "weight_dtype": cfg.weight_dtype,
        "model_name": cfg.model_name,
        "arrays": arrays,
    }
    return ocp.args.Composite(
        **{
            item: ocp.args.PyTreeSave(pure[item], ocdbt_target_data_file_size=OCDBT_FILE_BYTES)
            for item in ARRAY_ITEMS
        },
        meta=ocp.args.JsonSave(meta),
    )


def save(path: str | Path, spec: Spec, state: TrainState) -> None:
    """Write `state` as a new checkpoint at `path` (Orbax refuses an existing one)."""
    with _checkpointer() as ckpt:
        ckpt.save(Path(path), save_args(spec, state))


def _on_disk(path: Path) -> dict[str, dict[str, Leaf]]:
    try:
        with _checkpointer() as ckpt:
            metadata = ckpt.metadata(path).item_metadata
        out = {}
        for item in ARRAY_ITEMS:
            flat, _ = jax.tree_util.tree_flatten_with_path(metadata[item].tree)
            out[item] = {
                _keystr(p): Leaf(tuple(m.shape), str(np.dtype(m.dtype)), None) for p, m in flat
            }
        return out
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot read the arrays' metadata ({_first_line(e)}); the checkpoint is "
            "corrupt"
        ) from None


def check_fits(path: str | Path, spec: Spec, meta: Mapping[str, Any], mesh: Mesh) -> None:
    """Raise unless the checkpoint at `path` holds `spec`'s trees: framework, layout, every
    path with its shape (named, first few), logical names, and dtypes."""
    path = Path(path)
    if meta["framework"] != spec.framework or meta["layout"] != spec.layout:
        raise CheckpointError(
            f"{path}: holds {meta['framework']} trees in the {meta['layout']} layout, "
            f"expected {spec.framework} in the {spec.layout} layout"
        )
    template = abstract_state(spec, mesh)
    disk = _on_disk(path)
    problems, dtypes = [], []
    for item in ARRAY_ITEMS:
        expected = describe(getattr(template, item))
        problems += _mismatches(f"{path.name}/{item}", expected, disk[item])
        for key in sorted(set(expected) & set(disk[item])):
            recorded = meta["arrays"].get(f"{item}/{key}", {})
            names = recorded.get("names")
            names = None if names is None else tuple(names)
            if names != expected[key].names:
                problems.append(
                    f"{path.name}/{item}/{key}: logical names {names}, config's model has "
                    f"{expected[key].names}"
                )
            if disk[item][key].dtype != expected[key].dtype:
                dtypes.append((f"{item}/{key}", disk[item][key].dtype, expected[key].dtype))
    if problems:
        recorded = meta.get("model", {})
        differ = [
            f"{k}={recorded[k]} (config: {getattr(spec.cfg, k)})"
            for k in MODEL_KEYS
            if k in recorded and recorded[k] != getattr(spec.cfg, k)
        ]
        hint = f"\nthe checkpoint was written with {', '.join(differ)}" if differ else ""
        raise CheckpointError(
            f"{path}: the checkpoint does not match the config ({spec.describe()}): "
            f"{len(problems)} problem(s):\n{_listing(problems)}{hint}"
        )
    if dtypes:
        key, stored, wanted = dtypes[0]
        raise CheckpointError(
            f"{path}: {key} is stored as {stored} but the config's weight_dtype is {wanted} "
            f"({len(dtypes)} array(s) differ); converting would change the dtype: pass "
            f"--dtype={wanted} to cast, or weight_dtype={stored} to keep it"
        )


def restore(
    path: str | Path, spec: Spec, mesh: Mesh, meta: Mapping[str, Any] | None = None
) -> TrainState:
    """The checkpoint at `path` as `spec`'s twin objects, every array placed on `mesh` with the
    sharding its logical names resolve to, and checked against its recorded CRC32."""
    path = Path(path)
    meta = read_meta(path) if meta is None else meta
    check_fits(path, spec, meta, mesh)
    template = abstract_state(spec, mesh)
    targets = {item: to_pure(getattr(template, item)) for item in ARRAY_ITEMS}
    try:
        with _checkpointer() as ckpt:
            restored = ckpt.restore(
                path,
                ocp.args.Composite(
                    **{
                        item: ocp.args.PyTreeRestore(
                            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                        )
                        for item, target in targets.items()
                    }
                ),
            )
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot restore the arrays ({_first_line(e)}); the checkpoint is corrupt"
        ) from None
    for item in ARRAY_ITEMS:
        flat, _ = jax.tree_util.tree_flatten_with_path(restored[item])
        for p, value in flat:
            key = f"{item}/{_keystr(p)}"
            if crc32(value) != meta["arrays"].get(key, {}).get("crc32"):
                raise CheckpointError(
                    f"{path}: {key} does not match its recorded checksum; the checkpoint is corrupt"
                )
    return TrainState(
        from_pure(template.params, restored["params"]),
        from_pure(template.opt_state, restored["opt_state"]),
        int(meta["step"]),
    )


# ------------------------------------------------------------------ leaf-by-leaf conversion


@dataclasses.dataclass
class Weights:
    """A train state taken apart for leaf-by-leaf work, in Linen form.

    `trees` maps 'params' and the optimizer-state key of each moment ('1/0/mu', ...) to a flat
    `path -> LogicallyPartitioned` dict; `skeleton` is the optimizer state with each moment
    replaced by its key. Steps that convert leaves pop them from `trees`, so each source array
    is released once its converted twin exists.
    """

    trees: dict[str, dict[Path_, Any]]
    skeleton: Any
    step: int


def _is_moment_of(spec: Spec, params: Any) -> Callable[[Any], bool]:
    if spec.framework == "nnx":
        return lambda x: isinstance(x, nnx.State)
    structure = jax.tree.structure(params["params"], is_leaf=_is_box)
    return lambda x: isinstance(x, dict) and jax.tree.structure(x, is_leaf=_is_box) == structure


def take_apart(state: TrainState, spec: Spec) -> Weights:
    """`state` (either twin) -> Weights in Linen form; arrays are moved, never copied."""
    to_linen = (lambda t: t) if spec.framework == "linen" else convert.nnx_to_linen
    is_moment = _is_moment_of(spec, state.params)
    trees = {"params": convert.flatten_dict(to_linen(state.params)["params"])}

    def moment(path, x):
        if not is_moment(x):
            return x
        key = _keystr(path)
        tree = to_linen(x)["params"] if spec.framework == "nnx" else x
        trees[key] = convert.flatten_dict(tree)
        return key

    skeleton = jax.tree_util.tree_map_with_path(moment, state.opt_state, is_leaf=is_moment)
    return Weights(trees, skeleton, state.step)


def assemble(weights: Weights, spec: Spec, mesh: Mesh) -> TrainState:
    """Weights (Linen form, `spec`'s layout) -> `spec`'s twin objects, checked strictly against
    the model the config describes (paths, shapes, dtypes, logical names)."""
    template = abstract_state(spec, mesh)
    trees = {k: convert.unflatten_dict(v) for k, v in weights.trees.items()}
    if spec.framework == "linen":
        build = lambda tree: tree
    else:
        build = lambda tree: convert.linen_to_nnx({"params": tree}, template.params)
    params = {"params": trees["params"]} if spec.framework == "linen" else build(trees["params"])
    opt_state = jax.tree.map(
        lambda x: build(trees[x]) if isinstance(x, str) else x, weights.skeleton
    )
    state = TrainState(params, opt_state, weights.step)
    for item in ARRAY_ITEMS:
        expected, actual = describe(getattr(template, item)), describe(getattr(state, item))
        problems = _mismatches(item, expected, actual) + [
            f"{item}/{k}: {actual[k].dtype} names {actual[k].names}, expected "
            f"{expected[k].dtype} names {expected[k].names}"
            for k in sorted(set(expected) & set(actual))
            if (actual[k].dtype, actual[k].names) != (expected[k].dtype, expected[k].names)
        ]
        if problems:
            raise CheckpointError(
                f"converted trees do not fit {spec.describe()}:\n{_listing(problems)}"
            )
    return state


def same_layout(a: Spec, b: Spec) -> bool:
    """Whether weights of `a` and `b` have the same shapes and paths (no re-staging needed)."""
    if a.layout != b.layout:
        return False
    shape = lambda c: (c.num_stages, c.num_repeats, c.layers_per_stage, c.scan_layers_per_stage)
    return a.layout == "reference" or shape(a.cfg) == shape(b.cfg)


def _cast(tree: Any, dtype: str | None) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(lambda b: b.replace_boxed(b.value.astype(dtype)), tree, is_leaf=_is_box)


def _finisher(spec: Spec, mesh: Mesh, dtype: str | None) -> Callable[[Any], Any]:
    """Cast (elementwise: the sharding stays) and place one box that keeps its shape."""

    def finish(box):
        value = _cast(box, dtype).value
        target = leaf_sharding(tuple(box.names), tuple(value.shape), mesh, spec.cfg)
        return box.replace_boxed(jax.device_put(value, target))

    return finish


@functools.cache
def _mover(src: Spec, tgt: Spec, dtype: str | None) -> Callable[[Any], Any]:
    """Linen boxes of one layer weight in `src`'s layout -> in `tgt`'s, through the reference
    layout (`migrate.convert` and `migrate.layout`, names and arrays alike), cast to `dtype`."""

    def move(variables):
        if src.use_pipeline:
            variables = convert.linen_pipeline_to_reference(variables, src.cfg)
        if tgt.use_pipeline:
            variables = convert.linen_reference_to_pipeline(variables, tgt.cfg)
        return _cast(variables, dtype)

    return move


def _on_mesh(fn: Callable[[Any], Any], tree: Any, spec: Spec, mesh: Mesh) -> Any:
    """`fn(tree)` (boxes to boxes) under jit, each output landing with the sharding its names
    resolve to: eager reshapes would gather a stage-sharded weight onto every device."""
    abstract = jax.eval_shape(fn, tree)
    shardings = jax.tree.map(
        lambda b: leaf_sharding(tuple(b.names), tuple(b.value.shape), mesh, spec.cfg),
        abstract,
        is_leaf=_is_box,
    )
    return jax.jit(fn, out_shardings=shardings)(tree)


def _layer_path(path: Path_, spec: Spec) -> Path_ | None:
    """The path inside one layer of a stacked decoder-layer weight, or None for other weights."""
    if spec.use_pipeline and path[:2] == ("pipeline", "layers"):
        return path[3:]
    if not spec.use_pipeline and path[0] == "layers":
        return path[1:]
    return None


def _relayout_tree(
    flat: dict[Path_, Any], src: Spec, tgt: Spec, mesh: Mesh, dtype: str | None
) -> dict[Path_, Any]:
    """One weight tree (flat, Linen form) from `src`'s layout to `tgt`'s, one weight at a time;
    pops every entry of `flat`, so each source array is released once it has been moved."""
    finish = _finisher(tgt, mesh, dtype)
    restage = not same_layout(src, tgt)
    out: dict[Path_, Any] = {}
    groups: dict[Path_, list[Path_]] = {}  # one weight's path in a layer -> its stage slots
    for path in list(flat):
        inner = _layer_path(path, src) if restage else None
        if inner is None:
            out[path] = finish(flat.pop(path))
        else:
            groups.setdefault(inner, []).append(path)
    move = _mover(src, tgt, dtype)
    for inner, members in groups.items():
        # The weight sits under a fixed key, so that every weight of one shape and names (a
        # parameter and its moments) shares one compiled move.
        if src.use_pipeline:
            slots = {p[2]: {"w": flat.pop(p)} for p in members}
            variables = {"params": {"pipeline": {"layers": slots}}}
            del slots
        else:
            variables = {"params": {"layers": {"w": flat.pop(members[0])}}}
        moved = _on_mesh(move, variables, tgt, mesh)
        del variables
        for path, box in convert.flatten_dict(moved["params"]).items():
            out[(*path[:-1], *inner)] = box
    return out


def relayout(weights: Weights, src: Spec, tgt: Spec, mesh: Mesh, dtype: str | None = None) -> None:
    """Move every weight tree from `src`'s layout to `tgt`'s, cast to `dtype` if given, and place
    each new array with the sharding its names resolve to on `mesh`; in place, leaf by leaf."""
    for key in list(weights.trees):
        weights.trees[key] = _relayout_tree(weights.trees[key], src, tgt, mesh, dtype)


def convert_state(
    state: TrainState, src: Spec, tgt: Spec, mesh: Mesh, dtype: str | None = None
) -> TrainState:
    """`state` of `src` as `tgt`'s twin objects (framework, layout, dtype), on `mesh`, in memory.

    While the caller holds `state`, re-staged weights exist twice; `convert_checkpoint` instead
    takes the restored state apart at once, so each source array goes as its twin arrives.
    """
    weights = take_apart(state, src)
    relayout(weights, src, tgt, mesh, dtype)
    return assemble(weights, tgt, mesh)


# ------------------------------------------------------------------ comparison


def _flat_arrays(weights: Weights) -> dict[str, Any]:
    out = {}
    for key, tree in weights.trees.items():
        for path, box in tree.items():
            out[f"{key}:{'/'.join(path)}"] = box
    flat, _ = jax.tree_util.tree_flatten_with_path(weights.skeleton)
    for p, x in flat:
        if not isinstance(x, str):
            out[f"opt_state:{_keystr(p)}"] = x
    return out


def differences(a: Weights, b: Weights, limit: int = MAX_LISTED) -> list[str]:
    """Every way `a` and `b` differ, bit for bit: keys, names, dtypes, shapes, values, step."""
    problems = [] if a.step == b.step else [f"step: {a.step} vs {b.step}"]
    flat_a, flat_b = _flat_arrays(a), _flat_arrays(b)
    for key in sorted(set(flat_a) ^ set(flat_b)):
        problems.append(f"{key}: only on the {'source' if key in flat_a else 'destination'} side")
    for key in sorted(set(flat_a) & set(flat_b)):
        x, y = flat_a[key], flat_b[key]
        if _names(x) != _names(y):
            problems.append(f"{key}: logical names {_names(x)} vs {_names(y)}")
        x, y = host_copy(_value(x)), host_copy(_value(y))
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            problems.append(f"{key}: {x.shape} {x.dtype} vs {y.shape} {y.dtype}")
            continue
        differ = int(np.sum(x.reshape(-1).view(np.uint8) != y.reshape(-1).view(np.uint8)))
        if differ:
            problems.append(f"{key}: {differ} of {x.nbytes} bytes differ")
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] * (len(problems) > limit))


def compare_checkpoints(
    src: str | Path, src_spec: Spec, dst: str | Path, dst_spec: Spec, mesh: Mesh, dtype=None
) -> list[str]:
    """Restore both checkpoints and compare them bit for bit, as Linen trees in a common layout
    (the destination's, or the reference layout when re-staged); `dtype` casts the source side
    as the conversion did. Empty when equal. Holds both checkpoints in memory."""
    common = Spec(
        "linen", dst_spec.layout if same_layout(src_spec, dst_spec) else "reference", dst_spec.cfg
    )
    sides = []
    for path, spec, cast in ((src, src_spec, dtype), (dst, dst_spec, None)):
        weights = take_apart(restore(path, spec, mesh), spec)
        relayout(weights, spec, common, mesh, cast)
        sides.append(weights)
    return differences(*sides)


# ------------------------------------------------------------------ commands


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a command wrote (or, when a check failed, did not write)."""

    source: Spec | None
    target: Spec
    step: int
    arrays: int
    nbytes: int
    checks: tuple[str, ...] = ()  # checks run on the written checkpoint before it was moved
    differences: tuple[str, ...] = ()  # their findings; non-empty: nothing was written


Check = Callable[[Path, Spec], Sequence[str]]


def _sizes(state: TrainState) -> tuple[int, int]:
    leaves = jax.tree.leaves(to_pure((state.params, state.opt_state)))
    return len(leaves), sum(int(x.nbytes) for x in leaves)


def _check_and_publish(
    staging: Path, dst: Path, spec: Spec, force: bool, checks: Mapping[str, Check]
) -> tuple[str, ...]:
    """Run `checks` on the checkpoint saved in `staging` in order; publish it when none finds a
    problem, discard it otherwise. Returns the problems."""
    for check in checks.values():
        cli_support.raise_if_interrupted()
        found = tuple(check(destination.staged(staging), spec))
        if found:
            destination.discard(staging)
            return found
    destination.publish(staging, dst, force)
    return ()


def init_checkpoint(dst: str | Path, spec: Spec, force: bool = False) -> Outcome:
    """Write a freshly initialised checkpoint of `spec` at `dst` (staged, then moved)."""
    dst = Path(dst).absolute()
    destination.check_destination(None, dst, force)
    mesh = sharding.make_mesh(spec.cfg)
    staging = destination.stage(dst)
    try:
        state = init_state(spec, mesh)
        outcome = Outcome(None, spec, 0, *_sizes(state))
        cli_support.raise_if_interrupted()
        save(destination.staged(staging), spec, state)
        _check_and_publish(staging, dst, spec, force, {})
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return outcome


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    cfg: Config,
    source: str,
    target: str,
    layout: str | None = None,
    changes: Mapping[str, Any] = {},
    dtype: str | None = None,
    force: bool = False,
    verify: bool = False,
    checks: Mapping[str, Check] = {},
) -> Outcome:
    """Convert the checkpoint at `src` (framework `source`) into one at `dst` (framework
    `target`, layout `layout` or the source's, layout keys changed by `changes`, cast to `dtype`).

    Reads `src` only. Restores with the target mesh's sharding, converts leaf by leaf, writes
    into a staging directory and moves it to `dst` when complete and, with `verify`, equal bit
    for bit to the source (then `checks`, for example a forward pass); any error or failed check
    leaves `dst` as it was.
    """
    src, dst = Path(src).absolute(), Path(dst).absolute()
    destination.check_destination(src, dst, force)
    meta = read_meta(src)
    if meta["framework"] != source:
        raise CheckpointError(
            f"{src}: holds {meta['framework']} trees, not {source} (--from={source})"
        )
    src_spec, tgt_spec = plan(meta, cfg, source, target, layout, changes, dtype)
    mesh = sharding.make_mesh(tgt_spec.cfg)

    def bit_exact(staging: Path, spec: Spec) -> list[str]:
        return compare_checkpoints(src, src_spec, staging, spec, mesh, dtype)

    all_checks = {**({"bit-exact": bit_exact} if verify else {}), **checks}
    staging = destination.stage(dst)
    try:
        # Locals, not arguments, hold the trees: the restored state is gone once taken apart,
        # each source array once its converted twin exists, and the converted state once saved
        # (a caller's argument would pin them all until the call returns).
        weights = take_apart(restore(src, src_spec, mesh, meta), src_spec)
        relayout(weights, src_spec, tgt_spec, mesh, dtype)
        state = assemble(weights, tgt_spec, mesh)
        del weights
        outcome = Outcome(src_spec, tgt_spec, state.step, *_sizes(state), tuple(all_checks))
        cli_support.raise_if_interrupted()
        save(destination.staged(staging), tgt_spec, state)
        del state
        found = _check_and_publish(staging, dst, tgt_spec, force, all_checks)
    except BaseException:
        destination.discard(staging, settle=True)
        raise
    return dataclasses.replace(outcome, differences=found)
