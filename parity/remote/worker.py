"""The worker: serves one `Side`, built in this process's environment, to a harness in another.

    python -m parity.remote.worker DIRECTORY      (DIRECTORY: where both exchange `.npy` files)

The first request, `start`, names the FACTORY (`module:function`), called with its `options`
and the pair's batch; it returns `(side, place_batch)`: the Side to serve and a function that
puts a host batch where the side's programs want it. The factory's module may declare, beside
it (the worker reads them; none is required):
- `CONFIG_READERS`: `(module, function)` pairs the factory calls to read its config or build
  its mesh: an exception (or `SystemExit`) raised inside one of them, called by the factory
  itself, is the config's fault (bad input), not the tool's;
- `PACKAGES`: distribution names whose installed versions the worker reports (`start`'s
  `packages`, and the `release` of a config error);
- `config_error_line(message) -> str`: a config error's message as one short line (the first
  line, shortened, where the module declares none).
- `PRELOAD`: modules a fork server of the environment imports before it forks this factory's
  workers (`parity.remote.forkserver`): the expensive imports `make` reaches, none that starts
  JAX's backend or a thread.

Requests arrive on stdin, one JSON object per line: `{"op": ..., ...}`; each gets exactly one
reply line on stdout: `{"ok": {...}}` or `{"error": {"type", "module", "message", "detail",
"where"}}`, `where` being `model` for an exception of the side's own code (its model, its
converters), `config` for one raised by a config reader (bad input; with `release` and
`summary`), and `worker` for one of this server; with `"compiles"`, the XLA compilations the
call made (`parity.engine.compiles` events), which the harness counts as its own. Anything else
the side prints goes to stderr (stdout is the protocol's). Native weights, trainers and
optimizer states stay here, under integer handles; only the common form, plain trees and
results travel.

Imports nothing of the project at the top but `parity.remote.protocol` (stdlib and numpy): the
factory brings what its side needs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parity.remote import protocol


class _ModelError(Exception):
    """An exception of the served side's own code, carried to the reply: `where` `model`, or
    `config` for one a config reader raised (`facts`: the release and the one-line summary,
    added to the reply)."""

    def __init__(self, error: BaseException, where: str = "model", **facts: str) -> None:
        super().__init__(str(error))
        self.error, self.where, self.facts = error, where, facts


def raised_reading_config(
    error: BaseException, factory: Callable, readers: tuple[tuple[str, str], ...]
) -> bool:
    """Whether `error` came out of a call to one of `readers` (`(module, function)`) made by
    `factory` itself."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    code = getattr(factory, "__code__", None)
    for caller, called in itertools.pairwise(frames):
        if caller.f_code is code:
            where = (called.f_globals.get("__name__"), called.f_code.co_name)
            return where in readers
    return False


def first_line(message: str, limit: int = 300) -> str:
    """A message's first non-blank line, shortened to `limit` characters."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    line = lines[0] if lines else "(no message)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _model(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as e:
        raise _ModelError(e) from e


def _path_part(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class Server:
    """One side, its handles, and the ops the harness may call."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.side: Any = None
        self.place_batch: Callable[[Any], Any] = lambda batch: batch
        self.held: dict[int, Any] = {}
        self.next_handle = 0
        self.io_seconds = 0.0  # writing and reading array files
        self.compiles: Any = None  # `parity.engine.compiles` once the side is built
        self.compiles_sent = 0

    # -------------------------------------------------------------- trees

    def hold(self, value: Any) -> int:
        self.next_handle += 1
        self.held[self.next_handle] = value
        return self.next_handle

    def send_tree(self, tree: Any) -> dict[str, Any]:
        """Every leaf to a file: `LogicallyPartitioned` boxes unboxed (their names kept by
        path), each array's placement recorded."""
        import flax.linen as nn
        import jax

        names: dict[tuple[str, ...], tuple] = {}
        placements: dict[tuple[str, ...], dict | None] = {}
        leaves = []
        is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
            key = tuple(_path_part(p) for p in path)
            if is_box(leaf):
                names[key] = tuple(leaf.names)
                leaf = leaf.value
            placements[key] = _one_sharding(getattr(leaf, "sharding", None))
            leaves.append((key, jax.device_get(leaf)))
        start = time.perf_counter()
        manifest = protocol.write_tree(self.directory, leaves, names, placements)
        self.io_seconds += time.perf_counter() - start
        return manifest

    def boxed(self, manifest: dict[str, Any]) -> Any:
        """A manifest back as a tree, leaves with logical names boxed as Linen's variables."""
        import flax.linen as nn

        start = time.perf_counter()
        arrays, entries = protocol.read_tree(self.directory, manifest)
        self.io_seconds += time.perf_counter() - start
        flat = {}
        for path, array in arrays.items():
            names = entries[path]["names"]
            flat[path] = array if names is None else nn.LogicallyPartitioned(array, names)
        return protocol.nest(flat)

    def batch(self, manifest: dict[str, Any]) -> Any:
        start = time.perf_counter()
        tree = protocol.nest(protocol.read_tree(self.directory, manifest)[0])
        self.io_seconds += time.perf_counter() - start
        return self.place_batch(tree.get("batch", tree))

    # -------------------------------------------------------------- ops

    def new_compiles(self) -> list:
        """The compilations (and persistent-cache reads) since the last reply: the harness
        counts them in the check that made this call."""
        if self.compiles is None:
            return []
        events, self.compiles_sent = self.compiles.events_after(self.compiles_sent)
        return events

    def op_start(self, factory: str, options: dict, batch: dict) -> dict:
        from parity.engine import compiles  # imports JAX: only once the harness asks for a side

        compiles.listen()
        self.compiles = compiles
        from importlib import metadata

        module_name, _, function = factory.partition(":")
        module = importlib.import_module(module_name)
        make = getattr(module, function)
        host_batch = protocol.nest(protocol.read_tree(self.directory, batch)[0])
        packages = {}
        for name in getattr(module, "PACKAGES", ()):
            with contextlib.suppress(metadata.PackageNotFoundError):
                packages[name] = metadata.version(name)
        try:
            self.side, self.place_batch = make(options, host_batch.get("batch"))
        except (Exception, SystemExit) as e:  # a config reader may exit instead of raising
            if not raised_reading_config(e, make, getattr(module, "CONFIG_READERS", ())):
                raise _ModelError(e) from e
            release = " ".join(f"{k} {v}" for k, v in packages.items())
            cause = e.__context__ if isinstance(e, SystemExit) and e.__context__ else e
            summarise = getattr(module, "config_error_line", first_line)
            raise _ModelError(
                cause, "config", release=release, summary=summarise(str(cause))
            ) from e
        import flax
        import jax

        return {
            "packages": packages,
            "framework": self.side.framework,
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "flax": flax.__version__,
            "devices": jax.device_count(),
        }

    def op_own_weights(self) -> dict:
        weights = _model(self.side.own_weights)
        return {"handle": self.hold(weights)}

    def op_to_common(self, handle: int) -> dict:
        common = _model(lambda: self.side.to_common(self.held[handle]))
        return {"tree": self.send_tree(common)}

    def op_from_common(self, tree: dict) -> dict:
        variables = self.boxed(tree)
        weights = _model(lambda: self.side.from_common(variables))
        return {"handle": self.hold(weights)}

    def op_plain(self, handle: int) -> dict:
        return {"tree": self.send_tree(_model(lambda: self.side.plain(self.held[handle])))}

    def op_run(self, handle: int) -> dict:
        run = _model(lambda: self.side.run(self.held[handle]))
        parts = {k: getattr(run, k) for k in ("loss", "outputs", "grads", "grad_norm", "aux_loss")}
        present = {k: v for k, v in parts.items() if v is not None}
        return {"tree": self.send_tree(present), "parts": sorted(present)}

    def op_stochastic_calls(self) -> dict:
        """The side's stochastic calls: index -> (name, draws, whether their keys align)."""
        calls = _model(self.side.stochastic_calls)
        return {
            "calls": {
                str(i): [name, randomness.draws, randomness.aligned]
                for i, (name, randomness) in calls.items()
            }
        }

    def op_draws(self, handle: int, index: int) -> dict:
        draws = _model(lambda: self.side.draws(self.held[handle], index))
        return {"tree": self.send_tree(draws)}

    def op_program(self, handle: int) -> dict:
        weights = self.held[handle]
        lowered = _model(lambda: self.side.lowered(weights))
        with self.compiles.measure() as compiling:
            compiled = _model(lambda: self.side.compiled(weights))
        lowered_text = program_text(lowered)
        memory = compiled.memory_analysis()
        memory_fields = {
            name: int(getattr(memory, name))
            for name in dir(memory)
            if name.endswith("_in_bytes") and isinstance(getattr(memory, name), int)
        }
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) and cost else cost or {}
        shardings = {
            label: _sharding_record(actual, ndim, declared)
            for label, (actual, ndim, declared) in self.side.program_shardings(compiled).items()
        }
        return {
            "compiled_text": compiled.as_text(),
            "lowered_text": lowered_text,
            "memory": memory_fields,
            "cost": {k: float(v) for k, v in cost.items() if isinstance(v, int | float)},
            "shardings": shardings,
            "compile_seconds": compiling.compile_seconds,
            "compile_source": _compile_source(compiling),
            "mesh_shape": dict(mesh.shape) if (mesh := getattr(self.side, "mesh", None)) else None,
        }

    def op_trainer(self, handle: int) -> dict:
        trainer = _model(lambda: self.side.trainer(self.held[handle]))
        if trainer is None:
            return {"trainer": None}
        return {
            "trainer": self.hold(trainer),
            "params": self.hold(trainer.params),
            "opt_state": self.hold(trainer.opt_state),
        }

    def op_step(self, trainer: int, params: int, opt_state: int, batch: dict) -> dict:
        import jax

        step = self.held[trainer].step
        placed = self.batch(batch)
        new_params, new_opt, metrics = _model(
            lambda: step(self.held[params], self.held[opt_state], placed)
        )
        from parity.engine.side import returned_sharding_mismatches

        mismatches = []
        if hasattr(step, "input_shardings"):  # a compiled step: its outputs must fit it again
            mismatches = returned_sharding_mismatches(step, new_params, new_opt)
        metrics = jax.device_get(metrics)
        return {
            "params": self.hold(new_params),
            "opt_state": self.hold(new_opt),
            "metrics": self.send_tree(dict(metrics)),
            "mismatches": mismatches,
        }

    def op_evaluate(self, trainer: int, params: int, batch: dict) -> dict:
        placed = self.batch(batch)
        loss = _model(lambda: self.held[trainer].evaluate(self.held[params], placed))
        return {"tree": self.send_tree({"loss": loss})}

    def op_call(self, method: str, kwargs: dict) -> dict:
        """One of the side's `remote_methods` (a job beyond the Side protocol: a training run,
        a restore), returning `(flat arrays by path, JSON-able facts)`."""
        if method not in getattr(self.side, "remote_methods", ()):
            raise protocol.ProtocolError(f"the side serves no method {method!r}")
        arrays, facts = _model(lambda: getattr(self.side, method)(**kwargs))
        start = time.perf_counter()
        manifest = protocol.write_tree(self.directory, arrays.items())
        self.io_seconds += time.perf_counter() - start
        return {"tree": manifest, "facts": facts}

    def op_stats(self) -> dict:
        return {"io_seconds": self.io_seconds}

    def op_drop(self, handles: list[int]) -> dict:
        for handle in handles:
            self.held.pop(handle, None)
        return {}


def program_text(lowered: Any) -> str:
    """A lowered program's HLO text with its source lines (what the `program` check diffs):
    jax 0.12 takes `dialect` and `debug_info`; an older jax's `as_text()` takes neither."""
    try:
        return lowered.as_text(dialect="hlo", debug_info=True)
    except TypeError:
        return lowered.as_text()


def _compile_source(cost: Any) -> str:
    """How the program's compile time was obtained, plainly (as `compiles.Compiled.describe`
    says it): compiled, read from the persistent cache (written by an earlier check of the run
    or an earlier run), or already held by the side."""
    if cost.compilations == 0:
        return "compiled before this call, held by the side: not compiled again"
    seconds = cost.compile_seconds
    if cost.cache_reads == cost.compilations:
        return f"read from the persistent compilation cache in {seconds:.1f}s, not compiled"
    if cost.cache_reads:
        read = f"{cost.cache_reads} of its {cost.compilations} programs read from the cache"
        return f"compiled in {seconds:.1f}s ({read})"
    return f"compiled in {seconds:.1f}s"


def _spec(spec: Any) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def _one_sharding(sharding: Any) -> dict | None:
    """A sharding as JSON: a NamedSharding's spec and mesh (axis names, shape, device ids)."""
    if sharding is None:
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(sharding, "spec"):
        return {"other": str(sharding)}
    return {
        "spec": _spec(sharding.spec),
        "axis_names": list(mesh.axis_names),
        "shape": [int(mesh.shape[a]) for a in mesh.axis_names],
        "device_ids": [int(d.id) for d in mesh.devices.flat],
    }


def _sharding_record(actual: Any, ndim: int, declared: Any) -> dict:
    return {
        "actual": _one_sharding(actual),
        "ndim": int(ndim),
        "declared": _one_sharding(declared),
    }


def _error_reply(error: BaseException, where: str) -> dict:
    inner = error.error if isinstance(error, _ModelError) else error
    return {
        "error": {
            **(error.facts if isinstance(error, _ModelError) else {}),
            "type": type(inner).__name__,
            "module": type(inner).__module__,
            "message": str(inner)[:20_000],
            "detail": "".join(traceback.format_exception(inner))[-20_000:],
            "where": where,
        }
    }


def serve(server: Server, requests: io.TextIOBase, replies: io.TextIOBase) -> None:
    for line in requests:
        if not line.strip():
            continue
        try:
            message = protocol.decode(line)
            op = message.pop("op")
            if op == "quit":
                protocol.send(replies, {"ok": {}})
                return
            handler = getattr(server, f"op_{op}", None)
            if handler is None:
                raise protocol.ProtocolError(f"unknown op {op!r}")
            # stdout carries replies only: whatever a side prints goes to stderr
            with contextlib.redirect_stdout(sys.stderr):
                reply = {"ok": handler(**message)}
        except _ModelError as e:
            reply = _error_reply(e, e.where)
        except Exception as e:
            reply = _error_reply(e, "worker")
        with contextlib.suppress(Exception):  # what it cost never costs the reply
            if compiled := server.new_compiles():
                reply["compiles"] = compiled
        protocol.send(replies, reply)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        print("usage: python -m parity.remote.worker DIRECTORY", file=sys.stderr)
        raise SystemExit(2)
    protocol.send(sys.stdout, {"ready": {"version": protocol.VERSION}})
    serve(Server(Path(argv[1])), sys.stdin, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
