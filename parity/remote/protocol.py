"""The wire format between the harness and a worker: one JSON object per line for control,
arrays as `.npy` files in a directory both processes can read.

Imports the standard library and numpy only, so that a worker in another environment (another
interpreter, another jax or flax, another checkout) can speak it. A tree of arrays travels as a
`manifest`: `{"leaves": [{"path": [...], "file": ..., "dtype": ..., "names": [...]}, ...]}`
(the path a list of string keys; `names` the leaf's logical axis names, when it has them).
Dtypes numpy cannot store (bfloat16) travel as their bits, viewed back by name on arrival.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

VERSION = 1
# Dtypes by the unsigned integer type of the same width their bits travel as.
BITS_OF = {2: np.uint16, 1: np.uint8, 4: np.uint32, 8: np.uint64}
NATIVE_KINDS = "biufc"  # bool, signed, unsigned, float, complex: numpy stores these itself


class ProtocolError(RuntimeError):
    """A message that does not follow the protocol (a worker that prints to stdout, an
    unreadable array file): the other process cannot be trusted to continue."""


def send(stream: TextIO, message: Mapping[str, Any]) -> None:
    stream.write(json.dumps(message, allow_nan=True) + "\n")
    stream.flush()


def decode(line: str) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"not a protocol message: {line[:200]!r} ({e})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a protocol message: {line[:200]!r}")
    return message


def _to_storable(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind in NATIVE_KINDS and array.dtype.name != "bfloat16":
        return array
    return array.view(BITS_OF[array.dtype.itemsize])


def _from_storable(stored: np.ndarray, dtype_name: str) -> np.ndarray:
    if str(stored.dtype) == dtype_name:
        return stored
    import ml_dtypes  # comes with jax; only needed for the dtypes numpy lacks

    return stored.view(np.dtype(getattr(ml_dtypes, dtype_name)))


def write_tree(
    directory: Path,
    leaves: Iterable[tuple[tuple[str, ...], Any]],
    names: Mapping[tuple[str, ...], Any] | None = None,
    placements: Mapping[tuple[str, ...], Any] | None = None,
) -> dict[str, Any]:
    """Write each `(path, array)` to its own `.npy` in `directory`; returns the manifest.
    `names`: logical axis names by path; `placements`: where the sender had each array (a
    JSON-able sharding record), by path."""
    directory.mkdir(parents=True, exist_ok=True)
    batch = uuid.uuid4().hex[:8]
    manifest: list[dict[str, Any]] = []
    for index, (path, value) in enumerate(leaves):
        array = np.asarray(value)
        file = directory / f"{batch}-{index}.npy"
        np.save(file, _to_storable(array), allow_pickle=False)
        entry: dict[str, Any] = {
            "path": [str(p) for p in path],
            "file": file.name,
            "dtype": str(array.dtype),
            "shape": list(array.shape),
        }
        if names is not None and tuple(path) in names and names[tuple(path)] is not None:
            entry["names"] = [None if n is None else str(n) for n in names[tuple(path)]]
        if placements is not None and placements.get(tuple(path)) is not None:
            entry["placement"] = placements[tuple(path)]
        manifest.append(entry)
    return {"leaves": manifest}


def read_tree(
    directory: Path, manifest: Mapping[str, Any], remove: bool = True
) -> tuple[dict[tuple[str, ...], np.ndarray], dict[tuple[str, ...], dict[str, Any]]]:
    """The arrays of a manifest and each one's entry (`names`: its logical axis names or None,
    `placement`: the sender's sharding record or None); each file removed once read."""
    arrays: dict[tuple[str, ...], np.ndarray] = {}
    entries: dict[tuple[str, ...], dict[str, Any]] = {}
    for entry in manifest.get("leaves", []):
        path = tuple(entry["path"])
        file = directory / os.path.basename(entry["file"])  # never outside the directory
        try:
            stored = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ProtocolError(f"array file {file.name} of {'/'.join(path)}: {e}") from None
        array = _from_storable(stored, entry["dtype"])
        if list(array.shape) != list(entry["shape"]):
            raise ProtocolError(f"{'/'.join(path)}: shape {array.shape} != {entry['shape']}")
        arrays[path] = array
        entries[path] = {
            "names": tuple(entry["names"]) if "names" in entry else None,
            "placement": entry.get("placement"),
        }
        if remove:
            file.unlink(missing_ok=True)
    return arrays, entries


def nest(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    """`{('a', 'b'): x}` -> `{'a': {'b': x}}`."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Nested dicts (and lists, tuples: keyed by index) -> `{path: leaf}`; None leaves dropped."""
    if isinstance(tree, Mapping):
        items: Iterable[tuple[Any, Any]] = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        return {} if tree is None else {prefix: tree}
    out: dict[tuple[str, ...], Any] = {}
    for key, value in items:
        out.update(flatten(value, (*prefix, str(key))))
    return out
