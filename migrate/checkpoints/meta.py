"""A checkpoint's `meta` item, read and validated without JAX.

`meta` (Orbax `JsonSave`, the file `DIR/meta/metadata`) is the one place a checkpoint states
what it holds: format, framework, layout, step, layout keys, model keys, the dropout keys' seed
(`rng`: with the optimizer state's step count, the RNG state a resumed run draws from), and per
array its shape, dtype, logical names and CRC32. Every field is checked for type and bounds before
anything uses it: the device count of a conversion comes from these layout keys, so an edited
field must be refused here, not reach XLA. `migrate.checkpoints.commands` re-exports these names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from migrate.config import safe_load
from migrate.config.bounds import INT_BOUNDS
from migrate.config.rules import DTYPES
from migrate.errors import BadInput

FORMAT = "linen-nnx-parity/checkpoint"
VERSION = 1
FRAMEWORKS = ("linen", "nnx")
LAYOUTS = ("pipeline", "reference")
ARRAY_ITEMS = ("params", "opt_state")
META_ITEM = "meta"
META_FILE = "metadata"  # what Orbax's JsonCheckpointHandler writes inside the item
# Keys that place the decoder layers in the pipeline layout: S, R, L and the scanned L axis.
LAYOUT_KEYS = (
    "ici_pipeline_parallelism",
    "dcn_pipeline_parallelism",
    "num_layers_per_pipeline_stage",
    "num_pipeline_repeats",
    "scan_layers_per_stage",
    "pipeline_parallel_layers",
)
# Keys that fix the parameters' shapes; recorded to explain a mismatch.
MODEL_KEYS = (
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "base_mlp_dim",
    "base_num_decoder_layers",
    "vocab_size",
    "weight_dtype",
    "logits_via_embedding",
    "num_experts",
)
REQUIRED = (
    "format",
    "version",
    "framework",
    "layout",
    "step",
    "layout_keys",
    "stages",
    "model",
    "weight_dtype",
    "model_name",
    "arrays",
)
# Optional (checkpoints written before it have none): the seed and PRNG of the dropout keys.
RNG = "rng"
DROPOUT_IMPLS = ("threefry2x32",)
ARRAY_DTYPES = ("float32", "bfloat16", "int32")
MAX_META_BYTES = 64 << 20  # a 7B checkpoint's meta is ~100 KB
MAX_ARRAYS = 100_000
MAX_RANK = 16
MAX_DIM = 2**40
MAX_STEP = 2**63 - 1


class CheckpointError(BadInput, ValueError):
    """A checkpoint that is missing, corrupt, or does not fit the request; names the place."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_in(x: Any, low: int, high: int) -> bool:
    return _is_int(x) and low <= x <= high


def _key_problem(where: str, key: str, value: Any) -> str | None:
    """A recorded config key's value against the config's own type and bounds."""
    if key in ("scan_layers_per_stage", "logits_via_embedding"):
        return None if isinstance(value, bool) else f"{where}: expected true or false"
    if key == "weight_dtype":
        return None if value in DTYPES else f"{where}: expected one of {', '.join(DTYPES)}"
    low, high = INT_BOUNDS[key]
    if _int_in(value, low, high) and value != 0:
        return None
    allowed = f"-1 or 1..{high}" if low == -1 else f"{low}..{high}"
    return f"{where}={str(value)[:40]}: expected an integer in {allowed}"


def _array_problems(key: Any, record: Any) -> list[str]:
    if not isinstance(key, str) or not isinstance(record, dict):
        return [f"arrays: entry {str(key)[:100]!r} is not a name -> record"]
    where = f"arrays[{key[:200]!r}]"
    shape, names = record.get("shape"), record.get("names")
    out = []
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_RANK
        and all(_int_in(d, 0, MAX_DIM) for d in shape)
    ):
        out.append(f"{where}.shape: expected a list of at most {MAX_RANK} sizes in 0..{MAX_DIM}")
    if record.get("dtype") not in ARRAY_DTYPES:
        out.append(f"{where}.dtype: expected one of {', '.join(ARRAY_DTYPES)}")
    if names is not None and not (
        isinstance(names, list)
        and all(n is None or isinstance(n, str) for n in names)
        and isinstance(shape, list)
        and len(names) == len(shape)
    ):
        out.append(f"{where}.names: expected null or one name (or null) per dimension")
    if not _int_in(record.get("crc32"), 0, 2**32 - 1):
        out.append(f"{where}.crc32: expected an integer in 0..2**32-1")
    return out


def problems(meta: Any) -> list[str]:
    """Every way `meta` is not a valid version-`VERSION` meta item (empty when it is)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return [f"not a {FORMAT} checkpoint"]
    absent = [k for k in REQUIRED if k not in meta]
    if absent or meta["version"] != VERSION or not _is_int(meta["version"]):
        return [
            f"version {str(meta.get('version'))[:20]} with keys missing: {absent}; this reader "
            f"knows version {VERSION}"
        ]
    out = []
    for key, allowed in (("framework", FRAMEWORKS), ("layout", LAYOUTS), ("weight_dtype", DTYPES)):
        if meta[key] not in allowed:
            out.append(f"{key}: expected one of {', '.join(allowed)}")
    if not _int_in(meta["step"], 0, MAX_STEP):
        out.append(f"step: expected an integer in 0..{MAX_STEP}")
    if not isinstance(meta["model_name"], str):
        out.append("model_name: expected a string")
    layout = meta["layout_keys"]
    if not isinstance(layout, dict) or set(layout) != set(LAYOUT_KEYS):
        out.append(f"layout_keys: expected exactly {', '.join(LAYOUT_KEYS)}")
    else:
        for key in LAYOUT_KEYS:
            out.append(_key_problem(f"layout_keys.{key}", key, layout[key]))
    stages = meta["stages"]
    if not (
        isinstance(stages, dict)
        and set(stages) == {"S", "R", "L"}
        and all(_int_in(v, 1, 2**22) for v in stages.values())
    ):
        out.append("stages: expected S, R and L, positive integers")
    model = meta["model"]
    if not isinstance(model, dict) or set(model) != set(MODEL_KEYS):
        out.append(f"model: expected exactly {', '.join(MODEL_KEYS)}")
    else:
        for key in MODEL_KEYS:
            out.append(_key_problem(f"model.{key}", key, model[key]))
    if RNG in meta:
        out.append(_rng_problem(meta[RNG]))
    out = [p for p in out if p is not None]
    arrays = meta["arrays"]
    if not isinstance(arrays, dict) or not 0 < len(arrays) <= MAX_ARRAYS:
        out.append(f"arrays: expected a mapping of 1 to {MAX_ARRAYS} arrays")
    else:
        for key, record in arrays.items():
            out += _array_problems(key, record)
            if len(out) > 5:
                break
    return out


def _rng_problem(rng: Any) -> str | None:
    low, high = INT_BOUNDS["seed"]
    if (
        isinstance(rng, dict)
        and set(rng) == {"seed", "dropout_impl"}
        and _int_in(rng["seed"], low, high)
        and rng["dropout_impl"] in DROPOUT_IMPLS
    ):
        return None
    impls = ", ".join(DROPOUT_IMPLS)
    return f"{RNG}: expected seed (an integer in {low}..{high}) and dropout_impl ({impls})"


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's `meta` item, every field checked (JAX-free: a plain JSON read)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint there (not a directory)")
    missing = [item for item in (*ARRAY_ITEMS, META_ITEM) if not (path / item).is_dir()]
    if missing:
        raise CheckpointError(
            f"{path}: not a complete checkpoint: item(s) {', '.join(missing)} missing "
            f"(expected {', '.join((*ARRAY_ITEMS, META_ITEM))})"
        )
    try:
        meta = safe_load.load_json_file(path / META_ITEM / META_FILE, MAX_META_BYTES, "meta")
    except safe_load.ParseError as e:
        raise CheckpointError(
            f"{path / META_ITEM}: cannot read the checkpoint's meta item ({e}); the checkpoint "
            "is corrupt"
        ) from None
    found = problems(meta)
    if found:
        raise CheckpointError(
            f"{path / META_ITEM}: invalid meta item: {'; '.join(found[:5])}"
            + (" ..." if len(found) > 5 else "")
        )
    return meta


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds a checkpoint this tool wrote (its items and a valid `meta`)."""
    try:
        read_meta(path)
    except CheckpointError:
        return False
    return True


# The keys that put the decoder's layers back on one axis (the reference layout, S = 1).
REFERENCE_KEYS = {
    "ici_pipeline_parallelism": 1,
    "dcn_pipeline_parallelism": 1,
    "num_layers_per_pipeline_stage": 1,
    "num_pipeline_repeats": -1,
    "scan_layers_per_stage": False,
    "pipeline_parallel_layers": -1,
}


def stored_config(meta: dict[str, Any], cfg: Any, changes: dict[str, Any] | None = None) -> Any:
    """`cfg` with `changes` as the checkpoint described by a validated `meta` was written: its
    recorded layout keys and weight dtype win; for a reference-layout checkpoint, without a
    pipeline (the decoder then runs its layers as the reference does). Schedule keys that no
    longer fit reset to their defaults (`migrate.config.loading.with_changes`), as `migrate`
    does."""
    from migrate.config.contract import ConfigError
    from migrate.config.loading import with_changes

    recorded = {**meta["layout_keys"], "weight_dtype": meta["weight_dtype"]}
    if RNG in meta:  # a resumed run draws its dropout keys from the seed they were drawn from
        recorded["seed"] = meta[RNG]["seed"]
    try:
        cfg = with_changes(cfg, {**(changes or {}), **recorded})
        return with_changes(cfg, REFERENCE_KEYS) if meta["layout"] == "reference" else cfg
    except ConfigError as e:
        raise BadInput(f"the checkpoint's layout does not fit the config: {e}") from None
