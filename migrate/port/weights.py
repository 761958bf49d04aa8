"""The weight map a port implies, as data: every Linen variable (collection and path) and the
NNX path that holds it, and the `renames` (Linen prefix -> NNX prefix) that `compare_modules`
and the converters take where the two differ."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from migrate.port import model
from migrate.port.trace import Trace

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """Each Linen variable's NNX path, and the prefixes renamed."""

    entries: tuple[dict[str, Any], ...]
    renames: dict[Path, Path]

    @property
    def identity(self) -> bool:
        return not self.renames

    def to_json(self, linen: str, nnx_name: str) -> str:
        return json.dumps(
            {
                "written_by": "migrate port",
                "linen": linen,
                "nnx": nnx_name,
                "renames": [[list(k), list(v)] for k, v in self.renames.items()],
                "entries": list(self.entries),
            },
            indent=2,
        )


def build(trace: Trace, placed_at: Mapping[Path, Mapping[str, str]]) -> WeightMap:
    """Every traced variable under the attributes that hold it in the port (`placed_at`: each
    ported instance's Linen names -> NNX attributes); the renames, one per renamed prefix."""
    entries = []
    renames: dict[Path, Path] = {}
    for collection, leaves in sorted(trace.variables.items()):
        for path, leaf in sorted(leaves.items()):
            nnx_path = model.nnx_path(path, placed_at)
            entries.append(
                {
                    "linen": "/".join((collection, *path)),
                    "nnx": "/".join(nnx_path),
                    "shape": list(leaf.shape),
                    "dtype": str(leaf.dtype),
                }
            )
            for i in range(1, len(path) + 1):
                prefix = model.nnx_path(path[:i], placed_at)
                if prefix != (*model.nnx_path(path[: i - 1], placed_at), path[i - 1]):
                    renames[path[:i]] = prefix
    return WeightMap(tuple(entries), renames)


def read_renames(text: str) -> dict[Path, Path]:
    """The `renames` of a weight map file's text."""
    return {tuple(k): tuple(v) for k, v in json.loads(text)["renames"]}
