"""The `golden` check of the decoder twins (`parity CONFIG --golden=DIR`): every parameter's
logical names, resolved PartitionSpec and shape, per framework, as sorted JSON, against the
report stored in DIR (written with `--update_golden`, or when there is none and none is
required: `parity.run_inputs.golden_required`), difference by difference."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from migrate.checkpoints import convert
from migrate.common import sharding
from migrate.config.contract import Config
from parity.decoder import twins
from parity.engine.result import CheckResult
from parity.reports import report
from parity.reports.outputs import Outputs


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


def golden_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Per-key differences between a stored golden sharding report and the current one."""
    lines = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            lines.append(f"- {key}: in golden, not in current")
        elif key not in expected:
            lines.append(f"+ {key}: new, not in golden: {actual[key]}")
        elif expected[key] != actual[key]:
            for field in sorted(set(expected[key]) | set(actual[key])):
                if expected[key].get(field) != actual[key].get(field):
                    lines.append(
                        f"~ {key}: {field}: golden {expected[key].get(field)} -> "
                        f"current {actual[key].get(field)}"
                    )
    return lines


def golden_result(pair: Any, outputs: Outputs, write: bool) -> CheckResult:
    """The `golden` check: the current sharding report of `pair`'s config against the golden
    file of `outputs` (written when there is none, or with --update_golden). `write`: this
    process writes and prints (process 0 of a multi-process run)."""
    path, current = outputs.golden, golden_sharding(pair.cfg, pair.mesh)
    if outputs.golden_data is None:
        if write:
            outputs.write_golden(current)
        message = (
            f"no golden file was at {path}: written from this run's sharding, nothing compared "
            "(commit it; under CI, or with --require_golden, a missing golden file is an error)"
            if outputs.golden_missing
            else f"rewritten with --update_golden: {path}; nothing compared"
        )
        return CheckResult("golden", True, "differences", 0.0, 0.0, str(path), message=message)
    differences = golden_differences(outputs.golden_data, current)
    if write:
        report.print_golden_differences(differences)
    return CheckResult(
        "golden",
        not differences,
        "differences",
        float(len(differences)),
        0.0,
        differences[0] if differences else str(path),
        details=tuple({"difference": d, "passed": False} for d in differences),
        message=f"compared with {path}"
        + ("; rerun with --update_golden to accept" if differences else ""),
    )
