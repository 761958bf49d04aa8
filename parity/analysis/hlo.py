"""Facts read off compiled XLA programs: collective counts (per program and per loop body),
and a fingerprint of the optimised program."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from collections.abc import Mapping

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
# `%name = type op(` or `op-start(`: the async `-done` halves are not counted twice.
_INSTRUCTION = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
# XLA:TPU compiles a multi-slice program per slice (its partitions are one slice's devices)
# and moves data between slices (DCN) by host transfers: a `send` (and its `recv`) whose
# attributes name the transfer, `megascale_transfer_type="ONE_TO_ONE"` for a ppermute. Each
# send is one collective over DCN, of the kind its transfer type says.
_DCN_SEND = re.compile(r"=\s*[^=]*?\bsend\(.*megascale_transfer_type=\"(\w+)\"")
# A line that names none of these issues no collective (a substring test is far cheaper than
# the patterns above, and a compiled program has tens of thousands of lines).
_COLLECTIVE_MARKERS = (*COLLECTIVES, "megascale_transfer_type")
DCN_KINDS = {
    "ONE_TO_ONE": "collective-permute",
    "ALL_GATHER": "all-gather",
    "ALL_REDUCE": "all-reduce",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}


def collective_kind(line: str) -> tuple[str, bool] | None:
    """The collective an HLO line issues, and whether it crosses slices (DCN); None if none."""
    if not any(marker in line for marker in _COLLECTIVE_MARKERS):  # most lines: no regex
        return None
    if m := _INSTRUCTION.search(line):
        return m.group(1), False
    if m := _DCN_SEND.search(line):
        return DCN_KINDS.get(m.group(1), m.group(1).lower().replace("_", "-")), True
    return None


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many instructions of each collective kind a compiled HLO module holds (transfers
    between slices included, by their kind)."""
    counts = Counter(found[0] for line in hlo_text.splitlines() if (found := collective_kind(line)))
    return {kind: counts.get(kind, 0) for kind in COLLECTIVES}


_METADATA = re.compile(r",? metadata=\{[^}]*\}|, source_[a-z_]+=[^,}\n]*")
_NAME = re.compile(r"%[\w.\-]+")
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_fingerprint(hlo_text: str) -> str:
    """A hash of the optimised HLO without its source tables, metadata and instruction
    numbering: equal fingerprints mean the two twins compiled to the same program."""
    import hashlib

    kept, in_table = [], False
    for line in hlo_text.splitlines():
        if line.startswith(_SOURCE_TABLES):
            in_table = True
        elif in_table and not line.strip():
            in_table = False
        elif not in_table and not line.startswith("HloModule"):
            kept.append(_METADATA.sub("", line))
    # Instruction names come from the tracing context (`jit_silu_` vs `vmap_jit_silu__`):
    # rename them canonically, in order of first appearance, keeping the dataflow.
    names: dict[str, str] = {}
    text = _NAME.sub(lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), "\n".join(kept))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ loop bodies

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_NAME_OF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
# The attributes by which an instruction calls other computations.
_CALLING = (
    "body", "condition", "to_apply", "calls", "branch_computations", "called_computations",
    "true_computation", "false_computation",
)  # fmt: skip
_CALLED = re.compile(r"\b(?:" + "|".join(_CALLING) + r")=(\{[^}]*\}|%?[\w.\-]+)")
_CALLED_MARKERS = tuple(f"{attribute}=" for attribute in _CALLING)
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_INT_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((\d+)\)")
_BOUND = re.compile(r"^\s*ROOT\s.*\bcompare\(%?([\w.\-]+),\s*%?([\w.\-]+)\),\s*direction=LT")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_SUB_AXIS = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}"
)


_RESULT_DTYPE = re.compile(r"=\s*\(?([a-z]+\d*)\[")


def result_dtype(line: str) -> str:
    """The element type an instruction's line gives its result (a tuple's first element)."""
    return m.group(1) if (m := _RESULT_DTYPE.search(line)) else ""


class SliceMesh(dict):
    """A mesh's shape (axis -> size) with the part of each axis that spans slices (`dcn`):
    how the collectives of a TPU program compiled per slice are read (`Collective.mesh_axes`)."""

    def __init__(self, shape: Mapping[str, int], dcn: Mapping[str, int]) -> None:
        super().__init__(shape)
        self.dcn = {a: n for a, n in dcn.items() if a in shape}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction and the devices it connects: groups of partition ids (a
    collective-permute's source -> target pairs count as groups of two)."""

    kind: str
    name: str
    groups: tuple[tuple[int, ...], ...]
    op_name: str = ""  # the JAX operation it came from (XLA's metadata)
    dtype: str = ""  # of its result (an async start's first operand): `f32`, `u32`, ...
    # a transfer between slices (DCN) of a per-slice TPU program: no partition groups, the
    # slices it connects are the mesh's `dcn_*` axes (`across_slices`)
    dcn: bool = False
    partitions: int = 0  # the program's partitions (one slice's devices in a per-slice program)

    @property
    def recomputed(self) -> bool:
        """Issued by a rematerialised computation (`jax.checkpoint` recomputing the forward
        inside the backward pass)."""
        return "rematted_computation" in self.op_name

    def mesh_axes(self, mesh_shape: Mapping[str, int]) -> frozenset[str]:
        """The mesh axes along which the devices of some group differ. Partition p is the
        p-th device of the mesh in row-major order (how jit assigns a mesh's devices); in a
        per-slice program (a `SliceMesh` whose partitions are one slice's), of one slice's
        mesh. A transfer between slices spans the axes that cross slices."""
        names, sizes = list(mesh_shape), [mesh_shape[a] for a in mesh_shape]
        dcn = getattr(mesh_shape, "dcn", {})
        if self.dcn:
            return frozenset(a for a, n in dcn.items() if n > 1)
        if dcn and 0 < self.partitions < int(np.prod(sizes)):
            sizes = [mesh_shape[a] // dcn.get(a, 1) for a in names]
        axes: set[str] = set()
        for group in self.groups:
            coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), sizes))
            axes.update(n for n, row in zip(names, coords, strict=True) if len(set(row)) > 1)
        return frozenset(axes)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop of the program that is not nested in another loop's body, with every
    collective of its body (and of the computations the body calls, nested loops included)."""

    direction: str  # "backward" when its source op is a transpose (autodiff), else "forward"
    trip_count: int | None
    collectives: tuple[Collective, ...]
    inner: tuple[Loop, ...] = ()  # the loops its body runs (not nested in another of them)

    def own_collectives(self) -> tuple[Collective, ...]:
        """The collectives its body issues outside its inner loops: once per trip."""
        nested = {c.name for loop in self.inner for c in loop.collectives}
        return tuple(c for c in self.collectives if c.name not in nested)


def _iota(dims: str, source: str, transpose: str | None) -> np.ndarray:
    """XLA's iota tile `[dims]<=[source]T(transpose)`: arange reshaped to `source`,
    transposed, reshaped to `dims`."""
    shape = [int(d) for d in source.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    if transpose:
        ids = ids.transpose([int(p) for p in transpose.split(",")])
    return ids.reshape([int(d) for d in dims.split(",")])


def _mesh_groups(match: re.Match, num_devices: int) -> tuple[tuple[int, ...], ...]:
    axes = [a.split("=") for a in match.group(1).split(",")]
    names = [a.strip().strip("'") for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    device_ids = match.group(2)
    if device_ids is None:
        ids = np.arange(num_devices)
    elif m := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids.strip()):
        ids = _iota(m.group(1), m.group(1), m.group(2)).reshape(-1)
    else:
        ids = np.array([int(i) for i in device_ids.split(",")])
    # Each grouped entry is an axis, `'stage'`, or a sub-axis, `'stage':(2)2`: of the axis
    # split major to minor into factors, the `size` ones after the `pre` major ones.
    grouped = []
    for entry in (g.strip() for g in match.group(3).split(",") if g.strip()):
        m = _SUB_AXIS.fullmatch(entry)
        if m is None or m[1] not in names:
            raise ValueError(f"replica groups over unknown mesh axes {entry} (mesh {names})")
        full = sizes[names.index(m[1])]
        pre, size = (int(m[2]), int(m[3])) if m[2] else (1, full)
        if full % (pre * size):
            raise ValueError(f"sub-axis {entry} does not divide mesh axis {m[1]}={full}")
        grouped.append((m[1], pre, size))
    # Split every axis at the boundaries its sub-axes name: dims major to minor, each a
    # (axis, cumulative size before it, size) factor of the row-major device grid.
    dims: list[tuple[str, int, int]] = []
    for name, full in zip(names, sizes, strict=True):
        cuts = {1, full} | {c for n, p, s in grouped if n == name for c in (p, p * s)}
        for lo, hi in itertools.pairwise(sorted(cuts)):
            if hi % lo:
                raise ValueError(f"sub-axes of {name}={full} that do not nest: {sorted(cuts)}")
            dims.append((name, lo, hi // lo))
    in_group = [
        [i for i, (n, lo, f) in enumerate(dims) if n == name and pre <= lo and lo * f <= pre * s]
        for name, pre, s in grouped
    ]
    group_dims = [i for dims_of in in_group for i in dims_of]
    order = [i for i in range(len(dims)) if i not in group_dims] + group_dims
    size = int(np.prod([dims[i][2] for i in group_dims]))
    ids = ids.reshape([f for _, _, f in dims] or [1]).transpose(order).reshape(-1, size)
    return tuple(tuple(int(i) for i in row) for row in ids)


def device_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of one collective instruction, in any of the forms XLA prints:
    source-target pairs, explicit groups, iota tiles (`[4,2]<=[2,4]T(1,0)`) or mesh axes
    (`mesh['stage'=4,'fsdp'=2] {'fsdp'}`, sub-axes too: `{'stage':(2)2}`). Raises on a form
    it does not know, so that a count never silently treats a collective as local."""
    if m := _PAIRS.search(line):
        return tuple(tuple(int(i) for i in p.split(",")) for p in re.findall(r"\{([\d,]+)\}", m[1]))
    if m := _MESH_GROUPS.search(line):
        return _mesh_groups(m, num_devices)
    if m := _IOTA_GROUPS.search(line):
        return tuple(tuple(int(i) for i in row) for row in _iota(m[1], m[2], m[3]))
    if m := _EXPLICIT.search(line):
        groups = tuple(
            tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m[1])
        )
        return groups or (tuple(range(num_devices)),)
    if "replica_groups" not in line and "source_target_pairs" not in line:
        return (tuple(range(num_devices)),)
    raise ValueError(f"unrecognised device groups in: {line.strip()[:300]}")


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    computations: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "}")) and (m := _HEADER.match(line)):
            name = m.group(1)
            computations[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None:
            computations[name].append(line)
    return computations, entry


def _called(line: str) -> list[str]:
    if not any(marker in line for marker in _CALLED_MARKERS):  # most lines call nothing
        return []
    return [n for m in _CALLED.finditer(line) for n in re.findall(r"[\w.\-]+", m.group(1))]


def _condition_bound(condition: list[str]) -> int | None:
    """The trip count a loop condition states as `counter < constant` (XLA:TPU's optimised
    loops carry no `known_trip_count`; a scan's counter starts at 0 and steps by 1)."""
    constants = {m[1]: int(m[2]) for line in condition if (m := _INT_CONSTANT.match(line))}
    for line in condition:
        if m := _BOUND.match(line):
            return constants.get(m[2])
    return None


def _collective(line: str, num_devices: int) -> Collective | None:
    """The collective an HLO line issues, with its device groups, source and result type."""
    found = collective_kind(line)
    if found is None:
        return None
    kind, dcn = found
    instruction = _NAME_OF.match(line)
    op_name = m.group(1) if (m := _OP_NAME.search(line)) else ""
    groups = () if dcn else device_groups(line, num_devices)
    name = instruction.group(1) if instruction else "?"
    return Collective(kind, name, groups, op_name, result_dtype(line), dcn, num_devices)


def loops(hlo_text: str) -> list[Loop]:
    """The program's outermost while loops (for a scanned pipeline, the forward and the
    backward iteration loop), each with the collectives its body issues per iteration."""
    computations, entry = _computations(hlo_text)
    num_devices = int(m[1]) if (m := re.search(r"num_partitions=(\d+)", hlo_text)) else 1

    def collectives_under(name: str, seen: set[str]) -> list[Collective]:
        if name in seen or name not in computations:
            return []
        seen.add(name)
        found = []
        for line in computations[name]:
            if collective := _collective(line, num_devices):
                found.append(collective)
            for called in _called(line):
                found += collectives_under(called, seen)
        return found

    def loop_of(line: str, body: str) -> Loop:
        op_name = m.group(1) if (m := _OP_NAME.search(line)) else ""
        trip = int(m.group(1)) if (m := TRIP_COUNT.search(line)) else None
        if trip is None and (condition := _CONDITION.search(line)):
            trip = _condition_bound(computations.get(condition[1], []))
        direction = "backward" if "transpose(" in op_name else "forward"
        inner = tuple(loops_under(body, set()))
        return Loop(direction, trip, tuple(collectives_under(body, set())), inner)

    def loops_under(name: str, seen: set[str]) -> list[Loop]:
        if name in seen or name not in computations:
            return []
        seen.add(name)
        found: list[Loop] = []
        for line in computations[name]:
            if re.search(r"\swhile\(", line) and (body := re.search(r"\bbody=%?([\w.\-]+)", line)):
                found.append(loop_of(line, body[1]))
                continue
            for called in _called(line):
                found += loops_under(called, seen)
        return found

    return loops_under(entry, set()) if entry is not None else []


def outside_loops(hlo_text: str) -> list[tuple[str, Collective]]:
    """(direction, collective) for every collective that no while loop issues: the entry
    computation's and those of the computations it calls, loop bodies excluded. The direction
    is "backward" when the collective comes from a transpose (autodiff), else "forward"."""
    computations, entry = _computations(hlo_text)
    num_devices = int(m[1]) if (m := re.search(r"num_partitions=(\d+)", hlo_text)) else 1
    found: list[tuple[str, Collective]] = []

    def visit(name: str, seen: set[str]) -> None:
        if name in seen or name not in computations:
            return
        seen.add(name)
        for line in computations[name]:
            if re.search(r"\swhile\(", line):
                continue
            if collective := _collective(line, num_devices):
                direction = "backward" if "transpose(" in collective.op_name else "forward"
                found.append((direction, collective))
            for called in _called(line):
                visit(called, seen)

    if entry is not None:
        visit(entry, set())
    return found


def loop_collective_counts(hlo_text: str) -> dict[str, int]:
    """Collectives of the program's outermost loop bodies, by direction and kind, with the
    backward's rematerialised ones counted apart: `{"backward all-gather recomputed": 7, ...}`.
    Twins that schedule, shard and rematerialise alike issue the same."""
    counts: Counter[str] = Counter()
    for loop in loops(hlo_text):
        for collective in loop.collectives:
            tail = " recomputed by remat" if collective.recomputed else ""
            counts[f"{loop.direction} {collective.kind}{tail}"] += 1
    return dict(counts)
