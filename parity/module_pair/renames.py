"""Renames (Linen path prefix -> NNX path prefix), applied the longest matching prefix first
in either direction, and suggested ones for a module pair whose variable paths do not line
up: the paths found on one side only are matched by collection and shape, preferring the
same trailing names, then each side's own order; each match gives the shortest prefix rename
that carries the Linen path to the NNX path, and a prefix that serves every leaf under it is
given once. A suggestion is offered only when it carries every path both ways, ready to pass
as `renames=`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from migrate.checkpoints import convert
from parity.module_pair.module_base import module_keys

Path = tuple[str, ...]
Leaves = Mapping[Path, tuple]  # (collection, *path) -> shape, in the side's own order


def to_nnx(path: Path, renames: Mapping[Path, Path]) -> Path:
    """A Linen path in NNX's naming (the longest matching Linen prefix wins)."""
    return convert.rename_path(path, renames)


def to_linen(path: Path, renames: Mapping[Path, Path]) -> Path:
    """An NNX path in Linen's naming (the renames' targets are distinct)."""
    return convert.rename_path(path, {new: old for old, new in renames.items()})


def fits(linen: Leaves, nnx: Leaves, renames: Mapping[Path, Path]) -> bool:
    """Whether `renames` carries every Linen leaf onto the NNX leaves and back, shapes kept."""
    if len(set(renames.values())) != len(renames):
        return False
    forward = {(k[0], *to_nnx(k[1:], renames)): s for k, s in linen.items()}
    backward = {(k[0], *to_linen(k[1:], renames)): s for k, s in nnx.items()}
    return forward == dict(nnx) and backward == dict(linen)


def nnx_leaves(state: Any, collections: Mapping[str, type]) -> dict[Path, tuple]:
    """`(collection, *NNX path)` -> shape of every variable of an NNX State, not renamed."""
    return {
        (convert.collection_of(type(v), collections) or "?", *module_keys(path)): tuple(
            v.get_value().shape
        )
        for path, v in nnx.to_flat_state(state)
    }


def _prefix_rename(linen: Path, nnx: Path) -> tuple[Path, Path]:
    """The prefixes left once the common tail (`kernel`, `attn/kernel`) is cut off."""
    common = _common_tail(linen, nnx)
    return linen[: len(linen) - common], nnx[: len(nnx) - common]


def _common_tail(linen: Path, nnx: Path) -> int:
    """How many trailing names agree, leaving at least one name of each path."""
    common = 0
    while common < min(len(linen), len(nnx)) - 1 and linen[-1 - common] == nnx[-1 - common]:
        common += 1
    return common


def _pairs(linen: Leaves, nnx: Leaves) -> list[tuple[Path, Path]]:
    """Leaves on one side only, paired by collection and shape: the most trailing names in
    common first, then the NNX side's order."""
    nnx_only = [(p, s) for p, s in nnx.items() if p not in linen]
    taken: set[Path] = set()
    pairs = []
    for linen_path, shape in ((p, s) for p, s in linen.items() if p not in nnx):
        candidates = [
            p for p, s in nnx_only if s == shape and p[0] == linen_path[0] and p not in taken
        ]
        if candidates:
            match = max(candidates, key=lambda p: _common_tail(linen_path, p))
            taken.add(match)
            pairs.append((linen_path[1:], match[1:]))
    return pairs


def _prefixes(pairs: list[tuple[Path, Path]]) -> dict[Path, Path]:
    renames: dict[Path, Path] = {}
    for linen_path, nnx_path in pairs:
        old, new = _prefix_rename(linen_path, nnx_path)
        if old and new and renames.get(old, new) == new:
            renames[old] = new
    # A rename inside a shorter one that already carries it (`embed/x` under `embed`).
    return {
        old: new
        for old, new in renames.items()
        if not any(
            old[: len(o)] == o and old != o and new == (*n, *old[len(o) :])
            for o, n in renames.items()
        )
    }


def suggest(linen: Leaves, nnx: Leaves) -> dict[Path, Path]:
    """Linen prefix -> NNX prefix carrying every leaf of one side onto the other (each keyed
    `(collection, *path)` with its shape, neither renamed); empty when none is found. Whole
    leaf paths where shorter prefixes would collide."""
    pairs = _pairs(linen, nnx)
    for renames in (_prefixes(pairs), dict(pairs)):
        if renames and fits(linen, nnx, renames):
            return renames
    return {}
