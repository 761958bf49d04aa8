"""What a `parity` run ran, for its reports: the config file and its base, the overrides as
given, the resolved config, the versions of Python, JAX and Flax, the weights' source, and every
key the tool set to another value than the config and overrides asked (a checkpoint's recorded
layout, a schedule key reset to fit it). The JSON report's `run` field (docs/report-schema.md)
and the verdict table's title. No JAX here: versions are read from the installed packages
(`cli_help.versions`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from migrate.runtime.cli_help import versions


@dataclasses.dataclass(frozen=True)
class Adjusted:
    """A key the tool set to `used` where the config and overrides asked for `asked`."""

    key: str
    asked: Any
    used: Any
    why: str

    def describe(self) -> str:
        return f"{self.key}={self.asked} -> {self.used} ({self.why})"

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def adjustments(
    asked: Mapping[str, Any], used: Mapping[str, Any], reasons: Mapping[str, str]
) -> list[Adjusted]:
    """The keys of `reasons` whose value in `used` differs from `asked`, each with its reason."""
    return [
        Adjusted(key, asked[key], used[key], why)
        for key, why in reasons.items()
        if key in asked and key in used and asked[key] != used[key]
    ]


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What one run ran: see the module's docstring. `weights`: `{"source": "init", "seed":
    N}` or `{"source": "checkpoint", "path": ..., ...}`; `resolved`: every key's value as
    validated, and the values derived from them."""

    config_file: str
    base_file: str
    overrides: tuple[str, ...]
    resolved: Mapping[str, Any]
    weights: Mapping[str, Any]
    adjusted: tuple[Adjusted, ...] = ()

    def title(self, model_name: str) -> str:
        """The table's title: the model, the overrides as given, the weights when not the
        twins' own initialisations."""
        parts = [model_name, *self.overrides]
        if self.weights.get("source") == "checkpoint":
            parts.append(f"(weights: checkpoint {self.weights['path']})")
        return " ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {
            "config_file": self.config_file,
            "base_file": self.base_file,
            "overrides": list(self.overrides),
            "resolved_config": dict(self.resolved),
            "versions": versions(),
            "weights": dict(self.weights),
            "adjusted": [a.as_json() for a in self.adjusted],
        }


def twins_facts(
    config_file: Path,
    base_file: Path,
    overrides: Sequence[str],
    cfg: Any,
    weights: Mapping[str, Any],
    adjusted: Sequence[Adjusted] = (),
) -> RunFacts:
    """The facts of a `parity CONFIG` run of `cfg` (a `Config`)."""
    derived = {
        "num_stages": cfg.num_stages,
        "num_microbatches": cfg.num_microbatches,
        "num_repeats": cfg.num_repeats,
        "layers_per_stage": cfg.layers_per_stage,
        "num_devices": cfg.num_devices,
        "global_batch_size": cfg.global_batch_size,
        "train_batch_size": cfg.train_batch_size,
    }
    return RunFacts(
        str(config_file),
        str(base_file),
        tuple(overrides),
        {**cfg.to_dict(), "derived": derived},
        weights,
        tuple(adjusted),
    )


def maxtext_facts(
    config_file: Path, base_file: Path, overrides: Sequence[str], config: Any
) -> RunFacts:
    """The facts of a `parity maxtext CONFIG` run of `config` (a `gate_config.MaxTextConfig`):
    its MaxText keys and mesh; each release builds its own initialisation from the keys."""
    resolved = {**config.keys, "mesh": dict(config.mesh), "num_devices": config.num_devices}
    weights = {"source": "init", "of": "each release's own initialisation"}
    return RunFacts(str(config_file), str(base_file), tuple(overrides), resolved, weights)
