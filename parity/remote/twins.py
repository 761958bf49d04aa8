"""The worker's factory for the decoder twins: one twin of a config, in the environment (and
checkout) the worker runs in. The harness names it `parity.remote.twins:make`.

Options: `config` (a model YAML), `overrides` (`key=value`), `framework` (`linen` or `nnx`),
and `patch` (`module:function`, called before anything is built: a test's injected bug, patched
at run time in the worker, never in the installed code). Runs in the worker's process, on its
imports of `migrate/` and `parity/`: another checkout's are that checkout's.
"""

from __future__ import annotations

import importlib
from typing import Any


def make(options: dict[str, Any], batch: Any) -> tuple[Any, Any]:
    if options.get("patch"):
        module_name, _, function = options["patch"].partition(":")
        getattr(importlib.import_module(module_name), function)()
    from migrate.common import axes, sharding
    from migrate.config.loading import load_config
    from parity.decoder.sides import LinenDecoderSide, NNXDecoderSide
    from parity.multiprocess import distributed

    cfg = load_config(options["config"], options.get("overrides", ()))
    mesh = sharding.make_mesh(cfg)
    batch_sharding = sharding.named_sharding(
        axes.BATCH_LENGTH_EMBED[:2], mesh, cfg.logical_axis_rules
    )

    def place_batch(host_batch: dict) -> dict:
        return {k: distributed.place(v, batch_sharding) for k, v in host_batch.items()}

    cls = LinenDecoderSide if options["framework"] == "linen" else NNXDecoderSide
    return cls(cfg, mesh, place_batch(batch)), place_batch
