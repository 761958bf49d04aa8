"""What a `parity` run is given, checked against its config before JAX starts: the checks it
selects, the report paths (`--plot` only with the train check, and in a format its extension
names), whether a missing golden file is bad input (`--require_golden`, by default under CI),
the bounds on the work of the selected checks, and the config a `--checkpoint` changes (each
key the tool sets is said). From `RunOptions` (`parity.cli` reads the flags); no JAX here."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from migrate.checkpoints import meta
from migrate.config.bounds import MAX_UNROLLED_LAYERS
from migrate.config.contract import Config
from migrate.config.loading import SCHEDULE_DEFAULTS, load_config, parse_overrides
from migrate.errors import BadInput
from migrate.runtime import memory
from parity.engine import registry  # no JAX
from parity.engine.registry import Front, Need
from parity.reports import report
from parity.reports.outputs import Outputs
from parity.reports.progress import progress
from parity.reports.run_facts import Adjusted, adjustments
from parity.run_options import RunOptions

# Truthy values of the CI variable (GitHub Actions, GitLab, Buildkite, CircleCI set `true`).
CI_VALUES = ("true", "1", "yes")


def select_checks(options: RunOptions, front: Front) -> list[str] | str:
    """The checks named by `--checks` (any the registry knows: `runnable` says which the front
    end runs), or the front end's defaults; a string says what is wrong."""
    known = [c.name for c in registry.REGISTRY if c.forms.keys() - {Front.MODULES}]
    if options.checks == ("all",):
        return list(registry.names(front))
    if options.checks is not None and not any(options.checks):  # `--checks=` or `--checks=,`
        return f"--checks: no checks selected; known checks: {', '.join(known)}, all"
    selected = list(options.checks or registry.defaults(front))
    unknown = [c for c in selected if c not in known]
    if unknown:
        return f"unknown checks {unknown}; known: {', '.join(known)}"
    return selected


def golden_required(options: RunOptions, environ: Mapping[str, str] = os.environ) -> bool:
    """A missing golden file is bad input: `--require_golden` as given, else under CI."""
    if options.require_golden is not None:
        return options.require_golden
    return environ.get("CI", "").strip().lower() in CI_VALUES


def outputs(options: RunOptions, model_name: str, selected: Sequence[str]) -> Outputs:
    """The report paths, checked (their folders created): BadInput for a `--plot` that
    nothing would draw or in a format not written, and for a missing golden file where one is
    required."""
    if options.plot:
        if "train" not in selected:
            raise BadInput(
                f"--plot={options.plot}: plots the train check's steps, and the checks "
                f"selected ({', '.join(selected)}) do not include train"
            )
        if options.steps == 0:
            raise BadInput(f"--plot={options.plot}: --steps=0 trains no step to plot")
        if report.plot_format(options.plot) is None:
            formats = ", ".join(f".{s}" for s in report.PLOT_FORMATS)
            raise BadInput(
                f"--plot={options.plot}: unknown image format {Path(options.plot).suffix!r}; "
                f"give {formats} (no extension: PNG)"
            )
    found = Outputs(
        json=options.json,
        junit=options.junit,
        plot=options.plot,
        golden=options.golden,
        update_golden=options.update_golden,
        model_name=model_name,
        require_golden=golden_required(options),
    )
    if found.golden_missing:
        progress(
            f"--golden: no golden file at {found.golden}: the run writes it from the current "
            "sharding (nothing is compared; under CI, or with --require_golden, a missing "
            "golden file is an error)"
        )
    return found


def check_work(options: RunOptions, cfg: Config, selected: Sequence[str]) -> None:
    """Bounds on what the selected checks would trace or allocate, before JAX."""
    if "efficiency" in selected and cfg.using_pipeline:
        # The efficiency check traces both sides unrolled: every pipeline iteration's L
        # layers, and the N layers of the reference.
        unrolled = max(cfg.num_iterations * cfg.layers_per_stage, cfg.base_num_decoder_layers)
        if unrolled > MAX_UNROLLED_LAYERS:
            raise BadInput(
                f"--checks=efficiency: traces {unrolled} layer applications unrolled (pipeline "
                f"iterations {cfg.num_iterations} x L={cfg.layers_per_stage}, or "
                f"N={cfg.base_num_decoder_layers}); at most {MAX_UNROLLED_LAYERS}"
            )
    abstract = registry.needing(Need.ABSTRACT, selected)
    allocating = [c for c in selected if c not in abstract]
    if allocating and options.memory_check:
        share = 1 / options.num_processes if options.process_id is not None else 1.0
        memory.check_fits(memory.estimate(cfg, copies=2), share, f"--checks={','.join(allocating)}")


def checkpoint_config(
    path: Path, overrides: Sequence[str], stored: dict[str, Any]
) -> tuple[Config, list[Adjusted]]:
    """The config a checkpoint's weights run under (`meta.stored_config`: its recorded layout
    and weight dtype win, a schedule key that no longer fits resets), and each key it set to
    another value than the config and `overrides` asked, said in a progress line."""
    changes = parse_overrides(overrides)
    base = load_config(path)
    cfg = meta.stored_config(stored, base, changes)
    asked = {**base.to_dict(), **changes}
    reasons = {key: "the checkpoint's recorded layout" for key in meta.LAYOUT_KEYS}
    reasons["weight_dtype"] = "the checkpoint's weight dtype"
    if stored["layout"] == "reference":
        reasons |= {
            k: "a reference-layout checkpoint runs without a pipeline" for k in meta.REFERENCE_KEYS
        }
    reset = f"reset to its default, M={cfg.num_microbatches}: the value does not fit the layout"
    reasons |= dict.fromkeys(SCHEDULE_DEFAULTS, reset)
    adjusted = adjustments(asked, cfg.to_dict(), reasons)
    for change in adjusted:
        progress(f"--checkpoint changed {change.describe()}")
    return cfg, adjusted


def checkpoint_weights(checkpoint: str, stored: dict[str, Any]) -> dict[str, Any]:
    """The JSON report's `weights` of a run on a checkpoint's weights."""
    return {
        "source": "checkpoint",
        "path": str(Path(checkpoint).absolute()),
        "framework": stored["framework"],
        "layout": stored["layout"],
        "step": stored["step"],
        "model_name": stored["model_name"],
    }
