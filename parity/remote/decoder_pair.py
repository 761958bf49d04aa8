"""The decoder twins of a config with each side in its own worker: `parity CONFIG
--linen_python=... --nnx_python=...` (and `--linen_path`, `--nnx_path`: another checkout).

The gate for "the model before my change" (one environment or checkout) against "after"
(another): both sides run the checkout and interpreter given for them, the harness only
compares. The engine's checks run as for the in-process pair; those that call the twins'
functions directly (pipeline against reference, bubbles, the drill-down, compile and efficiency
from abstract shapes) are not available across processes and are reported as skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from migrate.config.contract import Config
from parity.decoder.session import DecoderPair
from parity.multiprocess import distributed
from parity.remote.client import WorkerSet
from parity.remote.environments import Environment
from parity.remote.side import RemoteSide

FACTORY = "parity.remote.twins:make"


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

    def extra_roundtrip_records(self, source: str) -> list[dict]:
        return []  # the layout round trip runs the converters of this process, not the sides'
