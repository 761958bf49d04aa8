"""MaxText's mesh as MaxText sizes it: the `ici_*` and `dcn_*` axes of a config, MaxText's own
defaults for those it leaves out, and a -1 ("the devices left") filled as MaxText's mesh
builder (`create_device_mesh`) fills it: the ICI one with a slice's devices over the other ICI
axes, the DCN one with the slices over the other DCN axes; at most one per level. The devices
are a TPU slice's (`--topology`) or the simulated CPU devices. No JAX.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from migrate.errors import BadInput
from migrate.runtime.devices import DEFAULT_DEVICES

ICI = re.compile(r"^ici_(\w+)_parallelism$")
DCN = re.compile(r"^dcn_(\w+)_parallelism$")

# MaxText's own defaults for the mesh axes a config leaves out (both releases' base.yml): the
# rest 1. A -1 is "the devices left": at most one per level, filled by MaxText's mesh builder
# (`create_device_mesh`) with the slice's devices (ICI) or the slices (DCN) over the others.
MESH_DEFAULTS = {"ici_fsdp_parallelism": -1, "dcn_data_parallelism": -1}


def devices_per_slice(
    keys: dict[str, Any], topology: str | None, slices_given: int | None = None
) -> tuple[int | None, int]:
    """(the devices of one slice a -1 ICI axis fills, or None where the mesh sets the count,
    the slices a -1 DCN axis fills): the TPU slice's devices with `topology`, else the
    simulated CPU devices (XLA_FLAGS' count, or 8), one slice per DCN product."""
    if topology is not None:
        from parity.tpu import topologies  # no JAX

        return topologies.parse(topology).devices_per_slice, slices_given or num_slices(keys)
    ici = {**{k: v for k, v in MESH_DEFAULTS.items() if ICI.match(k)}, **keys}
    auto = any(v == -1 for k, v in ici.items() if ICI.match(k))
    return (simulated_devices() if auto else None), num_slices(keys)


def simulated_devices() -> int:
    """The CPU devices a -1 ICI axis fills: XLA_FLAGS' simulated count, else the project's 8."""
    found = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(found[1]) if found else DEFAULT_DEVICES


def resolve_mesh(
    keys: dict[str, Any], per_slice: int | None, slices: int, path: Any = "config"
) -> dict[str, int]:
    """Every mesh axis of `keys` (and MaxText's defaults, `MESH_DEFAULTS`) with a -1 filled as
    MaxText fills it: the ICI one with `per_slice` devices over the other ICI axes, the DCN
    one with `slices` over the other DCN axes. BadInput for two -1 on one level, or devices
    the other axes do not divide (both numbers named)."""
    axes = {**MESH_DEFAULTS, **{k: v for k, v in keys.items() if ICI.match(k) or DCN.match(k)}}
    out = dict(axes)
    for level, pattern, total, what in (
        ("ICI", ICI, per_slice, "devices of a slice"),
        ("DCN", DCN, slices, "slices"),
    ):
        mine = {k: v for k, v in axes.items() if pattern.match(k)}
        auto = [k for k, v in mine.items() if v == -1]
        if len(auto) > 1:
            raise BadInput(
                f"{path}: {', '.join(f'{k}=-1' for k in auto)}: MaxText fills at most one "
                f"{level} axis with the {what} left"
            )
        if not auto:
            continue
        others = math.prod(v for v in mine.values() if v != -1)
        if total is None or total % others:
            raise BadInput(
                f"{path}: {auto[0]}=-1: the other {level} axes multiply to {others}, which does "
                f"not divide the {total} {what}"
            )
        out[auto[0]] = total // others
    return out


def dcn_auto(keys: dict[str, Any]) -> bool:
    """Whether a `dcn_*` axis is -1, which MaxText fills with the slices left."""
    return any(v == -1 for k, v in keys.items() if DCN.match(k))


def num_slices(keys: dict[str, Any]) -> int:
    """The slices a config's mesh spans: the product of its `dcn_*` axes that are set (a -1,
    "the rest", counts as one)."""
    return math.prod(v for k, v in keys.items() if DCN.match(k) and _is_count(v))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
