"""Facts read off compiled XLA programs: collective counts, memory and cost."""

from __future__ import annotations

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
