"""The on-disk checkpoint format: one Orbax composite directory, written and read here.

    DIR/params     PyTreeSave: the parameters as plain arrays (Linen: the `{'params': ...}`
                   tree with its `LogicallyPartitioned` boxes stripped; NNX: the Param state as
                   a pure dict)
    DIR/opt_state  PyTreeSave: the state of `migrate.common.optim.make_optimizer(cfg)`, its moments
                   stripped the same way (Linen boxes or NNX States -> nested dicts)
    DIR/meta       JsonSave: format, framework, layout, step, the config keys that define the
                   layout, the model's shape keys, and per array its logical names, shape, dtype
                   and CRC32 (so boxes and Variables can be rebuilt, and corruption is caught)

That is also what an Orbax `CheckpointManager` with items `params`, `opt_state` and `meta` writes
under `ROOT/<step>/`, so such a step directory is a checkpoint here. Restores land with the
sharding of the mesh they are given and are validated against the config's model first (every
path, shape, logical name and dtype) and against their checksums after. `meta` is read and
validated without JAX by `migrate.checkpoints.meta`.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from orbax.checkpoint._src.metadata import array_metadata_store

from migrate.checkpoints.meta import (
    ARRAY_ITEMS,
    FORMAT,
    MODEL_KEYS,
    RNG,
    VERSION,
    CheckpointError,
    read_meta,
)
from migrate.checkpoints.train_state import (
    Leaf,
    Spec,
    TrainState,
    abstract_state,
    describe,
    from_pure,
    keystr,
    layout_keys,
    listing,
    mismatches,
    to_pure,
)
from migrate.common import dropout

# OCDBT data files are written when they reach this size: the default buffers a whole item in
# memory before writing it (measured: 0.7x the checkpoint's bytes; 64 MiB files: 0.3x).
OCDBT_FILE_BYTES = 64 * 2**20
# Orbax splits a replicated array's write among its replicas, each slice cut on the device by an
# eager program of its own (compiled once per shape and offset: 48 for a tiny MoE model's save,
# 378 in four of the suite's checkpoint test files, ~46 s of compiling). Worth it for big
# slices on many hosts, not for small ones: below this size a shard is written whole.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 2**20


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's default handlers (but the placeholder's: no tree here holds one), the jax.Array
    one with `REPLICA_PARALLEL_MIN_SLICE_BYTES` (a registry of its own: the global one is left
    as it is for the caller's other checkpoints)."""
    scalar = ocp.type_handlers.ScalarHandler()
    arrays = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES,
        # the default handler's store (per-array write shapes); not exported by
        # orbax-checkpoint 0.12.8
        array_metadata_store=array_metadata_store.Store(),
    )
    return ocp.type_handlers.create_type_handler_registry(
        *((t, scalar) for t in (int, float, bytes, np.number)),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, arrays),
        (str, ocp.type_handlers.StringHandler()),
    )


def _checkpointer() -> ocp.Checkpointer:
    handlers = _type_handlers()
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            params=ocp.PyTreeCheckpointHandler(type_handler_registry=handlers),
            opt_state=ocp.PyTreeCheckpointHandler(type_handler_registry=handlers),
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
        values = {keystr(p): v for p, v in flat}
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
        RNG: {"seed": cfg.seed, "dropout_impl": dropout.IMPL},
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
        ckpt.save(Path(path).absolute(), save_args(spec, state))


def _on_disk(path: Path) -> dict[str, dict[str, Leaf]]:
    try:
        with _checkpointer() as ckpt:
            metadata = ckpt.metadata(path).item_metadata
        out = {}
        for item in ARRAY_ITEMS:
            flat, _ = jax.tree_util.tree_flatten_with_path(metadata[item].tree)
            out[item] = {
                keystr(p): Leaf(tuple(m.shape), str(np.dtype(m.dtype)), None) for p, m in flat
            }
        return out
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot read the arrays' metadata ({_first_line(e)}); the checkpoint is "
            "corrupt"
        ) from None


def _check_tying(path: Path, spec: Spec, meta: Mapping[str, Any]) -> None:
    """A tied model (one table, no `logits_dense`) and an untied one are different models:
    conversion moves weights, it never ties or unties a head."""
    recorded = meta["model"]["logits_via_embedding"]
    if recorded != spec.cfg.logits_via_embedding:
        has = "the embedding is also the logits head" if recorded else "its own logits_dense"
        raise CheckpointError(
            f"{path}: the checkpoint was written with logits_via_embedding="
            f"{str(recorded).lower()} ({has}), the config has logits_via_embedding="
            f"{str(spec.cfg.logits_via_embedding).lower()}; pass "
            f"logits_via_embedding={str(recorded).lower()} to read it"
        )


def check_fits(path: str | Path, spec: Spec, meta: Mapping[str, Any], mesh: Mesh) -> None:
    """Raise unless the checkpoint at `path` holds `spec`'s trees: framework, layout, every
    path with its shape (named, first few), logical names, and dtypes."""
    path = Path(path).absolute()  # Orbax refuses a relative path: never read as corruption
    if meta["framework"] != spec.framework or meta["layout"] != spec.layout:
        raise CheckpointError(
            f"{path}: holds {meta['framework']} trees in the {meta['layout']} layout, "
            f"expected {spec.framework} in the {spec.layout} layout"
        )
    _check_tying(path, spec, meta)
    template = abstract_state(spec, mesh)
    disk = _on_disk(path)
    problems, dtypes = [], []
    for item in ARRAY_ITEMS:
        expected = describe(getattr(template, item))
        problems += mismatches(f"{path.name}/{item}", expected, disk[item])
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
            f"{len(problems)} problem(s):\n{listing(problems)}{hint}"
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
    path = Path(path).absolute()  # Orbax refuses a relative path: never read as corruption
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
            key = f"{item}/{keystr(p)}"
            if crc32(value) != meta["arrays"].get(key, {}).get("crc32"):
                raise CheckpointError(
                    f"{path}: {key} does not match its recorded checksum; the checkpoint is corrupt"
                )
    return TrainState(
        from_pure(template.params, restored["params"]),
        from_pure(template.opt_state, restored["opt_state"]),
        int(meta["step"]),
    )
