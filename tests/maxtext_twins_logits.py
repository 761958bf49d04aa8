"""The twins on MaxText-trained weights: a MaxText checkpoint's parameters in MaxText's own
decoder (its release's worker, `parity.maxtext.decoder_factory`) and, mapped by
`migrate.checkpoints.maxtext_layouts`, in the twins' Linen decoder (reference and pipeline), on
the same tokens; the logits and the loss compared.

The tier: MaxText's decoder and the twins' compute the same math but not the same program (the
query scale applied to the kernel vs in the forward pass, MaxText's pipeline vs the twins'
reference or pipeline on other shapes), so the comparison is held to
`compare.F32_RESHAPED` (float32, 64 ulp at scale); the measured errors are in
`docs/checkpoints.md`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from migrate.checkpoints import maxtext_layouts
from migrate.config.contract import Config
from parity.analysis import compare
from parity.maxtext import gate_config, release_pair
from parity.maxtext.gate_config import MaxTextConfig
from parity.remote import protocol
from parity.remote.client import WorkerSet
from parity.remote.environments import Environment
from parity.remote.proxy import RemoteSide

TOLERANCE = compare.F32_RESHAPED


def maxtext_run(
    checkpoint: Path, config: MaxTextConfig, environment: Environment, framework: str, batch: dict
) -> Any:
    """MaxText's own `Run` (logits, loss as its trainer normalises it) on the checkpoint's
    parameters, in the release's worker."""
    params = {
        p[2:]: a
        for p, a in maxtext_layouts.read(checkpoint).items()
        if p[:2] == maxtext_layouts.PREFIX
    }
    workers = WorkerSet()
    try:
        worker = workers.start(
            framework,
            environment,
            release_pair.FACTORY,
            {"framework": framework, "overrides": config.keys},
            batch,
            gate_config.worker_variables(),
        )
        side = RemoteSide(worker, framework, None)
        return side.run(side.from_common({"params": protocol.nest(params)}))
    finally:
        workers.close()


def twins_logits(checkpoint: Path, cfg: Config, batch: dict, use_pipeline: bool) -> Any:
    """The twins' Linen decoder's `Run` on the checkpoint's parameters (mapped)."""
    from migrate.checkpoints import convert
    from migrate.common import sharding
    from parity.decoder import twins

    mapped = maxtext_layouts.to_twins(maxtext_layouts.read(checkpoint), cfg.head_dim)["params"]
    mesh = sharding.make_mesh(cfg)
    abstract = twins.linen_abstract_variables(cfg, mesh, use_pipeline=False)
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    boxes = convert.flatten_dict(jax.tree.map(lambda b: b, abstract["params"], is_leaf=is_box))
    variables = {
        "params": convert.unflatten_dict({p: b.replace_boxed(mapped[p]) for p, b in boxes.items()})
    }
    if use_pipeline:
        variables = convert.linen_reference_to_pipeline(variables, cfg)
    placed = twins.place_linen(variables, cfg, mesh, use_pipeline)
    host = {"inputs": batch["inputs"], "targets": batch["targets"]}
    placed_batch = {
        k: jax.device_put(v, sharding.batch_sharding(cfg, mesh)) for k, v in host.items()
    }
    return twins.run_linen(cfg, mesh, placed, placed_batch, use_pipeline)


def measure(
    checkpoint: Path,
    config: MaxTextConfig,
    cfg: Config,
    environment: Environment,
    framework: str = "linen",
    layouts: tuple[str, ...] = ("reference", "pipeline"),
) -> dict[str, Any]:
    """Logits and loss of MaxText (the release of `framework`) against the twins' decoders in
    `layouts` on the checkpoint's weights: each one's `LeafDiff`."""
    batch = release_pair.batch(config.keys, config.num_devices, 0, 0, "train")
    theirs = maxtext_run(checkpoint, config, environment, framework, batch)
    out = {}
    for layout in layouts:
        ours = twins_logits(checkpoint, cfg, batch, layout == "pipeline")
        out[layout] = {
            name: compare.leaf_diff(name, np.asarray(mine), np.asarray(other))
            for name, mine, other in (
                ("logits", ours.outputs, theirs.outputs),
                ("loss", ours.loss, theirs.loss),
            )
        }
    return out
