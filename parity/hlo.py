"""Facts read off compiled XLA programs: collective counts, memory and cost."""

from __future__ import annotations

import math
import re
from collections import Counter

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
# `%name = type op(` or `op-start(`: the async `-done` halves are not counted twice.
_INSTRUCTION = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many instructions of each collective kind a compiled HLO module holds."""
    counts = Counter(
        m.group(1) for line in hlo_text.splitlines() if (m := _INSTRUCTION.search(line))
    )
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


# ------------------------------------------------------------------ matmul work

# A computation's header: `%name (params) -> type {`, `ENTRY %name (...) -> ... {`, or
# (unoptimised text) `ENTRY main.1 {`.
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*->.*)?\{\s*$")
# `%name = f32[2,3]{1,0} opcode(operands), attributes` (tuple-shaped results have no dims).
_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:[a-z0-9]+\[([0-9,]*)\]\S*|\(.*?\))\s+"
    r"([\w\-]+)\(([^)]*)\)"
)
# An operand: `%x` or `x`, or with its shape printed first (`f32[2,3]{1,0} %x`).
_OPERAND = re.compile(r"(?:[a-z0-9]+\[([0-9,]*)\]\S*\s+)?%?([\w.\-]+)(?:,\s*|$)")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _matmul_flops(opcode: str, line: str, out: list[int], operands: list[list[int]]) -> float:
    """2 * prod(output) * prod(contracted dims): one multiply and one add per product."""
    if opcode == "dot":
        found = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
        contracted = math.prod(operands[0][d] for d in _dims(found.group(1) if found else ""))
    else:  # convolution: each output element sums kernel-spatial x input-feature products
        kernel = operands[1]
        kernel_labels = re.search(r"dim_labels=[^_]*_([^-]*)->", line).group(1)
        contracted = math.prod(kernel) // kernel[kernel_labels.index("o")]
    return 2.0 * math.prod(out) * contracted


def dot_flops(hlo_text: str) -> float:
    """The matmul FLOPs (dots and convolutions) of one execution of an HLO module, per device
    for a compiled SPMD module. A dot inside a fusion or called computation counts once per
    call; a while-loop body counts once, as in XLA's own cost analysis."""
    own: dict[str, float] = {}
    callees: dict[str, list[str]] = {}
    shapes: dict[str, list[int]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            own[current], callees[current], shapes = 0.0, [], {}
            entry = current if header.group(1) else entry
            continue
        definition = _DEFINITION.match(line) if current else None
        if not definition:
            continue
        name, out_dims, opcode, operand_text = definition.groups()
        if out_dims is not None:
            shapes[name] = _dims(out_dims)
        callees[current] += _CALLED.findall(line)
        for listed in _CALLED_LIST.findall(line):
            callees[current] += [c.strip().lstrip("%") for c in listed.split(",") if c.strip()]
        if opcode in ("dot", "convolution"):
            operands = [
                _dims(dims) if dims else shapes[operand]
                for dims, operand in _OPERAND.findall(operand_text)
            ]
            own[current] += _matmul_flops(opcode, line, _dims(out_dims), operands)

    totals: dict[str, float] = {}

    def total(computation: str) -> float:
        if computation not in totals:
            totals[computation] = own.get(computation, 0.0) + sum(
                total(c) for c in callees.get(computation, ())
            )
        return totals[computation]

    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return total(entry)
