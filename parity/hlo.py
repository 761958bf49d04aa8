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
