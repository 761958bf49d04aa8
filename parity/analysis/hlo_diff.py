"""Two compiled programs, diffed instruction by instruction.

Twins that compile to the same program compute the same thing on every input, mesh-wide; that
is the strongest parity evidence there is, and it sees what values on a CPU cannot: a matmul
precision, a sharding constraint that happens not to change this mesh's program, a remat
policy. Both the pre-optimisation HLO (what the frameworks emitted) and the optimised HLO (what
XLA made of it) are compared, after renaming every instruction and computation canonically in
order of definition (names come from the tracing context, `jit_silu_` against `vmap_jit_silu__`)
and dropping metadata. When they differ, the first differing instruction is named with its op,
shape, dtype, attributes (precision, sharding) and the source line that emitted it on each side,
read from the HLO's stack-frame tables.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([A-Za-z_][\w.\-]*)\s*[({]")
_IDENT = re.compile(r"%?[A-Za-z_][\w.\-]*")
_METADATA = re.compile(r",?\s*metadata=\{([^}]*)\}")
_OP = re.compile(r"^(\S+(?:\s*\{[^}]*\})?|\([^)]*\))\s+([a-z][\w\-]*)\(")
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its canonical text (names renamed, metadata dropped) and where the
    framework emitted it."""

    computation: str
    canonical: str
    op: str
    shape: str
    op_name: str  # the JAX op path, e.g. jit(train_step)/jvp()/while/body/.../dot_general
    source: str  # file:line (function) of the innermost user frame, when recorded

    @property
    def signature(self) -> str:
        """Op, result shape and attributes without operand names: what an instruction *is*."""
        return re.sub(r"\(([^()]*)\)", "(...)", self.canonical.split("=", 1)[-1], count=1)

    def describe(self) -> str:
        where = f" at {self.source}" if self.source else ""
        text = self.canonical.split("=", 1)[-1].strip()
        return f"{text[:300]}{where}" + (f" [{self.op_name}]" if self.op_name else "")


def _fields(text: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in _FIELD.findall(text)}


def _frame_sources(table_lines: dict[str, list[str]]) -> dict[str, str]:
    """stack_frame_id -> 'file:line (function)' from the module's frame tables."""

    def rows(name: str) -> dict[str, str]:
        out = {}
        for line in table_lines.get(name, []):
            m = _TABLE_ROW.match(line.strip())
            if m:
                out[m.group(1)] = m.group(2)
        return out

    files = {k: v.strip('"') for k, v in rows("FileNames").items()}
    functions = {k: v.strip('"') for k, v in rows("FunctionNames").items()}
    locations = {k: _fields(v) for k, v in rows("FileLocations").items()}
    frames = {
        frame: (
            _fields(text).get("file_location_id", ""),
            _fields(text).get("parent_frame_id", "0"),
        )
        for frame, text in rows("StackFrames").items()
    }

    def text(location_id: str) -> tuple[str, str]:
        location = locations.get(location_id, {})
        file = files.get(location.get("file_name_id", ""), "?")
        function = functions.get(location.get("function_name_id", ""), "?")
        return file, f"{_short(file)}:{location.get('line', '?')} ({function})"

    sources = {}
    for frame in frames:
        # Innermost first; the printed parent id is the parent's id + 1 (0: no parent). The
        # first frame outside installed libraries is the line a contributor can act on.
        chain, current, seen = [], frame, set()
        while current in frames and current not in seen:
            seen.add(current)
            location_id, parent = frames[current]
            chain.append(text(location_id))
            current = str(int(parent) - 1) if parent.isdigit() else ""
        user = [shown for file, shown in chain if "site-packages" not in file]
        sources[frame] = (user or [shown for _, shown in chain] or [""])[0]
    return sources


def _short(path: str) -> str:
    """A source path from the project's root (`migrate/nnx/layers.py`) when recognisable."""
    for root in ("migrate/", "parity/", "tests/", "docs/"):
        index = path.rfind("/" + root)
        if index >= 0:
            return path[index + 1 :]
    return path


def _split(hlo_text: str) -> tuple[dict[str, list[str]], list[str]]:
    """(the stack-frame tables by name, the module's body lines)."""
    tables: dict[str, list[str]] = {}
    body: list[str] = []
    table = None
    for line in hlo_text.splitlines():
        if line.startswith(_TABLES):
            table = line.split()[0]
            tables[table] = []
        elif table is not None and line.strip():
            tables[table].append(line)
        elif table is not None:
            table = None
        elif line.strip() and not line.startswith("HloModule"):
            body.append(line)
    return tables, body


def parse(hlo_text: str) -> list[Instruction]:
    """The instructions of an HLO module in text order, names canonical, metadata resolved."""
    tables, body = _split(hlo_text)
    sources = _frame_sources(tables)

    defined: dict[str, None] = {}
    for line in body:
        m = _DEFINITION.match(line)
        if m:
            defined.setdefault(m.group(1), None)
        elif not line.startswith((" ", "}")):
            c = _COMPUTATION.match(line)
            if c:
                defined.setdefault(c.group(1), None)
    canonical_names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        name = m.group(0).lstrip("%")
        if name in defined:
            return canonical_names.setdefault(name, f"v{len(canonical_names)}")
        return m.group(0)

    instructions = []
    computation = ""
    for line in body:
        metadata = _METADATA.search(line)
        meta = _fields(metadata.group(1)) if metadata else {}
        stripped = _METADATA.sub("", line)
        text = _IDENT.sub(rename, stripped).strip()
        m = _DEFINITION.match(line)
        if not m:
            if not line.startswith((" ", "}")):
                computation = text
            continue
        rhs = _METADATA.sub("", m.group(2))
        op = _OP.match(rhs)
        source = sources.get(meta.get("stack_frame_id", ""), "")
        if not source and "source_file" in meta:
            source = f"{_short(meta['source_file'])}:{meta.get('source_line', '?')}"
        instructions.append(
            Instruction(
                computation=computation,
                canonical=text,
                op=op.group(2) if op else "?",
                shape=op.group(1) if op else "?",
                op_name=meta.get("op_name", ""),
                source=source,
            )
        )
    return instructions


@dataclasses.dataclass(frozen=True)
class ProgramDiff:
    """How two programs differ: identical, or the first differing instructions on each side."""

    identical: bool
    instructions: tuple[int, int]  # instruction counts, Linen and NNX
    kind: str = ""  # 'replaced', 'only in Linen', 'only in NNX', 'wiring'
    position: int = 0  # index of the first differing Linen instruction
    linen: tuple[Instruction, ...] = ()
    nnx: tuple[Instruction, ...] = ()

    def summary(self, label: str) -> str:
        if self.identical:
            return f"{label}: identical ({self.instructions[0]} instructions)"
        shown = lambda side: "; ".join(i.describe() for i in side[:2]) or "-"
        return (
            f"{label}: {self.kind} at instruction {self.position}: Linen {shown(self.linen)} "
            f"| NNX {shown(self.nnx)}"
        )


def diff_texts(linen: str, nnx: str) -> ProgramDiff:
    """`diff` of two HLO texts. Texts equal character for character (the twins' optimised
    programs, typically) are identical programs without parsing either (~0.3 s per 5,000
    instructions)."""
    if linen == nnx:
        count = sum(1 for line in _split(linen)[1] if _DEFINITION.match(line))
        return ProgramDiff(True, (count, count))
    return diff(parse(linen), parse(nnx))


def diff(linen: list[Instruction], nnx: list[Instruction], context: int = 2) -> ProgramDiff:
    """The first place where two parsed programs differ (or that they are identical).

    Signatures (op, shape, attributes; no operand names) are aligned first, so a dropped or
    added instruction is reported as such rather than as a shifted tail; when every signature
    matches, the first instruction whose operands are wired differently is reported."""
    sizes = (len(linen), len(nnx))
    if [i.canonical for i in linen] == [i.canonical for i in nnx]:
        return ProgramDiff(True, sizes)
    matcher = difflib.SequenceMatcher(
        a=[i.signature for i in linen], b=[i.signature for i in nnx], autojunk=False
    )
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        kind = {"replace": "replaced", "delete": "only in Linen", "insert": "only in NNX"}[tag]
        return ProgramDiff(
            False,
            sizes,
            kind,
            i1,
            tuple(linen[i1 : max(i2, i1 + 1)][:context]),
            tuple(nnx[j1 : max(j2, j1 + 1)][:context]),
        )
    first = next(
        k for k, (a, b) in enumerate(zip(linen, nnx, strict=False)) if a.canonical != b.canonical
    )
    return ProgramDiff(False, sizes, "wiring", first, (linen[first],), (nnx[first],))
