"""The runnable recipes of docs/checkpoints.md (your own model's weights: the converters, Orbax on
each side, a conversion hook) and docs/ci.md (your own pair under pytest) run: each document's
`python` blocks (not those marked `no-run`), in order, in a namespace of its own, and then every
`test_*` function they define, as pytest would. A failure's traceback points at the document's
own line."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from test_guide import guide_blocks

# The default stack only: the oldest stack's layer runs the guide, the README's pair, and the
# converters' and checkpoints' own tests (`compat`), which these recipes call.

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("document", ["checkpoints.md", "ci.md"])
def test_the_documents_python_blocks_run(document):
    path = DOCS / document
    blocks = [b for b in guide_blocks(path.read_text()) if b.runs]
    assert blocks, f"{document} lost its runnable blocks"
    # A real module: dataclasses (Linen modules) look their module up in sys.modules.
    module = types.ModuleType(f"doc_{path.stem}")
    sys.modules[module.__name__] = module
    try:
        for block in blocks:
            source = "\n" * (block.line - 1) + block.code  # line numbers match the document's
            exec(compile(source, str(path), "exec"), module.__dict__)
        tests = [f for name, f in vars(module).items() if name.startswith("test_")]
        for test in tests:
            test()
    finally:
        del sys.modules[module.__name__]
    if document == "ci.md":
        assert len(tests) == 2
