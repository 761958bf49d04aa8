"""The decoder cut into drill-down stages: where do the twins first part ways?

The whole decoder in data-flow order (reference layout, full batch): the embedding, every
submodule output of every layer (captured with Linen's `capture_intermediates` and NNX's
`nnx.capture(method_outputs=...)`), the final norm, the logits head and the loss; the engine's
`layers` check feeds each stage Linen's input to it on both sides, so a bug shows in its own
stage and nowhere after. For pipelined configs also the stage outputs after every pipeline
iteration, naming the first iteration and stage that differ; with a pipelined subset also each
layer's output after the pipeline, run by the twin's own `LayersAfterPipeline` on its own
weights (a remainder row mapped wrongly shows there). Each function here builds one framework's
stages; the two lists line up name by name.

The data-flow order (`LAYER_ORDER`, `data_flow_rank`) is the order the stages run in and the
order a failing check names its first divergence by.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from migrate.checkpoints import convert
from migrate.common import axes, loss, packing, placement, schedule
from migrate.config.contract import Config
from migrate.linen import decoder as linen_decoder
from migrate.linen import layers as linen_layers
from migrate.linen import pipeline as linen_pipeline
from migrate.nnx import decoder as nnx_decoder
from migrate.nnx import layers as nnx_layers
from migrate.nnx import pipeline as nnx_pipeline
from parity.decoder import twins
from parity.engine.side import DrillStage
from parity.multiprocess import distributed

# Execution order inside a decoder layer: the first divergence is the first in this order.
LAYER_ORDER = (
    "pre_self_attention_layer_norm",
    "self_attention/query",
    "self_attention/key",
    "self_attention/value",
    "self_attention/rotary/0",
    "self_attention/rotary/1",
    "self_attention/out",
    "self_attention",
    "post_self_attention_layer_norm",
    "mlp/gate",
    "mlp/wi_0",
    "mlp/wi_1",
    "mlp/wo",
    "mlp",
    "mlp/aux_loss",
    "output",
    "output/aux_loss",
)


# The decoder's parameters and outputs in data-flow order (layers by their submodule order).
_FLOW = (
    "token_embedder",
    "embedding",
    "pipeline",
    "layers",
    "layers_after_pipeline",
    "decoder_norm",
    "logits_dense",
)


def data_flow_rank(tensor: str) -> tuple[int, int]:
    """Where a record's tensor (`linen-init/grads/params/pipeline/.../mlp/wo/kernel`, `logits`,
    `loss`) sits in the decoder's data flow: earlier parts rank lower."""
    parts = tensor.split("/")
    if parts[-1] in ("logits", "loss") or tensor.endswith(("/logits", "/loss")):
        return (len(_FLOW) + (parts[-1] == "loss"), 0)
    first = next((i for i, name in enumerate(_FLOW) if name in parts), len(_FLOW))
    padded = f"/{tensor}/"
    matches = [name for name in LAYER_ORDER if f"/{name}/" in padded]
    inner = LAYER_ORDER.index(max(matches, key=len)) if matches else len(LAYER_ORDER)
    return (first, inner)


def _normalise(path: tuple[str, ...]) -> str:
    """`('self_attention', '__call__', '[0]')` -> `self_attention`; the layer's own output
    becomes `output`; repeated calls (rotary on query and key) keep their index. A call that
    returns `(y, aux)` (a MoE block, a layer) gives `name` and `name/aux_loss`."""
    parts = [p.strip("[]") for p in path if p not in ("intermediates",)]
    call = parts.index("__call__")
    name = "/".join(parts[:call]) or "output"
    index = parts[call + 1] if call + 1 < len(parts) else "0"
    name = name if index == "0" else f"{name}/{index}"
    returned = parts[call + 2] if call + 2 < len(parts) else "0"
    return name if returned == "0" else f"{name}/aux_loss"


def _captures(tree: Any) -> dict[str, jax.Array]:
    flat = jax.tree_util.tree_leaves_with_path(tree)
    out = {}
    for path, leaf in flat:
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if keys[-1].isdigit() and "__call__" in keys and keys.index("__call__") < len(keys) - 1:
            out[_normalise(keys)] = leaf
        else:
            out[_normalise((*keys, "0"))] = leaf
    return out


def _jitted_layer(framework: str, cfg: Config, mesh):
    if framework == "linen":
        return _linen_layer_fn(cfg, mesh)
    return _nnx_layer_fn(cfg, mesh, twins.nnx_mode())


@functools.cache
def _linen_layer_fn(cfg: Config, mesh):
    layer = linen_layers.DecoderLayer(cfg, mesh)

    def apply(params, x, positions):
        out, state = layer.apply(
            {"params": params},
            x,
            positions.index,
            positions.segment,
            capture_intermediates=True,
            mutable=["intermediates"],
        )
        return out, state["intermediates"]

    return jax.jit(apply)


def _nnx_graphdef(create) -> nnx.GraphDef:
    """The graphdef of the module `create(rngs)` builds, without allocating its weights."""
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: create(nnx.Rngs(0))))[0]


@twins.nnx_cache
def _nnx_layer_fn(cfg: Config, mesh, mode):
    del mode
    graphdef = _nnx_graphdef(lambda rngs: nnx_layers.DecoderLayer(cfg, mesh, rngs=rngs))

    def apply(params, x, positions):
        layer = nnx.merge(graphdef, params)
        out, captured = nnx.capture(layer, nnx.Intermediate, method_outputs=nnx.Intermediate)(
            x, positions.index, positions.segment
        )
        return out, nnx.to_pure_dict(captured)

    return jax.jit(apply)


# The decoder outside its layers, in data-flow order; the logits head is one of the last two
# (`head_part`): its own kernel, or the token embedding's table (`Embed.attend`, tied).
OUTER_PARTS = ("embedding", "decoder_norm", "logits_dense", "logits_via_embedding", "loss")
_PARAMS_KEY = {
    "embedding": "token_embedder",
    "decoder_norm": "decoder_norm",
    "logits_dense": "logits_dense",
    "logits_via_embedding": "token_embedder",
}


def head_part(cfg: Config) -> str:
    """The drill-down part of the config's logits head."""
    return "logits_via_embedding" if cfg.logits_via_embedding else "logits_dense"


def _linen_outer(cfg: Config, part: str):
    if part in ("embedding", "logits_via_embedding"):
        return linen_layers.Embed(cfg)
    if part == "decoder_norm":
        return linen_layers.RMSNorm(cfg)
    return linen_layers.DenseGeneral(
        (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg
    )


def _nnx_outer(cfg: Config, part: str, rngs: nnx.Rngs):
    if part in ("embedding", "logits_via_embedding"):
        return nnx_layers.Embed(cfg, rngs=rngs)
    if part == "decoder_norm":
        return nnx_layers.RMSNorm(cfg, rngs=rngs)
    return nnx_layers.DenseGeneral(
        (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg, rngs=rngs
    )


@functools.cache
def _linen_outer_fn(cfg: Config, part: str):
    if part == "loss":
        return jax.jit(cross_entropy_loss)
    module = _linen_outer(cfg, part)
    method = "attend" if part == "logits_via_embedding" else "__call__"
    return jax.jit(lambda params, x: module.apply({"params": params}, x, method=method))


@twins.nnx_cache
def _nnx_outer_fn(cfg: Config, part: str, mode):
    del mode
    if part == "loss":
        return jax.jit(cross_entropy_loss)
    graphdef = _nnx_graphdef(lambda rngs: _nnx_outer(cfg, part, rngs))
    method = "attend" if part == "logits_via_embedding" else "__call__"
    return jax.jit(lambda params, x: getattr(nnx.merge(graphdef, params), method)(x))


def cross_entropy_loss(logits: jax.Array, batch: dict) -> jax.Array:
    """The decoder's cross entropy of `logits` on `batch`'s targets (both twins'), over the
    tokens a packed batch counts: the drill-down's `loss` part, a program of that name."""
    return loss.cross_entropy_loss(logits, batch["targets"], packing.loss_weights(batch))


def _abstract(create) -> nnx.State:
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: create(nnx.Rngs(0))))[1]


def _as_nnx(boxed_params: Any, create, mesh) -> nnx.State:
    """A sub-module's Linen params (boxed, host) as the NNX sub-module's Param state, replicated
    over `mesh` (`jnp.asarray` would compile a program per shape)."""
    boxed = distributed.replicate(boxed_params, mesh)
    return convert.linen_to_nnx({"params": boxed}, _abstract(create), renames={})


def stages(
    framework: str, cfg: Config, mesh, native: Any, common_host: dict, batch: dict
) -> list[DrillStage]:
    """One twin's drill-down stages, from its `native` weights and the same weights in the
    common form on the host (`common_host`); `batch` gives the tokens and targets."""
    compute_cfg = twins.compute_config(twins.schedule_free(cfg))
    host = common_host
    if cfg.using_pipeline:
        host = convert.linen_pipeline_to_reference(host, cfg)
    params, names = convert.strip_boxes(host["params"])
    boxed = convert.restore_boxes(params, names)
    tokens = batch["inputs"]
    index = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    positions = packing.Positions(
        *distributed.replicate(
            (batch.get("inputs_position", index), batch.get("inputs_segmentation")), mesh
        )
    )
    loss_batch = {k: batch[k] for k in ("targets", "targets_segmentation") if k in batch}

    def outer(part: str) -> DrillStage:
        if framework == "linen":
            fn = _linen_outer_fn(compute_cfg, part)
        else:
            fn = _nnx_outer_fn(compute_cfg, part, twins.nnx_mode())
        if part == "loss":
            return DrillStage(part, lambda logits: _captured(part, fn(logits, loss_batch)))
        part_params = params[_PARAMS_KEY[part]]
        if framework == "nnx":
            part_params = _as_nnx(
                boxed[_PARAMS_KEY[part]], lambda r: _nnx_outer(compute_cfg, part, r), mesh
            )
        else:
            part_params = distributed.replicate(part_params, mesh)
        if part == "embedding":
            return DrillStage(part, lambda _: _captured(part, fn(part_params, tokens)))
        return DrillStage(part, lambda x: _captured(part, fn(part_params, x)))

    layer_fn = _jitted_layer(framework, compute_cfg, mesh)
    layer_names = jax.tree.map(
        lambda n: n[1:], names["layers"], is_leaf=lambda n: isinstance(n, tuple)
    )

    def layer(index: int) -> DrillStage:
        layer_params = jax.tree.map(lambda w: w[index], params["layers"])
        if framework == "nnx":
            layer_boxed = convert.restore_boxes(layer_params, layer_names)
            layer_params = _as_nnx(
                layer_boxed, lambda r: nnx_layers.DecoderLayer(compute_cfg, mesh, rngs=r), mesh
            )
        else:
            layer_params = distributed.replicate(layer_params, mesh)
        prefix = f"layer {index}/"

        def apply(x):
            (out, _), captured = layer_fn(layer_params, distributed.replicate(x, mesh), positions)
            return out, {prefix + name: value for name, value in _captures(captured).items()}

        where = placement.place(cfg, index).describe() if cfg.using_pipeline else None
        return DrillStage(
            f"layer {index}",
            apply,
            order=[prefix + name for name in LAYER_ORDER],
            fields=lambda _: {"layer": index} | ({"placement": where} if where else {}),
        )

    out = [outer("embedding")]
    out += [layer(i) for i in range(cfg.base_num_decoder_layers)]
    if placement.has_layers_after_pipeline(cfg):
        out.append(_after_pipeline(framework, cfg, mesh, native, positions))
    out += [outer("decoder_norm"), _cast_after(outer(head_part(cfg))), outer("loss")]
    if cfg.using_pipeline:
        out.append(_iterations(framework, cfg, mesh, native, positions))
    return out


def _captured(name: str, value: Any) -> tuple[Any, dict[str, Any]]:
    return value, {name: value}


@jax.jit
def _as_float32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)  # eagerly: a program too, named after its primitive


def _cast_after(stage: DrillStage) -> DrillStage:
    """The logits head's stage, its output cast to float32 for the loss (as the decoder does)."""

    def apply(x):
        out, captured = stage.apply(x)
        return (out if out.dtype == jnp.float32 else _as_float32(out)), captured

    return DrillStage(stage.name, apply)


def _iterations(framework: str, cfg: Config, mesh, native: Any, positions) -> DrillStage:
    """Stage outputs after every pipeline iteration, fed the embedding's output; bubble slots
    are skipped (both twins compute on zeros there by design)."""
    compute_cfg = twins.compute_config(cfg)
    if framework == "linen":
        trace, pipe_params = _linen_trace(compute_cfg, mesh), native["params"]["pipeline"]
    else:
        trace, pipe_params = _nnx_trace(compute_cfg, mesh, twins.nnx_mode()), native["pipeline"]
    slots = _working_slots(compute_cfg)
    where = {name: (t, s) for t, s, name in slots}

    def apply(x):
        history, outputs = trace(pipe_params, x, positions)
        return history, dict(zip(where, outputs, strict=True))

    return DrillStage(
        "pipeline iterations",
        apply,
        order=[name for _, _, name in slots],
        input_from="embedding",
        fields=lambda name: {"iteration": where[name][0], "stage": where[name][1]},
    )


def _after_pipeline(framework: str, cfg: Config, mesh, native: Any, positions) -> DrillStage:
    """Each layer's output after the pipeline, by the twin's own `LayersAfterPipeline` on its
    own weights, fed the output of the last pipelined layer; named by `migrate.common.placement`."""
    compute_cfg = twins.compute_config(cfg)
    if framework == "linen":
        trace = _linen_after_trace(compute_cfg, mesh)
        after = native["params"][axes.LAYERS_AFTER_PIPELINE]
    else:
        trace = _nnx_after_trace(compute_cfg, mesh, twins.nnx_mode())
        after = native[axes.LAYERS_AFTER_PIPELINE]
    rows = placement.placements(cfg)[placement.rows_after_pipeline(cfg)]
    names = {f"layer {p.layer} ({p.describe()})": p for p in rows}

    def apply(x):
        out, _, outputs = trace(after, distributed.replicate(x, mesh), positions)
        rows = distributed.to_host(outputs)  # indexed eagerly on the device: a program per row
        return out, {name: rows[p.row_after_pipeline] for name, p in names.items()}

    return DrillStage(
        "layers after the pipeline",
        apply,
        order=list(names),
        input_from=f"layer {cfg.num_pipelined_layers - 1}",
        fields=lambda name: {"layer": names[name].layer, "placement": names[name].describe()},
    )


@functools.cache
def _linen_after_trace(cfg: Config, mesh):
    module = linen_decoder.LayersAfterPipeline(cfg, mesh)
    return jax.jit(lambda params, x, pos: module.apply({"params": params}, x, pos, trace=True))


@twins.nnx_cache
def _nnx_after_trace(cfg: Config, mesh, mode):
    del mode
    graphdef = _nnx_graphdef(lambda rngs: nnx_decoder.LayersAfterPipeline(cfg, mesh, rngs=rngs))
    return jax.jit(lambda params, x, pos: nnx.merge(graphdef, params)(x, pos, trace=True))


def _working_slots(cfg: Config) -> list[tuple[int, int, str]]:
    """(iteration, stage, name) of every slot that works on a microbatch (bubbles left out)."""
    slots = []
    for t in range(cfg.num_iterations):
        micro, repeat, valid = schedule.stage_work(cfg, t, xp=np)
        slots += [
            (t, s, f"iteration {t}/stage {s} (microbatch {micro[s]}, repeat {repeat[s]})")
            for s in range(cfg.num_stages)
            if valid[s]
        ]
    return slots


def _with_slots(cfg: Config, history: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """The stage outputs after every iteration `[T, S, ...]` and, picked out of them in the same
    program, the working slots' outputs."""
    return history, [history[t, s] for t, s, _ in _working_slots(cfg)]


@functools.cache
def _linen_trace(cfg: Config, mesh):
    pipe = linen_pipeline.Pipeline(cfg, mesh)
    return jax.jit(
        lambda params, x, pos: _with_slots(
            cfg, pipe.apply({"params": params}, x, pos, trace=True)[-1]
        )
    )


@twins.nnx_cache
def _nnx_trace(cfg: Config, mesh, mode):
    del mode
    graphdef = _nnx_graphdef(lambda rngs: nnx_pipeline.Pipeline(cfg, mesh, rngs=rngs))
    return jax.jit(
        lambda params, x, pos: _with_slots(cfg, nnx.merge(graphdef, params)(x, pos, trace=True)[-1])
    )
