"""The work an XLA program performs, read off its HLO text: matmul FLOPs and all FLOPs.

`executed` counts a while loop's body once per iteration (its known trip count), so a rolled
(scanned) program reports the work of its unrolled form without compiling that form. FLOPs are
counted by XLA's cost-analysis rules (`HloCostAnalysis`): `2 * prod(output) * prod(contracted)`
per dot or convolution, one per output element of a non-transcendental elementwise instruction
(converts, compares and selects included; exponentials, logs, square roots and the like are
transcendentals, not FLOPs), one application of the reducer per reduced element (reduce,
reduce-window), one per output element of an all-reduce; data movement is free. On loop-free
programs the count is XLA's within a few scalar FLOPs (tests/test_cost.py).
"""

from __future__ import annotations

import dataclasses
import math
import re

from parity.analysis.hlo import TRIP_COUNT

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
_CALLS_ONE = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_MATMUL = re.compile(r"=.*\s(?:dot|convolution)\(")
_RESULT_TYPE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s")

# One FLOP per output element (XLA's `HandleElementwiseOp`, transcendentals excluded).
ELEMENTWISE = frozenset(
    (
        *("abs", "add", "and", "ceil", "clamp", "clz", "compare", "complex", "convert"),
        *("divide", "floor", "imag", "is-finite", "maximum", "minimum", "multiply", "negate"),
        *("not", "or", "popcnt", "real", "reduce-precision", "remainder", "round-nearest-afz"),
        *("round-nearest-even", "select", "shift-left", "shift-right-arithmetic"),
        *("shift-right-logical", "sign", "stochastic-convert", "subtract", "xor"),
    )
)


# Instructions whose `to_apply` is a reducer (XLA counts it per reduced element; a `call`'s
# `to_apply` runs once). The collectives' and scatters' reducers are not counted.
_REDUCING = frozenset(
    (
        *("reduce", "reduce-window", "all-reduce", "all-reduce-start", "reduce-scatter"),
        *("scatter", "select-and-scatter", "sort"),
    )
)


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs of one execution of a program, per device for a compiled SPMD module."""

    flops: float  # everything: matmuls and elementwise work
    dot_flops: float  # matmuls (dots and convolutions) only


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


def _elements(dims: list[int] | None) -> int:
    return math.prod(dims) if dims is not None else 0


def executed(hlo_text: str, loops_once: bool = False) -> Work:
    """The FLOPs one execution of an HLO module performs. A while loop's body counts once per
    iteration of its known trip count (a loop without one raises), its condition once more;
    with `loops_once` each counts once, as XLA's own cost analysis does."""
    own: dict[str, list[float]] = {}  # computation -> [flops, dot flops] of its own instructions
    callees: dict[str, list[tuple[str, float]]] = {}  # computation -> (callee, times called)
    shapes: dict[str, list[int]] = {}
    entry = current = None
    matmuls_written = matmuls_read = 0
    for line in hlo_text.splitlines():
        matmuls_written += bool(_MATMUL.search(line))
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            own[current], callees[current], shapes = [0.0, 0.0], [], {}
            entry = current if header.group(1) else entry
            continue
        definition = _DEFINITION.match(line) if current else None
        if not definition:
            continue
        name, out_dims, opcode, operand_text = definition.groups()
        out = _dims(out_dims) if out_dims is not None else None
        if out is not None:
            shapes[name] = out
        operands = [
            _dims(dims) if dims else shapes.get(operand)
            for dims, operand in _OPERAND.findall(operand_text)
        ]
        trips = 1.0
        if opcode == "while" and not loops_once:
            found = TRIP_COUNT.search(line)
            if found is None:
                raise ValueError(f"a while loop without a known trip count: {line.strip()[:200]}")
            trips = float(found.group(1))
        for kind, callee in _CALLS_ONE.findall(line):
            times = {"body": trips, "condition": trips + (not loops_once)}.get(kind, 1.0)
            if kind == "to_apply" and opcode in _REDUCING:  # once per reduced element
                times = _reductions(opcode, line, out, operands)
            callees[current].append((callee, times))
        for listed in _CALLED_LIST.findall(line):
            callees[current] += [(c.strip().lstrip("%"), 1.0) for c in listed.split(",") if c]
        if opcode in ("dot", "convolution"):
            matmuls_read += 1
            matmul = _matmul_flops(opcode, line, out, operands)
            own[current][0] += matmul
            own[current][1] += matmul
        elif opcode in ELEMENTWISE:
            own[current][0] += _elements(out)
        elif opcode in ("all-reduce", "all-reduce-start"):  # every array of a tuple result
            own[current][0] += sum(_elements(_dims(d)) for d in _result_arrays(line))

    if matmuls_read != matmuls_written:  # a matmul this parser missed would count as none
        raise ValueError(f"read {matmuls_read} of the {matmuls_written} matmuls in the HLO text")
    totals: dict[str, tuple[float, float]] = {}

    def total(computation: str) -> tuple[float, float]:
        if computation not in own:
            raise ValueError(f"computation {computation!r} is called but not in the HLO text")
        if computation not in totals:
            flops, dots = own[computation]
            for callee, times in callees.get(computation, ()):
                callee_flops, callee_dots = total(callee)
                flops, dots = flops + times * callee_flops, dots + times * callee_dots
            totals[computation] = (flops, dots)
        return totals[computation]

    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Work(*total(entry))


def _first_array(line: str) -> list[int] | None:
    arrays = _result_arrays(line)
    return _dims(arrays[0]) if arrays else None


def _result_arrays(line: str) -> list[str]:
    found = _RESULT_TYPE.match(line)
    return re.findall(r"[a-z0-9]+\[([0-9,]*)\]", found.group(1)) if found else []


def _reductions(opcode: str, line: str, out: list[int] | None, operands: list) -> float:
    """How many times an instruction applies its reducer (`to_apply`)."""
    if opcode == "reduce":
        inputs = _elements(operands[0]) if operands and operands[0] is not None else 0
        return float(inputs - _elements(out if out is not None else _first_array(line)))
    if opcode == "reduce-window":  # each output element reduces its window
        window = re.search(r"window=\{size=([0-9x]+)", line)
        size = math.prod(int(d) for d in window.group(1).split("x")) if window else 1
        return float(_elements(out if out is not None else _first_array(line)) * (size - 1))
    return 0.0  # an all-reduce counts its output elements itself


def dot_flops(hlo_text: str) -> float:
    """The matmul FLOPs (dots and convolutions) of one execution of an HLO module, per device
    for a compiled SPMD module. A dot inside a fusion or called computation counts once per
    call; a while-loop body counts once, as in XLA's own cost analysis."""
    return executed(hlo_text, loops_once=True).dot_flops
