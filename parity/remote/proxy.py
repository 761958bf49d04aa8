"""`RemoteSide`: a `Side` whose model lives in a worker process (`parity.remote.worker`).

Native weights, trainers and optimizer states stay in the worker under handles
(`RemoteTree`); the common form travels (Linen's variables: arrays with their logical names,
boxed again here), and so do runs, plain trees and the facts of the compiled program (its HLO
before and after optimisation, memory, cost, and the shardings of its inputs and outputs,
rebuilt here on a mesh of the same devices). The checks call it as they call any Side.

Errors keep their meaning across the process boundary: the worker side's converter refusing a
tree is a `ConversionError` here, an exception of its model code a `SideError` (a parity
failure on the NNX side, bad input on the Linen side), a worker that dies or hangs
`WorkerLost` (exit 3).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from migrate.checkpoints.convert import ConversionError
from migrate.checkpoints.weight_map import WeightMap
from parity.engine.side import ProgramArray, Run, Side, SideError, Trainer
from parity.multiprocess import distributed
from parity.remote import protocol
from parity.remote.client import Worker, WorkerError


@dataclasses.dataclass(frozen=True)
class RemoteRandomness:
    """What the `random` check reads of a worker's stochastic call: its draw count, and
    whether both sides take the same keys."""

    draws: int
    aligned: bool


@dataclasses.dataclass(eq=False)
class RemoteTree:
    """A tree held by a worker (native weights, an optimizer state), by handle."""

    side: RemoteSide
    handle: int


class RemoteProgram:
    """What the checks read of a compiled program, as the worker reported it: the texts of
    `jax.stages.Lowered` / `Compiled`, `memory_analysis()`, `cost_analysis()`."""

    def __init__(self, facts: dict[str, Any]) -> None:
        self.facts = facts

    def as_text(self, dialect: str | None = None, debug_info: bool = False) -> str:
        if dialect is not None or debug_info:
            return self.facts["lowered_text"]
        return self.facts["compiled_text"]

    def compile(self) -> RemoteProgram:
        return self

    def memory_analysis(self) -> Any:
        return type("MemoryAnalysis", (), dict(self.facts["memory"]))()

    def cost_analysis(self) -> dict[str, float]:
        return dict(self.facts["cost"])


class RemoteStep:
    """A trainer's step run in the worker: `(params, opt_state, batch) -> (params, opt_state,
    metrics)`, the returned state held there; `returned_mismatches` the arrays of the last
    step whose sharding is not the one the compiled step takes them with."""

    def __init__(self, side: RemoteSide, trainer: int) -> None:
        self.side, self.trainer = side, trainer
        self.returned_mismatches: list[dict] = []

    def __call__(self, params: RemoteTree, opt_state: RemoteTree, batch: Any):
        reply = self.side.call(
            "step",
            trainer=self.trainer,
            params=params.handle,
            opt_state=opt_state.handle,
            batch=self.side.worker.send_tree({"batch": distributed.to_host(batch)}),
        )
        self.returned_mismatches = reply["mismatches"]
        metrics = protocol.nest(self.side.worker.receive_tree(reply["metrics"])[0])
        return (
            RemoteTree(self.side, reply["params"]),
            RemoteTree(self.side, reply["opt_state"]),
            metrics,
        )


def _rebuilt_sharding(record: dict | None, meshes: dict) -> Any:
    if record is None:
        return None
    if "other" in record:
        return record["other"]
    key = (tuple(record["axis_names"]), tuple(record["shape"]), tuple(record["device_ids"]))
    if key not in meshes:
        by_id = {d.id: d for d in jax.devices()}
        missing = [i for i in record["device_ids"] if i not in by_id]
        if missing:
            raise ValueError(f"the worker's mesh uses devices {missing} this process lacks")
        devices = np.array([by_id[i] for i in record["device_ids"]]).reshape(record["shape"])
        meshes[key] = Mesh(devices, tuple(record["axis_names"]))
    spec = [tuple(p) if isinstance(p, list) else p for p in record["spec"]]
    return NamedSharding(meshes[key], PartitionSpec(*spec))


class RemoteSide(Side):
    """One side of a pair, served by `worker` (already started with its factory)."""

    def __init__(self, worker: Worker, framework: str, weight_map: WeightMap | None = None) -> None:
        """`weight_map`: common form (source) -> this side's native paths and names (target),
        applied on the way in and back on the way out; None when they are the same."""
        self.worker, self.framework, self.weight_map = worker, framework, weight_map
        self._meshes: dict = {}

    def _mapped(self, tree: dict[str, Any], forward: bool) -> dict[str, Any]:
        """A tree (leaves boxed or not) through the weight map, names permuted and renamed."""
        if self.weight_map is None:
            return tree
        is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
        flat = {
            tuple(str(getattr(p, "key", p)) for p in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
        }
        values = {p: (x.value if is_box(x) else x) for p, x in flat.items()}
        names = {p: (tuple(x.names) if is_box(x) else None) for p, x in flat.items()}
        move = self.weight_map.forward if forward else self.weight_map.backward
        moved, renamed = move(values), self.weight_map.names(names, forward)
        return protocol.nest(
            {
                p: v if renamed[p] is None else nn.LogicallyPartitioned(v, renamed[p])
                for p, v in moved.items()
            }
        )

    # ------------------------------------------------------------ the wire

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        try:
            return self.worker.call(op, **args)
        except WorkerError as e:
            if e.remote_type in ("ConversionError", "WeightMapError"):
                raise ConversionError(f"{self.framework} worker", [str(e)]) from None
            if e.where == "model":
                error = SideError(self.framework, op, remote_exception(e))
                error.detail = e.detail  # the worker's traceback, not this process's
                raise error from None
            raise remote_exception(e) from None

    def _tree(self, manifest: dict) -> dict[str, Any]:
        return protocol.nest(self.worker.receive_tree(manifest)[0])

    def _boxed(self, manifest: dict) -> dict[str, Any]:
        """The common form as the worker sent it: each array placed here as the worker had it
        placed (same mesh devices, same spec), boxed with its logical names."""
        arrays, entries = self.worker.receive_tree(manifest)
        flat = {}
        for path, array in arrays.items():
            sharding = _rebuilt_sharding(entries[path]["placement"], self._meshes)
            value = jax.device_put(array, sharding) if hasattr(sharding, "spec") else array
            names = entries[path]["names"]
            flat[path] = value if names is None else nn.LogicallyPartitioned(value, names)
        return protocol.nest(flat)

    # ------------------------------------------------------------ weights

    def own_weights(self) -> RemoteTree:
        return RemoteTree(self, self.call("own_weights")["handle"])

    def to_common(self, weights: RemoteTree) -> dict[str, Any]:
        native = self._boxed(self.call("to_common", handle=weights.handle)["tree"])
        return self._mapped(native, forward=False)

    def from_common(self, variables: dict[str, Any]) -> RemoteTree:
        variables = self._mapped(variables, forward=True)
        is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
        leaves, names = [], {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(variables, is_leaf=is_box)[0]:
            key = tuple(str(getattr(p, "key", p)) for p in path)
            if is_box(leaf):
                names[key] = tuple(leaf.names)
                leaf = leaf.value
            leaves.append((key, distributed.to_host(leaf)))
        start = time.perf_counter()
        manifest = protocol.write_tree(self.worker.directory, leaves, names)
        self.worker.io_seconds += time.perf_counter() - start
        return RemoteTree(self, self.call("from_common", tree=manifest)["handle"])

    def plain(self, tree: Any) -> Any:
        if isinstance(tree, RemoteTree):
            return self._mapped(self._tree(self.call("plain", handle=tree.handle)["tree"]), False)
        return distributed.to_host(nn.meta.unbox(tree))

    # ------------------------------------------------------------ running

    def run(self, weights: RemoteTree) -> Run:
        reply = self.call("run", handle=weights.handle)
        parts = self._tree(reply["tree"])
        if "grads" in parts:
            parts["grads"] = self._mapped(parts["grads"], forward=False)
        return Run(**{name: parts.get(name) for name in reply["parts"]})

    # ------------------------------------------------------------ randomness

    def stochastic_calls(self) -> dict[int, tuple[str, Any]]:
        calls = self.call("stochastic_calls")["calls"]
        return {
            int(i): (name, RemoteRandomness(draws, aligned))
            for i, (name, draws, aligned) in calls.items()
        }

    def draws(self, weights: RemoteTree, index: int) -> Any:
        tree = self._tree(self.call("draws", handle=weights.handle, index=index)["tree"])
        return {"outputs": tree.get("outputs"), "sites": tree.get("sites") or {}}

    @functools.cache  # noqa: B019 (one program per weights; a side lives as long as its pair)
    def _program(self, handle: int) -> RemoteProgram:
        return RemoteProgram(self.call("program", handle=handle))

    def lowered(self, weights: RemoteTree) -> Any:
        return self._program(weights.handle)

    def compiled(self, weights: RemoteTree) -> Any:
        return self._program(weights.handle)

    def program_shardings(self, compiled: Any) -> dict[str, ProgramArray]:
        out = {}
        for label, record in compiled.facts["shardings"].items():
            actual = _rebuilt_sharding(record["actual"], self._meshes)
            declared = _rebuilt_sharding(record["declared"], self._meshes)
            out[label] = (actual, record["ndim"], declared)
        return out

    def trainer(self, weights: RemoteTree) -> Trainer | None:
        reply = self.call("trainer", handle=weights.handle)
        if reply["trainer"] is None:
            return None
        trainer = reply["trainer"]

        def evaluate(params: RemoteTree, batch: Any) -> Any:
            manifest = self.worker.send_tree({"batch": distributed.to_host(batch)})
            out = self.call("evaluate", trainer=trainer, params=params.handle, batch=manifest)
            return self._tree(out["tree"])["loss"]

        return Trainer(
            RemoteTree(self, reply["params"]),
            RemoteTree(self, reply["opt_state"]),
            RemoteStep(self, trainer),
            evaluate,
        )


class RemoteException(Exception):
    """An exception raised in the worker; `remote_exception` names its class as it was there,
    so that messages say `ValueError`, not the name of this wrapper."""

    detail = ""


def remote_exception(error: WorkerError) -> RemoteException:
    cls = type(error.remote_type, (RemoteException,), {"__module__": error.remote_module})
    made = cls(f"{error} (in worker {error.worker})")
    made.detail = error.detail
    return made
