"""JAX's distributed runtime for the parity harness: one global mesh over N processes.

Every device->host transfer of the harness goes through `to_host` and every host->device
placement through `place`; with one process both are exactly `jax.device_get` and
`jax.device_put`, so single-process results are unchanged. Import JAX only after XLA_FLAGS are
final (the CLI calls `initialize` right after it requested simulated devices).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from typing import Any

import jax
import numpy as np

from parity.multiprocess import coordinator

# Test hooks, read by the workers only: worker 1 dies (exit 7) or hangs right after initialize.
KILL_HOOK, HANG_HOOK = "PARITY_TEST_KILL_WORKER", "PARITY_TEST_HANG_WORKER"
INIT_TIMEOUT_S = 120  # default: how long a worker waits for the others to reach the coordinator


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    timeout_s: float = INIT_TIMEOUT_S,
) -> None:
    """Join the distributed runtime (CPU collectives over gloo), then apply the test hooks.

    Bounded (`parity.multiprocess.coordinator`): a coordinator that does not answer, or processes
    that do not all join within `timeout_s`, end this process with EXIT_WORKER and one line."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if process_id != 0:
        coordinator.wait_reachable(coordinator_address, timeout_s)
    what = f"joining {num_processes} processes at the coordinator {coordinator_address}"
    with coordinator.deadline(timeout_s, what):
        try:
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=int(timeout_s) + coordinator.JAX_MARGIN_S,
            )
            jax.devices()  # the backend's global device exchange: every process must reach it
        except Exception as e:  # the runtime could not start or connect: a lost coordinator
            coordinator.lost(f"{what}: {type(e).__name__}: {str(e).strip()[:300]}")
    if process_id == 1 and os.environ.get(KILL_HOOK) == "1":
        print("[parity] test hook: worker 1 dies", file=sys.stderr, flush=True)
        os._exit(7)
    if process_id == 1 and os.environ.get(HANG_HOOK) == "1":
        print("[parity] test hook: worker 1 hangs", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
        while True:
            time.sleep(3600)


def is_main() -> bool:
    """True on the process that prints and writes reports (process 0)."""
    return jax.process_index() == 0


# One gather program per group of leaves up to this size: a tree comes back in a few programs
# (a per-leaf gather compiled one program per leaf shape: 25 of a run's 51 compilations), while
# a large model is never replicated whole on every device at once.
GATHER_GROUP_BYTES = 1 << 30


@functools.cache
def _replicator(mesh: jax.sharding.Mesh) -> Any:
    """A jitted identity whose outputs are replicated over `mesh`: every process then holds
    every value (one collective program per group of leaves)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda *arrays: arrays, out_shardings=replicated)


def _gather_groups(arrays: list[jax.Array]) -> list[list[int]]:
    """Indices of `arrays`, grouped by mesh, each group at most GATHER_GROUP_BYTES (a larger
    array alone)."""
    groups: dict[Any, list[list[int]]] = {}
    sizes: dict[Any, int] = {}
    for i, x in enumerate(arrays):
        mesh = x.sharding.mesh
        if mesh not in groups or sizes[mesh] + x.nbytes > GATHER_GROUP_BYTES:
            groups.setdefault(mesh, []).append([])
            sizes[mesh] = 0
        groups[mesh][-1].append(i)
        sizes[mesh] += x.nbytes
    return [group for mesh_groups in groups.values() for group in mesh_groups]


def to_host(tree: Any) -> Any:
    """`jax.device_get`, but global arrays spanning other processes are gathered first.

    A collective when any leaf is not fully addressable: every process must call it in the
    same order (the harness is deterministic, so it does).
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    leaves, treedef = jax.tree.flatten(tree)
    spread = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array)
        and not x.is_fully_addressable
        and isinstance(x.sharding, jax.sharding.NamedSharding)
    ]
    for group in _gather_groups([leaves[i] for i in spread]):
        indices = [spread[i] for i in group]
        mesh = leaves[indices[0]].sharding.mesh
        gathered = _replicator(mesh)(*(leaves[i] for i in indices))
        for i, x in zip(indices, gathered, strict=True):
            leaves[i] = np.asarray(x.addressable_data(0))
    host = [_leaf_to_host(x) for x in leaves]
    return jax.tree.unflatten(treedef, host)


def _leaf_to_host(x: Any) -> Any:
    """One leaf on the host: local arrays fetched; a global one on another kind of sharding
    gathered alone (JAX's own process gather)."""
    if isinstance(x, jax.Array):
        if x.is_fully_addressable:
            return jax.device_get(x)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return x


def _put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # already global: reshard
    host = np.asarray(x)  # the same values on every process, by construction
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)` that also builds global arrays across processes.

    `shardings` is a tree prefix of `tree` (as for `jax.device_put`); every process must hold
    the same host values.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda x: _put(x, s), sub),
        shardings,
        tree,
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding),
    )


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Host leaves -> arrays replicated over `mesh`, placed shard by shard (left to `jit`, a
    host value split over some mesh axes and replicated over others is placed by a program of
    its own). With several processes, process-local arrays too; global arrays stay as they are,
    and so do arrays with one process (JAX moves them itself)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(x: Any) -> Any:
        if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
            return x
        return _put(x, replicated)

    return jax.tree.map(put, tree)


def worst_status(status: int) -> int:
    """The largest exit status over all processes (a collective; `status` with one process)."""
    if jax.process_count() == 1:
        return status
    from jax.experimental import multihost_utils

    statuses = multihost_utils.process_allgather(np.array([status], np.int32))
    return int(np.max(statuses))
