"""Simulated CPU devices for a config's mesh, requested before JAX is imported."""

from __future__ import annotations

import os
import re
import sys

from migrate.errors import BadInput

# XLA builds a thread pool and buffers per simulated device: thousands of them take minutes to
# start and hang at exit. 512 is 64 times the shipped configs' 8.
MAX_SIMULATED_DEVICES = 512
DEFAULT_DEVICES = 8  # the project's simulated CPU devices where XLA_FLAGS give no count
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


class DeviceCountError(BadInput):
    """A mesh that needs more simulated devices than `MAX_SIMULATED_DEVICES`."""


def ensure_simulated_devices(count: int) -> None:
    """Ask XLA for `count` host devices unless XLA_FLAGS already give enough; a no-op once JAX
    is imported. More than `MAX_SIMULATED_DEVICES` is refused (before JAX starts)."""
    if "jax" in sys.modules:
        return
    # With libtpu installed (`--topology`), JAX would otherwise try a TPU backend first and
    # log that this host has none; TPU programs are compiled for compile-only devices.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags_now = os.environ.get("XLA_FLAGS", "")
    found = _COUNT_FLAG.search(flags_now)
    if found and int(found.group(1)) >= count:
        return
    if count > MAX_SIMULATED_DEVICES:
        raise DeviceCountError(
            f"the mesh needs {count} devices; at most {MAX_SIMULATED_DEVICES} simulated CPU "
            "devices are supported (reduce the *_parallelism keys)"
        )
    flags_now = _COUNT_FLAG.sub("", flags_now).strip()
    os.environ["XLA_FLAGS"] = f"{flags_now} --xla_force_host_platform_device_count={count}".strip()
