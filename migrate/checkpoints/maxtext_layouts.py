"""MaxText's on-disk layouts as data: its checkpoints <-> the twins', and its training state
in its two forms (the Linen layout on disk, the `TrainStateNNX` 0.2.5 restores it into).

A MaxText checkpoint is a step directory of its `CheckpointManager` (`RUN/checkpoints/<n>/`,
the state under `items/`) in the Linen layout that both releases write: `{step, params:
{params: ...}, opt_state: [{count, mu: {params: ...}, nu: {params: ...}}, None, {count}]}`;
0.2.5 adds its RNG state under `nnx_aux` (how the release is detected). `n` is the index of
the last step executed, `step` the number of steps done (`n + 1`), which is the twins' step.

The map (`twins_map`): names (MaxText's `decoder/...` under `params/params`, the twins'
reference layout under `params`), the stacking axis (MaxText's pipeline with one layer per
stage and no repeats stacks the layers on axis 0 like the twins; its scanned decoder puts them
at `param_scan_axis` 1), and the query scale: MaxText folds `1/sqrt(head_dim)` into the query
kernel, the twins scale queries in the forward pass, so the twins' query kernel is MaxText's
times `sqrt(head_dim)`, its Adam `mu` divided by it and `nu` by `head_dim` (the chain rule on
the gradient). Exact both ways when `sqrt(head_dim)` is a power of two (head_dim 4, 16, 64...).
A pipeline with several layers per stage or circular repeats (`pipeline_map`: MaxText's
`layers_<j>` stacked `[R?, S, ...]` <-> the twins' pipeline layout, the same stacking; then
`pipeline_to_reference`, layer `(r*S + s)*L + j`) needs its layout `(R, S, L)`.
Carried: parameters, both moments, the Adam count; MaxText's schedule count (`opt_state/2`)
equals the Adam count and is rebuilt from it on the way back; 0.2.5's RNG state is dropped
(reported). Reads hold the checkpoint in host memory once (tiny to mid-size checkpoints).

The training state (`NNX_TO_LINEN`): 0.2.5 restores the Linen layout into its `TrainStateNNX`
(`{model: ..., optimizer: {step, opt_state: {0: {count, mu, nu}, 2: {count}}}}`, plus the
model's RNG state); the map puts the restored leaves back on the Linen layout's paths, strictly.
`NNX_ONLY` are the leaves the Linen layout has no place for (the RNG streams' keys and counts:
0.2.5 writes them under `nnx_aux`, 0.2.3 knows none); `STEP_DTYPES` is the one declared dtype
difference. No JAX.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from migrate.checkpoints.meta import CheckpointError
from migrate.checkpoints.weight_map import Entry, WeightMap, WeightMapError, match

PREFIX = ("params", "params")
Layout = tuple[int, int, int]  # a pipeline's (repeats R, stages S, layers per stage L)
MOMENTS = ("mu", "nu")


def release(flat: dict[tuple[str, ...], Any]) -> str:
    """The MaxText release that wrote a checkpoint, read off its tree."""
    return "0.2.5" if any(p[0] == "nnx_aux" for p in flat) else "0.2.3"


def query_scale(head_dim: int, kind: str = "params") -> float:
    """MaxText -> twins factor of the query kernel (`params`) and of its moments."""
    root = math.sqrt(head_dim)
    return {"params": root, "mu": 1.0 / root, "nu": 1.0 / head_dim}[kind]


def twins_map(head_dim: int, kind: str = "params", stacking: str = "pipeline") -> WeightMap:
    """MaxText's parameter paths (under `params/params`, or a moment's) -> the twins'
    reference layout paths (under `params`), for parameters or one Adam moment; `stacking`:
    MaxText's `pipeline` (one layer per stage, no repeats) or its `scan`ned decoder."""
    scale = query_scale(head_dim, kind)
    query = "self_attention/query/kernel"
    if stacking == "pipeline":  # stage index = layer index, on axis 0 like the twins
        layers, move = "decoder/pipeline_module/layers", None
    else:  # MaxText's scan puts the layer axis at param_scan_axis=1
        layers, move = "decoder/layers", (1, 0)
    return WeightMap(
        f"maxtext ({stacking}) -> twins ({kind})",
        (
            Entry("token_embedder/embedding", "token_embedder/embedding"),
            Entry("decoder/decoder_norm/scale", "decoder_norm/scale"),
            Entry("decoder/logits_dense/kernel", "logits_dense/kernel"),
            Entry(f"{layers}/{{path...}}", "layers/{path...}", moveaxis=move),
            Entry(
                f"{layers}/{query}",
                f"layers/{query}",
                moveaxis=move,
                scale=scale,
                note="MaxText folds 1/sqrt(head_dim) into the query kernel",
            ),
        ),
    )


# MaxText's logical names the twins name otherwise (MaxText 0.2.3's form; 0.2.5 also renames
# attention's embed, `parity.maxtext.release_pair.RELEASES`): the embedding and the logits head
# name their embed dimension `embed_vocab`, the twins `embed`.
EMBED_VOCAB = (("embed_vocab", "embed"),)


def pipeline_map(head_dim: int, per_stage: int, kind: str = "params") -> WeightMap:
    """MaxText's pipelined decoder (`decoder/pipeline_module/layers`, layers stacked `[R?, S,
    ...]`, any number of stages S and circular repeats R) -> the twins' pipeline layout
    (`pipeline/layers/layers_<j>`, the same stacking): the paths, the query scale of `kind`
    (`params`, or `mu`, which a gradient shares, or `nu`), and the logical names
    (`EMBED_VOCAB`). With one layer per stage MaxText has no `layers_0` level; with `per_stage`
    > 1 both have `layers_<j>`, one row each (a `layers_<j>` beyond them maps nowhere). Layers
    scanned within a stage (`scan_layers_per_stage`) are not mapped."""
    scale = query_scale(head_dim, kind)
    slots = [""] if per_stage == 1 else [f"layers_{j}/" for j in range(per_stage)]
    rows: list[Entry] = [
        Entry("token_embedder/embedding", "token_embedder/embedding", names=EMBED_VOCAB),
        Entry("decoder/decoder_norm/scale", "decoder_norm/scale"),
        Entry("decoder/logits_dense/kernel", "logits_dense/kernel", names=EMBED_VOCAB),
    ]
    for j, slot in enumerate(slots):
        source, target = f"decoder/pipeline_module/layers/{slot}", f"pipeline/layers/layers_{j}/"
        rows.append(Entry(f"{source}{{path...}}", f"{target}{{path...}}"))
        rows.append(
            Entry(
                f"{source}self_attention/query/kernel",
                f"{target}self_attention/query/kernel",
                scale=scale,
                note="MaxText folds 1/sqrt(head_dim) into the query kernel",
            )
        )
    return WeightMap(f"maxtext (pipeline, L={per_stage}) -> twins pipeline ({kind})", tuple(rows))


def pipeline_to_reference(
    flat: dict[tuple[str, ...], Any], repeats: int, stages: int, per_stage: int
) -> dict[tuple[str, ...], Any]:
    """The twins' pipeline layout (flat, `pipeline/layers/layers_<j>/...` stacked `[R?, S,
    ...]`) -> their reference layout (`layers/...` stacked `[N, ...]`, layer `(r*S + s)*L + j`);
    the other leaves as they are. Strict: every layer leaf in every slot, each with the stacked
    axes the counts say (else `WeightMapError`)."""
    lead = ((repeats,) if repeats > 1 else ()) + (stages,)
    slots: dict[tuple[str, ...], dict[int, Any]] = {}
    out, problems = {}, []
    for path, array in flat.items():
        if path[:2] != ("pipeline", "layers"):
            out[path] = array
            continue
        slot = path[2] if len(path) > 3 else ""
        j = int(slot[len("layers_") :]) if slot.startswith("layers_") else -1
        if not 0 <= j < per_stage:
            problems.append(f"{'/'.join(path)}: not a slot of {per_stage} layers per stage")
            continue
        if tuple(np.shape(array)[: len(lead)]) != lead:
            problems.append(f"{'/'.join(path)}: shape {np.shape(array)} lacks the axes {lead}")
            continue
        slots.setdefault(path[3:], {})[j] = array
    for rest, per_slot in slots.items():
        if sorted(per_slot) != list(range(per_stage)):
            problems.append(f"{'/'.join(rest)}: slots {sorted(per_slot)} of {per_stage}")
            continue
        stacked = np.stack([np.asarray(per_slot[j]) for j in range(per_stage)], axis=len(lead))
        out[("layers", *rest)] = stacked.reshape(-1, *stacked.shape[len(lead) + 1 :])
    if problems:
        raise WeightMapError("twins pipeline -> reference", problems)
    return out


def reference_to_pipeline(
    flat: dict[tuple[str, ...], Any], repeats: int, stages: int, per_stage: int
) -> dict[tuple[str, ...], Any]:
    """The inverse of `pipeline_to_reference`: every `layers/...` leaf must hold `R*S*L`
    layers."""
    lead = ((repeats,) if repeats > 1 else ()) + (stages,)
    layers = repeats * stages * per_stage
    out, problems = {}, []
    for path, array in flat.items():
        if path[0] != "layers":
            out[path] = array
            continue
        array = np.asarray(array)
        if array.shape[:1] != (layers,):
            problems.append(f"{'/'.join(path)}: shape {array.shape}, not {layers} layers")
            continue
        split = array.reshape(*lead, per_stage, *array.shape[1:])
        for j in range(per_stage):
            out[("pipeline", "layers", f"layers_{j}", *path[1:])] = np.take(
                split, j, axis=len(lead)
            )
    if problems:
        raise WeightMapError("twins reference -> pipeline", problems)
    return out


def stacking(flat: dict[tuple[str, ...], Any]) -> str:
    """How a MaxText checkpoint stacks its decoder layers: `pipeline` or `scan`."""
    return "pipeline" if any("pipeline_module" in p for p in flat) else "scan"


def _check_head_dim(head_dim: int) -> None:
    if not twins_map(head_dim).exact:
        raise CheckpointError(
            f"head_dim {head_dim}: sqrt(head_dim) is not a power of two, so the query scale "
            "is not exact both ways; this converter only writes exact maps"
        )


def step_directory(path: str | Path) -> Path:
    """`path` as a MaxText step directory (holding `items/_METADATA`), or CheckpointError."""
    path = Path(path)
    if not (path / "items" / "_METADATA").is_file():
        raise CheckpointError(
            f"{path}: not a MaxText checkpoint step directory (no items/_METADATA; "
            "pass RUN/checkpoints/<step>)"
        )
    return path


def read(path: str | Path) -> dict[tuple[str, ...], np.ndarray]:
    """Every array of a MaxText checkpoint, flat by path, on the host (CheckpointError naming
    what is missing or unreadable)."""
    import orbax.checkpoint as ocp

    items = step_directory(Path(path).absolute()) / "items"  # Orbax refuses a relative path
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree = checkpointer.metadata(items).item_metadata
        # host arrays, whatever mesh wrote them (no devices needed, any topology)
        as_numpy = _tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = checkpointer.restore(items, restore_args=as_numpy)
    except Exception as e:  # Orbax and TensorStore errors name the file, not the leaf
        raise CheckpointError(f"{items}: cannot read: {_cause(e)}") from None
    return _flatten(restored)


def _cause(error: BaseException) -> str:
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return (
        f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error) else ''}"
    )


def _tree_map(fn: Any, tree: Any) -> Any:
    """`fn` over the leaves of Orbax's tree metadata (mappings, lists; None kept)."""
    if hasattr(tree, "keys"):
        return {k: _tree_map(fn, tree[k]) for k in tree.keys()}  # noqa: SIM118 (not a dict)
    if isinstance(tree, list | tuple):
        return type(tree)(_tree_map(fn, v) for v in tree)
    return None if tree is None else fn(tree)


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    import jax

    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        if tree is None:
            return {}
        if jax.dtypes.issubdtype(getattr(tree, "dtype", np.float32), jax.dtypes.prng_key):
            tree = jax.random.key_data(tree)  # 0.2.5's RNG state: typed keys
        return {prefix: np.asarray(jax.device_get(tree))}
    out: dict[tuple[str, ...], Any] = {}
    for key, value in items:
        out.update(_flatten(value, (*prefix, str(key))))
    return out


def to_reference(
    tree: dict[tuple[str, ...], Any], head_dim: int, kind: str, how: str, layout: Layout | None
) -> dict[tuple[str, ...], Any]:
    """One tree of MaxText's (parameters or a moment) -> the twins' reference layout; a
    pipeline of several layers per stage or circular repeats needs its `layout`."""
    if how != "pipeline" or layout is None:
        return twins_map(head_dim, kind, how).forward(tree)
    repeats, stages, per_stage = layout
    staged = pipeline_map(head_dim, per_stage, kind).forward(tree)
    return pipeline_to_reference(staged, repeats, stages, per_stage)


def from_reference(
    tree: dict[tuple[str, ...], Any], head_dim: int, kind: str, how: str, layout: Layout | None
) -> dict[tuple[str, ...], Any]:
    """The inverse of `to_reference`."""
    if how != "pipeline" or layout is None:
        return twins_map(head_dim, kind, how).backward(tree)
    repeats, stages, per_stage = layout
    staged = reference_to_pipeline(tree, repeats, stages, per_stage)
    return pipeline_map(head_dim, per_stage, kind).backward(staged)


def to_twins(
    flat: dict[tuple[str, ...], Any], head_dim: int, layout: Layout | None = None
) -> dict[str, Any]:
    """A MaxText checkpoint's arrays -> the twins' reference-layout trees: `params` and each
    moment flat by twin path, the Adam `count`, the `step`, and what was dropped. Strict: a
    leaf of the checkpoint that is neither mapped nor declared dropped is a WeightMapError.
    `layout` (R, S, L): a pipeline's repeats, stages and layers per stage (needed beyond one
    layer per stage without repeats)."""
    _check_head_dim(head_dim)
    trees: dict[str, dict] = {"params": {}, "mu": {}, "nu": {}}
    counts, dropped, unknown = {}, [], []
    for path, array in flat.items():
        if path[:2] == PREFIX:
            trees["params"][path[2:]] = array
        elif path[0] == "opt_state" and len(path) > 4 and path[2] in MOMENTS:
            if path[3] != "params":
                unknown.append("/".join(path))
            trees[path[2]][path[4:]] = array
        elif path[0] == "opt_state" and path[-1] == "count":
            counts[path[1]] = array
        elif path == ("step",):
            continue
        elif path[0] == "nnx_aux":
            dropped.append("/".join(path))
        else:
            unknown.append("/".join(path))
    if unknown or ("step",) not in flat or "0" not in counts:
        missing = [
            name
            for name, there in (("step", ("step",) in flat), ("opt_state/0/count", "0" in counts))
            if not there
        ]
        raise CheckpointError(
            "not a MaxText train state this converter knows: "
            + "; ".join(
                [*(f"unexpected leaf {u}" for u in unknown[:5]), *(f"missing {m}" for m in missing)]
            )
        )
    if "2" in counts and not np.array_equal(counts["2"], counts["0"]):
        raise CheckpointError(
            f"opt_state/2/count {counts['2']} differs from opt_state/0/count {counts['0']}: "
            "a schedule count the twins' optimizer cannot carry"
        )
    how = stacking(flat)
    out = {kind: to_reference(trees[kind], head_dim, kind, how, layout) for kind in trees}
    return {
        **out,
        "count": counts["0"],
        "step": int(flat[("step",)]),
        "dropped": dropped,
        "stacking": how,
    }


def from_twins(
    trees: dict[str, dict],
    count: Any,
    step: int,
    head_dim: int,
    how: str,
    layout: Layout | None = None,
) -> dict[tuple[str, ...], Any]:
    """The twins' reference-layout `params`, `mu`, `nu` (flat by twin path) -> MaxText's
    Linen on-disk tree (flat), its layers stacked as `how` (`pipeline` or `scan`) and, for a
    pipeline, `layout` (R, S, L) say."""
    _check_head_dim(head_dim)
    out: dict[tuple[str, ...], Any] = {("step",): np.asarray(step, np.int32)}
    for kind in ("params", *MOMENTS):
        head = PREFIX if kind == "params" else ("opt_state", "0", kind, "params")
        for path, array in from_reference(trees[kind], head_dim, kind, how, layout).items():
            out[(*head, *path)] = array
    out[("opt_state", "0", "count")] = np.asarray(count)
    out[("opt_state", "2", "count")] = np.asarray(count)
    return out


# ------------------------------------------------------------ the training state

NNX_TO_LINEN = WeightMap(
    "maxtext TrainStateNNX -> Linen checkpoint layout",
    (
        Entry("model/{path...}", "params/params/{path...}", note="weights under params/params"),
        Entry("optimizer/step", "step", note="uint32 in NNX, int32 in Linen"),
        Entry("optimizer/opt_state/{i}/count", "opt_state/{i}/count"),
        Entry(
            "optimizer/opt_state/{i}/mu/{path...}",
            "opt_state/{i}/mu/params/{path...}",
            note="Linen's moments are wrapped in the params collection",
        ),
        Entry(
            "optimizer/opt_state/{i}/nu/{path...}",
            "opt_state/{i}/nu/params/{path...}",
            note="Linen's moments are wrapped in the params collection",
        ),
    ),
)
NNX_ONLY = ("model/{path...}/rngs/{stream}/{part}",)  # RNG state: no place in the Linen layout
STEP_DTYPES = {"linen": "int32", "nnx": "uint32"}  # the step counter's dtype in each form


def nnx_only(path: tuple[str, ...]) -> bool:
    """A leaf of the NNX state that the Linen layout does not hold (declared, reported)."""
    return any(match(pattern, path) is not None for pattern in NNX_ONLY)


def leaf_kind(linen_path: tuple[str, ...]) -> str:
    """A Linen-layout path's kind, for the cross-release table: params, mu, nu, count, step."""
    if linen_path == ("step",):
        return "step"
    if linen_path[0] == "params":
        return "params"
    return linen_path[2] if len(linen_path) > 2 and linen_path[2] in ("mu", "nu") else "count"
