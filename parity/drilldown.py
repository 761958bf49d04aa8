"""The `layers` check: where do the twins first part ways?

The whole decoder in data-flow order (reference layout, full batch): the embedding, every
submodule output of every layer (captured with Linen's `capture_intermediates` and NNX's
`nnx.capture(method_outputs=...)`), the final norm, the logits head and the loss; each part
fed Linen's input to it, so a bug shows in its own part and nowhere after. For pipelined
configs also the stage outputs after every pipeline iteration, naming the first iteration and
stage that differ.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from migrate import axes, convert, numerics, schedule
from migrate.config import Config
from migrate.linen import decoder as linen_decoder
from migrate.linen import layers as linen_layers
from migrate.linen import pipeline as linen_pipeline
from migrate.nnx import decoder as nnx_decoder
from migrate.nnx import layers as nnx_layers
from migrate.nnx import pipeline as nnx_pipeline
from parity import compare, distributed

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
    "mlp/wi_0",
    "mlp/wi_1",
    "mlp/wo",
    "mlp",
    "output",
)


# The decoder's parameters and outputs in data-flow order (layers by their submodule order).
_FLOW = ("token_embedder", "embedding", "pipeline", "layers", "decoder_norm", "logits_dense")


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
    becomes `output`; repeated calls (rotary on query and key) keep their index."""
    parts = [p.strip("[]") for p in path if p not in ("intermediates",)]
    call = parts.index("__call__")
    name = "/".join(parts[:call]) or "output"
    index = parts[call + 1] if call + 1 < len(parts) else "0"
    return name if index == "0" else f"{name}/{index}"


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


@functools.cache
def _linen_layer_fn(cfg: Config, mesh):
    layer = linen_layers.DecoderLayer(cfg, mesh)

    def apply(params, x, positions):
        out, state = layer.apply(
            {"params": params}, x, positions, capture_intermediates=True, mutable=["intermediates"]
        )
        return out, state["intermediates"]

    return jax.jit(apply)


def _nnx_graphdef(create) -> nnx.GraphDef:
    """The graphdef of the module `create(rngs)` builds, without allocating its weights."""
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: create(nnx.Rngs(0))))[0]


@functools.cache
def _nnx_layer_fn(cfg: Config, mesh, mode):
    del mode
    graphdef = _nnx_graphdef(lambda rngs: nnx_layers.DecoderLayer(cfg, mesh, rngs=rngs))

    def apply(params, x, positions):
        layer = nnx.merge(graphdef, params)
        out, captured = nnx.capture(layer, nnx.Intermediate, method_outputs=nnx.Intermediate)(
            x, positions
        )
        return out, nnx.to_pure_dict(captured)

    return jax.jit(apply)


def _order_key(name: str) -> int:
    return LAYER_ORDER.index(name) if name in LAYER_ORDER else len(LAYER_ORDER)


# The decoder outside its layers, in data-flow order: (record name, Linen params key).
OUTER_PARTS = ("embedding", "decoder_norm", "logits_dense", "loss")


def _linen_outer(cfg: Config, part: str):
    if part == "embedding":
        return linen_layers.Embed(cfg)
    if part == "decoder_norm":
        return linen_layers.RMSNorm(cfg)
    return linen_layers.DenseGeneral(
        (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg
    )


def _nnx_outer(cfg: Config, part: str, rngs: nnx.Rngs):
    if part == "embedding":
        return nnx_layers.Embed(cfg, rngs=rngs)
    if part == "decoder_norm":
        return nnx_layers.RMSNorm(cfg, rngs=rngs)
    return nnx_layers.DenseGeneral(
        (cfg.base_emb_dim,), (cfg.vocab_size,), axes.LOGITS_KERNEL, cfg, rngs=rngs
    )


@functools.cache
def _linen_outer_fn(cfg: Config, part: str):
    if part == "loss":
        return jax.jit(linen_decoder.cross_entropy_loss)
    module = _linen_outer(cfg, part)
    return jax.jit(lambda params, x: module.apply({"params": params}, x))


@functools.cache
def _nnx_outer_fn(cfg: Config, part: str, mode):
    del mode
    if part == "loss":
        return jax.jit(nnx_decoder.cross_entropy_loss)
    graphdef = _nnx_graphdef(lambda rngs: _nnx_outer(cfg, part, rngs))
    return jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))


_PARAMS_KEY = {
    "embedding": "token_embedder",
    "decoder_norm": "decoder_norm",
    "logits_dense": "logits_dense",
}


def _outer_record(
    session, part: str, params, names, x, targets=None
) -> tuple[Any, compare.LeafDiff]:
    """One part of the decoder outside its layers, both sides fed Linen's input to it:
    (Linen's output, the record)."""
    from parity import runs

    cfg = runs.compute_config(runs.schedule_free(session.cfg))
    linen_fn = _linen_outer_fn(cfg, part)
    nnx_fn = _nnx_outer_fn(cfg, part, runs.nnx_mode())
    if part == "loss":
        linen_out, nnx_out = linen_fn(x, targets), nnx_fn(x, targets)
    else:
        key = _PARAMS_KEY[part]
        boxed = convert.restore_boxes(jax.tree.map(jnp.asarray, params[key]), names[key])
        abstract = nnx.split(_abstract_outer(cfg, part))[1]
        nnx_params = convert.linen_to_nnx({"params": boxed}, abstract, renames={})
        linen_out = linen_fn(jax.tree.map(jnp.asarray, params[key]), x)
        nnx_out = nnx_fn(nnx_params, x)
    diff = compare.leaf_diff(part, nnx_out, linen_out)
    return linen_out, diff


def _abstract_outer(cfg: Config, part: str):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: _nnx_outer(cfg, part, nnx.Rngs(0)))


def layer_records(session, tol: compare.Tolerance) -> list[dict]:
    """The whole decoder in data-flow order, NNX against Linen, each part fed Linen's input to
    it (so a bug shows in its own part and nowhere after): the embedding, every submodule of
    every layer, the final norm, the logits head and the loss."""
    from parity import runs

    cfg, mesh = session.cfg, session.mesh
    ref_cfg = runs.schedule_free(cfg)
    host = distributed.to_host(session.linen_variables)
    if cfg.using_pipeline:
        host = convert.linen_pipeline_to_reference(host, cfg)
    params, names = convert.strip_boxes(host["params"])
    tokens = session.batch["inputs"]
    records = []
    x, diff = _outer_record(session, "embedding", params, names, tokens)
    records.append(_record(diff, tol))
    x = distributed.replicate(x, mesh)
    positions = distributed.replicate(
        jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), mesh
    )
    linen_fn = _linen_layer_fn(runs.compute_config(ref_cfg), mesh)
    nnx_fn = _nnx_layer_fn(runs.compute_config(ref_cfg), mesh, runs.nnx_mode())
    _, abstract_layer = nnx.split(nnx.eval_shape(lambda: _abstract_layer(ref_cfg, mesh)))
    for layer in range(cfg.base_num_decoder_layers):
        layer_params = jax.tree.map(lambda w, i=layer: w[i], params["layers"])
        layer_params = distributed.replicate(layer_params, mesh)
        layer_names = jax.tree.map(
            lambda n: n[1:], names["layers"], is_leaf=lambda n: isinstance(n, tuple)
        )
        boxed = convert.restore_boxes(jax.tree.map(jnp.asarray, layer_params), layer_names)
        nnx_params = convert.linen_to_nnx({"params": boxed}, abstract_layer, renames={})
        linen_out, linen_caps = linen_fn(layer_params, x, positions)
        _, nnx_caps = nnx_fn(nnx_params, x, positions)
        linen_caps, nnx_caps = _captures(linen_caps), _captures(nnx_caps)
        for name in sorted(set(linen_caps) | set(nnx_caps), key=_order_key):
            if name not in linen_caps or name not in nnx_caps:
                records.append(
                    {
                        "tensor": f"layer {layer}/{name}",
                        "passed": False,
                        "max_rel": float("inf"),
                        "mismatches": -1,
                        "nonfinite": 0,
                        "note": "captured on one side only",
                    }
                )
                continue
            diff = compare.leaf_diff(f"layer {layer}/{name}", nnx_caps[name], linen_caps[name])
            records.append(_record(diff, tol) | {"layer": layer})
        x = linen_out
    x, diff = _outer_record(session, "decoder_norm", params, names, x)
    records.append(_record(diff, tol))
    logits, diff = _outer_record(session, "logits_dense", params, names, x)
    records.append(_record(diff, tol))
    logits = jnp.asarray(logits, jnp.float32)
    _, diff = _outer_record(session, "loss", params, names, logits, session.batch["targets"])
    records.append(_record(diff, tol))
    return records


def _abstract_layer(cfg: Config, mesh):
    with nnx.use_eager_sharding(False):
        return nnx_layers.DecoderLayer(cfg, mesh, rngs=nnx.Rngs(0))


def _record(diff: compare.LeafDiff, tol: compare.Tolerance) -> dict:
    return {
        "tensor": diff.path,
        "max_abs": diff.max_abs,
        "max_rel": diff.max_rel,
        "ulp_at_scale": diff.ulp_at_scale,
        "mismatches": diff.mismatches,
        "nonfinite": diff.nonfinite_actual + diff.nonfinite_expected,
        "passed": diff.passes(tol),
    }


def iteration_records(session, tol: compare.Tolerance) -> list[dict]:
    """Stage outputs after every pipeline iteration, NNX against Linen, same weights and
    input; bubble slots are skipped (both compute on zeros there by design)."""
    from parity import runs

    cfg, mesh = session.cfg, session.mesh
    linen_vars = session.linen_variables
    nnx_params = runs.linen_to_nnx_params(cfg, mesh, linen_vars)
    linen_pipe_params = linen_vars["params"]["pipeline"]
    tokens = session.batch["inputs"]
    table = linen_vars["params"]["token_embedder"]["embedding"]
    x = jnp.take(table.value if hasattr(table, "value") else table, tokens, axis=0)
    x = x.astype(numerics.activation_dtype(cfg))
    positions = distributed.replicate(
        jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), mesh
    )
    linen_history = _linen_trace(runs.compute_config(cfg), mesh)(linen_pipe_params, x, positions)
    nnx_history = _nnx_trace(runs.compute_config(cfg), mesh, runs.nnx_mode())(
        nnx_params["pipeline"], x, positions
    )
    records = []
    for t in range(cfg.num_iterations):
        micro, repeat, valid = (np.asarray(a) for a in schedule.stage_work(cfg, t))
        for s in range(cfg.num_stages):
            if not valid[s]:
                continue
            diff = compare.leaf_diff(
                f"iteration {t}/stage {s} (microbatch {micro[s]}, repeat {repeat[s]})",
                nnx_history[t, s],
                linen_history[t, s],
            )
            records.append(_record(diff, tol) | {"iteration": t, "stage": s})
    return records


@functools.cache
def _linen_trace(cfg: Config, mesh):
    pipe = linen_pipeline.Pipeline(cfg, mesh)
    return jax.jit(lambda params, x, pos: pipe.apply({"params": params}, x, pos, trace=True)[1])


@functools.cache
def _nnx_trace(cfg: Config, mesh, mode):
    del mode
    graphdef = _nnx_graphdef(lambda rngs: nnx_pipeline.Pipeline(cfg, mesh, rngs=rngs))
    return jax.jit(lambda params, x, pos: nnx.merge(graphdef, params)(x, pos, trace=True)[1])
