"""Pipeline layout <-> reference layout of the decoder-layer weights (the placement formula).

The pipeline stacks a layer's weights as `[R, S, (L,) ...]` (R omitted when R == 1, L present
only with `scan_layers_per_stage`; otherwise in-stage layer j is its own subtree `layers_j`).
The reference stacks all N layers as `[N, ...]`. Since global layer `(r*S + s)*L + j` is the
row-major index of `(r, s, j)`, moving between the two is a reshape plus a split or stack of the
L axis. With a pipelined subset only the first P rows are reshaped so; the other N - P are the
`layers_after_pipeline` stack `[N-P, ...]` as they are (`migrate.common.placement`). Works on plain
arrays and on logical-name tuples alike, for either framework (docs/pipeline.md, "Weight
layouts").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from migrate.common import axes, placement
from migrate.config.contract import Config

Tree = Mapping[str, Any]


class LayoutError(ValueError):
    """A weight tree that does not have the layout the config describes."""


def _stage_keys(cfg: Config) -> list[str]:
    return (
        ["layers"]
        if cfg.scan_layers_per_stage
        else [f"layers_{j}" for j in range(cfg.layers_per_stage)]
    )


def _pipeline_lead(cfg: Config) -> tuple[int, ...]:
    """Leading shape of one stage subtree's leaves: (R,)? + (S,) + (L,)? ."""
    lead = (cfg.num_repeats,) if cfg.num_repeats > 1 else ()
    lead += (cfg.num_stages,)
    if cfg.scan_layers_per_stage:
        lead += (cfg.layers_per_stage,)
    return lead


def pipeline_lead_names(cfg: Config) -> tuple[str, ...]:
    """Logical names of the leading stacked axes of a pipeline weight."""
    names = (axes.CIRCULAR_REPEATS,) if cfg.num_repeats > 1 else ()
    names += (axes.STAGE,)
    if cfg.scan_layers_per_stage:
        names += (axes.LAYERS_PER_STAGE,)
    return names


def _check_lead(path: str, shape: tuple[int, ...], lead: tuple[int, ...]) -> None:
    if tuple(shape[: len(lead)]) != lead:
        raise LayoutError(
            f"{path}: shape {tuple(shape)} does not start with the stacked axes "
            f"{lead} that the config's pipeline layout needs"
        )


def pipeline_to_reference(stages: Tree, cfg: Config) -> dict:
    """The pipeline's `layers` subtree -> the reference's `layers` subtree (`[N, ...]` leaves)."""
    keys = _stage_keys(cfg)
    if sorted(stages) != sorted(keys):
        raise LayoutError(
            f"pipeline layers subtree has keys {sorted(stages)}, config expects {keys}"
        )
    lead = _pipeline_lead(cfg)
    n_layers = cfg.num_pipelined_layers

    def to_reference(*per_slot):
        for key, leaf in zip(keys, per_slot, strict=True):
            _check_lead(key, leaf.shape, lead)
        stack = np.stack if all(isinstance(w, np.ndarray) for w in per_slot) else jnp.stack
        stacked = (
            per_slot[0] if cfg.scan_layers_per_stage else stack(per_slot, axis=len(lead))
        )  # [R?, S, L, ...]
        return stacked.reshape(
            n_layers, *stacked.shape[len(lead) + (0 if cfg.scan_layers_per_stage else 1) :]
        )

    return jax.tree.map(to_reference, *(stages[k] for k in keys))


def reference_to_pipeline(reference: Tree, cfg: Config) -> dict:
    """The reference's `layers` subtree (`[N, ...]` leaves) -> the pipeline's `layers` subtree
    (from the pipelined rows only: `split_reference` first)."""
    _check_reference_rows(reference, cfg)
    lead = _pipeline_lead(cfg)
    shape_rsl = (cfg.num_repeats, cfg.num_stages, cfg.layers_per_stage)

    subset = placement.has_layers_after_pipeline(cfg)

    def split(leaf):
        rows = leaf[placement.pipelined_rows(cfg)] if subset else leaf  # no copy when all
        return rows.reshape(*shape_rsl, *leaf.shape[1:])

    per_rsl = jax.tree.map(split, reference)
    if cfg.scan_layers_per_stage:
        return {"layers": jax.tree.map(lambda w: w.reshape(*lead, *w.shape[3:]), per_rsl)}
    return {
        f"layers_{j}": jax.tree.map(lambda w, j=j: w[:, :, j].reshape(*lead, *w.shape[3:]), per_rsl)
        for j in range(cfg.layers_per_stage)
    }


def _check_reference_rows(reference: Tree, cfg: Config) -> None:
    n_layers = cfg.base_num_decoder_layers
    for leaf in jax.tree.leaves(reference):
        if leaf.shape[0] != n_layers:
            raise LayoutError(
                f"reference weight of shape {tuple(leaf.shape)}: leading axis "
                f"must be base_num_decoder_layers={n_layers}"
            )


def split_reference(reference: Tree, cfg: Config) -> tuple[dict, dict | None]:
    """The reference's `layers` subtree -> (the pipeline's `layers` subtree, the
    `layers_after_pipeline` stack `[N-P, ...]` or None when every layer is pipelined)."""
    stages = reference_to_pipeline(reference, cfg)
    if not placement.has_layers_after_pipeline(cfg):
        return stages, None
    return stages, jax.tree.map(lambda w: w[placement.rows_after_pipeline(cfg)], reference)


def join_reference(stages: Tree, after: Tree | None, cfg: Config) -> dict:
    """(the pipeline's `layers` subtree, the `layers_after_pipeline` stack or None) -> the
    reference's `layers` subtree: the pipelined rows, then the rows after the pipeline."""
    pipelined = pipeline_to_reference(stages, cfg)
    expected = cfg.num_layers_after_pipeline
    if (after is None) != (expected == 0):
        raise LayoutError(
            f"layers_after_pipeline is {'missing' if after is None else 'present'}, but the "
            f"config runs {expected} layers after the pipeline"
        )
    if after is None:
        return pipelined

    def concat(rows, rest):
        if rest.shape[0] != expected:
            raise LayoutError(
                f"layers_after_pipeline weight of shape {tuple(rest.shape)}: leading axis "
                f"must be num_layers_after_pipeline={expected}"
            )
        both = np.concatenate if all(isinstance(w, np.ndarray) for w in (rows, rest)) else None
        return (both or jnp.concatenate)([rows, rest], axis=0)

    return jax.tree.map(concat, pipelined, dict(after))


def pipeline_names_to_reference(names: tuple[str | None, ...], cfg: Config) -> tuple:
    """Logical names of a pipeline weight -> those of its reference twin."""
    lead = pipeline_lead_names(cfg)
    if tuple(names[: len(lead)]) != lead:
        raise LayoutError(f"logical names {names} do not start with {lead}")
    return (axes.REFERENCE_LAYERS, *names[len(lead) :])


def reference_names_to_pipeline(names: tuple[str | None, ...], cfg: Config) -> tuple:
    """Logical names of a reference weight -> those of its pipeline twin."""
    if not names or names[0] != axes.REFERENCE_LAYERS:
        raise LayoutError(f"logical names {names} do not start with {axes.REFERENCE_LAYERS!r}")
    return (*pipeline_lead_names(cfg), *names[1:])


def after_pipeline_names_to_reference(names: tuple[str | None, ...]) -> tuple:
    """Logical names of a `layers_after_pipeline` weight -> those of its reference twin."""
    if not names or names[0] != axes.LAYERS_AFTER_PIPELINE:
        raise LayoutError(f"logical names {names} do not start with {axes.LAYERS_AFTER_PIPELINE!r}")
    return (axes.REFERENCE_LAYERS, *names[1:])


def reference_names_to_after_pipeline(names: tuple[str | None, ...]) -> tuple:
    """Logical names of a reference weight -> those of its `layers_after_pipeline` twin."""
    if not names or names[0] != axes.REFERENCE_LAYERS:
        raise LayoutError(f"logical names {names} do not start with {axes.REFERENCE_LAYERS!r}")
    return (axes.LAYERS_AFTER_PIPELINE, *names[1:])
