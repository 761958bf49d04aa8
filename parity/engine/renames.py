"""Suggested `renames` for a module pair whose variable paths do not line up: the paths found
on one side only are matched by collection and shape, in each side's own order, and each match
gives the shortest prefix rename that carries the Linen path to the NNX path; a prefix that
serves every leaf under it is given once, ready to pass as `renames=`."""

from __future__ import annotations

from collections.abc import Mapping

Path = tuple[str, ...]
Leaves = Mapping[Path, tuple]  # (collection, *path) -> shape, in the side's own order


def _prefix_rename(linen: Path, nnx: Path) -> tuple[Path, Path]:
    """The prefixes left once the common tail (`kernel`, `attn/kernel`) is cut off."""
    common = 0
    while common < min(len(linen), len(nnx)) - 1 and linen[-1 - common] == nnx[-1 - common]:
        common += 1
    return linen[: len(linen) - common], nnx[: len(nnx) - common]


def suggest(linen: Leaves, nnx: Leaves) -> dict[Path, Path]:
    """Linen prefix -> NNX prefix for the leaves on one side only (each keyed
    `(collection, *path)` with its shape); empty when nothing pairs up."""
    linen_only = [(p, s) for p, s in linen.items() if p not in nnx]
    nnx_only = [(p, s) for p, s in nnx.items() if p not in linen]
    renames: dict[Path, Path] = {}
    taken: set[Path] = set()
    for linen_path, shape in linen_only:
        match = next(
            (p for p, s in nnx_only if s == shape and p[0] == linen_path[0] and p not in taken),
            None,
        )
        if match is None:
            continue
        taken.add(match)
        old, new = _prefix_rename(linen_path[1:], match[1:])
        if old and new and renames.get(old, new) == new:
            renames[old] = new
    # A rename inside one already given (`embed/x` under `embed`) is implied by it.
    return {
        old: new
        for old, new in renames.items()
        if not any(
            old[: len(o)] == o and old != o and new[: len(n)] == n for o, n in renames.items()
        )
    }
