"""The decoder twins of a config with each side in its own worker: `parity CONFIG
--linen_python=... --nnx_python=...` (and `--linen_path`, `--nnx_path`: another checkout).

The gate for "the model before my change" (one environment or checkout) against "after"
(another): both sides run the checkout and interpreter given for them, the harness only
compares. The engine's checks run as for the in-process pair; those that call the twins'
functions directly (`registry.Need.IN_PROCESS`: pipeline against reference, bubbles, the drill-down,
compile and efficiency from abstract shapes) are not available across processes.

Two halves: `make`, the worker's factory (`parity.decoder.remote_twins:make`, run in the
worker's process on its own imports of `migrate/` and `parity/`: another checkout's are that
checkout's), and `RemoteDecoderPair`, the harness's pair over the two workers.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from migrate.config.contract import Config
from parity.decoder.session import DecoderPair
from parity.multiprocess import distributed
from parity.remote.client import WorkerSet
from parity.remote.environments import Environment
from parity.remote.proxy import RemoteSide

FACTORY = "parity.decoder.remote_twins:make"


def make(options: dict[str, Any], batch: Any) -> tuple[Any, Any]:
    """One twin of a config, in the worker. Options: `config` (a model YAML), `overrides`
    (`key=value`), `framework` (`linen` or `nnx`), and `patch` (`module:function`, called before
    anything is built: a test's injected bug, patched at run time in the worker, never in the
    installed code)."""
    if options.get("patch"):
        module_name, _, function = options["patch"].partition(":")
        getattr(importlib.import_module(module_name), function)()
    from migrate.common import axes, sharding
    from migrate.config.loading import load_config
    from parity.decoder.sides import LinenDecoderSide, NNXDecoderSide

    cfg = load_config(options["config"], options.get("overrides", ()))
    mesh = sharding.make_mesh(cfg)
    batch_sharding = sharding.named_sharding(
        axes.BATCH_LENGTH_EMBED[:2], mesh, cfg.logical_axis_rules
    )

    def place_batch(host_batch: dict) -> dict:
        return {k: distributed.place(v, batch_sharding) for k, v in host_batch.items()}

    cls = LinenDecoderSide if options["framework"] == "linen" else NNXDecoderSide
    return cls(cfg, mesh, place_batch(batch)), place_batch


class RemoteDecoderPair(DecoderPair):
    """`DecoderPair` whose two sides are `RemoteSide`s, each in its environment's worker."""

    def __init__(
        self,
        cfg: Config,
        config_path: str | Path,
        overrides: Sequence[str],
        environments: dict[str, Environment],
    ) -> None:
        self.config_path, self.overrides = str(config_path), list(overrides)
        self.environments = environments
        self.workers = WorkerSet()
        with self.workers.closed_on_failure():  # one side failed: the other one stops too
            super().__init__(cfg)

    def _side(self, framework: str, cfg: Config | None = None, **variant: Any) -> RemoteSide:
        if cfg is not None or variant:
            raise NotImplementedError("a variant of a twin runs in this process only")
        options = {
            "config": str(Path(self.config_path).resolve()),
            "overrides": self.overrides,
            "framework": framework,
        }
        batch = distributed.to_host(self.train_batch)
        worker = self.workers.start(
            framework, self.environments[framework], FACTORY, options, batch
        )
        return RemoteSide(worker, framework)

    def accumulation_records(self) -> list[dict]:
        return []  # one step on the whole batch is a variant of a twin: in-process runs only

    def extra_roundtrip_records(self, source: str) -> list[dict]:
        return []  # the layout round trip runs the converters of this process, not the sides'
