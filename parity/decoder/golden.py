"""Golden sharding reports of the decoder twins: every parameter's logical names, resolved
PartitionSpec and shape, per framework, as sorted JSON (`parity CONFIG --golden=DIR`); the
per-key differences against a stored one are `parity.reports.report.golden_differences`."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from migrate.checkpoints import convert
from migrate.common import sharding
from migrate.config.contract import Config
from parity.decoder import twins


def golden_sharding(cfg: Config, mesh: Mesh) -> dict[str, dict[str, Any]]:
    """Per parameter and framework: logical names, PartitionSpec, shape (sorted JSON-ready).
    From abstract weights: a golden report never allocates the model."""
    rules = cfg.logical_axis_rules
    out: dict[str, dict[str, Any]] = {}
    linen = twins.linen_abstract_variables(cfg, mesh)["params"]
    arrays, names = convert.strip_boxes(linen)
    flat_arrays, flat_names = convert.flatten_dict(arrays), convert.flatten_dict(names)
    for path, leaf_names in flat_names.items():
        out["linen/" + "/".join(path)] = {
            "names": list(leaf_names),
            "shape": list(flat_arrays[path].shape),
            "spec": str(sharding.logical_to_spec(leaf_names, rules)),
        }
    _, abstract = twins.nnx_abstract(cfg, mesh)
    for path, variable in convert.nnx_flat_params(abstract).items():
        leaf_names = convert.nnx_names(variable)
        out["nnx/" + "/".join(path)] = {
            "names": list(leaf_names or ()),
            "shape": list(variable.get_value().shape),
            "spec": str(sharding.logical_to_spec(leaf_names or (), rules)),
        }
    return dict(sorted(out.items()))
