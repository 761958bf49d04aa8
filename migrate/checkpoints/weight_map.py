"""A weight map as data: how the leaves of one tree become the leaves of another (names,
stacking axes, transposes, scales), declared in one table and applied strictly both ways.

    MAP = WeightMap("maxtext 0.2.3 -> 0.2.5", (
        Entry("params/decoder/layers/{name}/kernel", "model/decoder/layers/{name}/kernel"),
        Entry("params/token_embedder/embedding", "model/token_embedder/embedding"),
        Entry("q/kernel", "query/kernel", scale=4.0),           # a convention folded in
        Entry("mlp/wi", "mlp/wi_0", moveaxis=(1, 0)),            # another stacking axis
    ))
    target = MAP.forward(source_flat)            # every source leaf used exactly once
    source = MAP.backward(target_flat)           # the inverse, as strict

A pattern is a `/`-separated path whose `{field}` segments match one path segment each (and
`{field...}` one or more segments, anywhere); what they match fills the same fields of the
other side. A field of a kind, `{attention~self_attention(_local|_global)?}`, matches one
segment that its regular expression matches whole: a row for every module of that kind (an
attention kernel under any attention module's name), not for one path; it carries the same
expression on both sides, so the row covers the same leaves both ways.
`moveaxis=(a, b)` moves axis `a` to `b` on the way forward (and back on the way back);
`transpose` permutes axes; `scale` multiplies on the way forward and divides on the way
back: bit-exact both ways only for a power of two, which `exact` reports. `names` renames
logical axis names (forward, and back on the way back); a leaf whose names a row's rename would
not give back unchanged (it already carries the other side's name) is refused. Of the rows that
match a leaf, the most specific (most literal segments, then most fields of a kind) applies. A
leaf no row matches, two equally specific rows for one leaf, or two leaves onto one target is a
`WeightMapError` naming the paths: nothing is ever dropped silently. Works on host (numpy)
arrays.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from migrate.checkpoints.convert import ConversionError

Path = tuple[str, ...]
# `{name}`, `{name...}` (one or more segments) or `{name~regex}` (one segment of a kind)
_FIELD = re.compile(r"^\{(\w+)(?:(\.\.\.)|~(.+))?\}$")


class WeightMapError(ConversionError):
    """A tree the map does not cover exactly: the paths that did not fit, and why."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of a map: `source` pattern -> `target` pattern, and the transform between."""

    source: str
    target: str
    moveaxis: tuple[int, int] | None = None
    transpose: tuple[int, ...] | None = None
    scale: float | None = None
    # logical axis names renamed on the way forward (`{"embed": "embed_attn"}`), back on the way
    # back: a declared difference of annotation, shown in reports, never a silent one
    names: tuple[tuple[str, str], ...] = ()
    note: str = ""  # why the row is there (a convention, a rename), shown in reports

    def __post_init__(self) -> None:
        fields = [_fields(p) for p in (self.source, self.target)]
        if set(fields[0]) != set(fields[1]):
            raise ValueError(f"{self.source} -> {self.target}: fields differ {fields}")
        kinds = [_kinds(p) for p in (self.source, self.target)]
        if kinds[0] != kinds[1]:
            raise ValueError(f"{self.source} -> {self.target}: kinds differ {kinds}")
        for expression in kinds[0].values():
            re.compile(expression)  # a bad expression fails where the row is declared

    @property
    def exact(self) -> bool:
        """Bit-exact both ways: no scale, or a power of two."""
        return self.scale is None or math.frexp(self.scale)[0] == 0.5

    def forward_array(self, array: Any) -> Any:
        out = array
        if self.moveaxis is not None:
            out = np.moveaxis(out, *self.moveaxis)
        if self.transpose is not None:
            out = np.transpose(out, self.transpose)
        if self.scale is not None:
            out = (out * np.asarray(self.scale, dtype=out.dtype)).astype(out.dtype)
        return out

    def rename(self, names: tuple | None, forward: bool) -> tuple | None:
        """A leaf's logical names as this row moves it: permuted with its axes, renamed as
        declared."""
        if names is None:
            return None
        order = list(range(len(names)))

        def moved(order: list[int], source: int, destination: int) -> list[int]:
            out = list(order)
            out.insert(destination % len(out), out.pop(source % len(out)))
            return out

        if forward:
            if self.moveaxis is not None:
                order = moved(order, *self.moveaxis)
            if self.transpose is not None:
                order = [order[i] for i in self.transpose]
        else:
            if self.transpose is not None:
                order = [order[i] for i in np.argsort(self.transpose)]
            if self.moveaxis is not None:
                order = moved(order, self.moveaxis[1], self.moveaxis[0])
        table = dict(self.names) if forward else {b: a for a, b in self.names}
        return tuple(table.get(names[i], names[i]) for i in order)

    def backward_array(self, array: Any) -> Any:
        out = array
        if self.scale is not None:
            out = (out / np.asarray(self.scale, dtype=out.dtype)).astype(out.dtype)
        if self.transpose is not None:
            out = np.transpose(out, np.argsort(self.transpose))
        if self.moveaxis is not None:
            out = np.moveaxis(out, self.moveaxis[1], self.moveaxis[0])
        return out


def _literals(pattern: str) -> tuple[int, int]:
    """How specific a pattern is: its literal segments, then its fields of a kind (the most
    specific matching row wins)."""
    parts = [_FIELD.match(part) for part in pattern.split("/")]
    return sum(1 for m in parts if m is None), sum(1 for m in parts if m and m.group(3))


def _fields(pattern: str) -> list[str]:
    return [m.group(1) for part in pattern.split("/") if (m := _FIELD.match(part))]


def _kinds(pattern: str) -> dict[str, str]:
    """A pattern's fields of a kind: name -> regular expression."""
    return {
        m.group(1): m.group(3)
        for part in pattern.split("/")
        if (m := _FIELD.match(part)) and m.group(3)
    }


def _regex(pattern: str) -> re.Pattern[str]:
    parts = []
    for part in pattern.split("/"):
        field = _FIELD.match(part)
        if field is None:
            parts.append(re.escape(part))
        else:
            name, span, kind = field.groups()
            parts.append(f"(?P<{name}>{'.+' if span else f'(?:{kind})' if kind else '[^/]+'})")
    return re.compile("/".join(parts))


def match(pattern: str, path: Path) -> dict[str, str] | None:
    """The fields of `pattern` that `path` fills, or None when it does not match (`{x...}`
    spans one or more segments, anywhere in the pattern; `{x~regex}` one segment that the
    expression matches whole)."""
    found = _regex(pattern).fullmatch("/".join(path))
    if found is None:
        return None
    fields = found.groupdict()
    if any("/" in fields[name] for name in _kinds(pattern)):  # a kind is one segment
        return None
    return fields


def fill(pattern: str, fields: Mapping[str, str]) -> Path:
    out: list[str] = []
    for part in pattern.split("/"):
        field = _FIELD.match(part)
        out.extend(fields[field.group(1)].split("/") if field else [part])
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """A named table of entries, applied strictly in both directions."""

    name: str
    entries: Sequence[Entry]

    def _apply(self, flat: Mapping[Path, Any], forward: bool) -> dict[Path, Any]:
        out: dict[Path, Any] = {}
        origin: dict[Path, Path] = {}
        unmatched, ambiguous, collisions = [], [], []
        for path, array in flat.items():
            hits = []
            for entry in self.entries:
                fields = match(entry.source if forward else entry.target, path)
                if fields is not None:
                    hits.append((entry, fields))
            if not hits:
                unmatched.append("/".join(path))
                continue
            best = max(_literals(e.source if forward else e.target) for e, _ in hits)
            hits = [h for h in hits if _literals(h[0].source if forward else h[0].target) == best]
            if len(hits) > 1:
                rows = ", ".join(e.source if forward else e.target for e, _ in hits)
                ambiguous.append(f"{'/'.join(path)} ({rows})")
                continue
            entry, fields = hits[0]
            target = fill(entry.target if forward else entry.source, fields)
            if target in out:
                collisions.append(
                    f"{'/'.join(origin[target])} and {'/'.join(path)} -> {'/'.join(target)}"
                )
                continue
            origin[target] = path
            out[target] = entry.forward_array(array) if forward else entry.backward_array(array)
        problems = []
        if unmatched:
            problems.append(f"no entry for {len(unmatched)} leaves: {', '.join(unmatched[:20])}")
        if ambiguous:
            problems.append(f"more than one entry for: {'; '.join(ambiguous[:20])}")
        if collisions:
            problems.append(f"two leaves onto one: {'; '.join(collisions[:20])}")
        if problems:
            way = "forward" if forward else "backward"
            raise WeightMapError(f"weight map {self.name!r} ({way})", problems)
        return out

    def names(self, flat: Mapping[Path, Any], forward: bool = True) -> dict[Path, Any]:
        """Logical names by source path -> by target path, permuted and renamed as the rows
        say (the same strictness as the arrays); a rename is checked to give each leaf's names
        back on the way back (else `WeightMapError`: the leaf already carries the other side's
        name, which its row does not declare)."""
        out: dict[Path, Any] = {}
        refused = []
        for path, names in flat.items():
            entry, fields = self._row(path, forward)
            renamed = entry.rename(names, forward)
            back = entry.rename(renamed, not forward)
            if back != names:  # it carries the other side's name: the row does not describe it
                refused.append(f"{'/'.join(path)}: {names} -> {renamed} comes back as {back}")
            out[fill(entry.target if forward else entry.source, fields)] = renamed
        if refused:
            way = "forward" if forward else "backward"
            raise WeightMapError(f"weight map {self.name!r} ({way}): a rename", refused[:20])
        return out

    def _row(self, path: Path, forward: bool) -> tuple[Entry, dict[str, str]]:
        hits = [
            (e, f)
            for e in self.entries
            if (f := match(e.source if forward else e.target, path)) is not None
        ]
        if not hits:
            raise WeightMapError(f"weight map {self.name!r}", [f"no entry for {'/'.join(path)}"])
        best = max(_literals(e.source if forward else e.target) for e, _ in hits)
        hits = [h for h in hits if _literals(h[0].source if forward else h[0].target) == best]
        if len(hits) > 1:
            raise WeightMapError(f"weight map {self.name!r}", [f"ambiguous: {'/'.join(path)}"])
        return hits[0]

    def forward(self, flat: Mapping[Path, Any]) -> dict[Path, Any]:
        """Source leaves (flat by path) -> target leaves; every leaf used exactly once."""
        return self._apply(flat, forward=True)

    def backward(self, flat: Mapping[Path, Any]) -> dict[Path, Any]:
        """Target leaves -> source leaves, the inverse of `forward`."""
        return self._apply(flat, forward=False)

    def check_target(self, produced: Mapping[Path, Any], expected: Mapping[Path, Any]) -> None:
        """`produced` against a template of the target (paths and shapes): every expected leaf
        produced, no other, each of the expected shape and dtype."""
        missing = sorted("/".join(p) for p in set(expected) - set(produced))
        extra = sorted("/".join(p) for p in set(produced) - set(expected))
        wrong = [
            f"{'/'.join(p)}: {tuple(produced[p].shape)} {produced[p].dtype} where "
            f"{tuple(expected[p].shape)} {expected[p].dtype} is expected"
            for p in sorted(set(produced) & set(expected))
            if tuple(produced[p].shape) != tuple(expected[p].shape)
            or produced[p].dtype != expected[p].dtype
        ]
        problems = [
            *([f"missing: {', '.join(missing[:20])}"] if missing else []),
            *([f"not in the target: {', '.join(extra[:20])}"] if extra else []),
            *wrong[:20],
        ]
        if problems:
            raise WeightMapError(f"weight map {self.name!r} (target)", problems)

    @property
    def exact(self) -> bool:
        return all(e.exact for e in self.entries)
