"""The README's first screen cannot drift from the code: it begins with the two commands that
work on a fresh machine; its first `python` block (a Linen MLP, its NNX port and the pytest test
gating them) runs and its test passes as written; and the failure it shows next is what a port
whose `fc1` computes in bfloat16 prints: every line shown, in order (decimal numbers and column
padding aside; `...` stands for the records left out)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx
from test_guide import FENCE, shown

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

README = Path(__file__).resolve().parent.parent / "README.md"


def first_blocks() -> tuple[str, str, int]:
    """The README's first ```python block, the first ```text block after it, and the line of
    the python block's first line."""
    text = README.read_text()
    blocks = [(m.group(1).strip(), m.group(2), m.start(2)) for m in FENCE.finditer(text)]
    at = next(i for i, (info, _, _) in enumerate(blocks) if info == "python")
    shown_failure = next(code for info, code, _ in blocks[at:] if info == "text")
    return blocks[at][1], shown_failure, text.count("\n", 0, blocks[at][2]) + 1


def test_the_readme_begins_with_the_two_commands_of_a_fresh_machine():
    text = README.read_text()
    commands = re.match(r"# [^\n]+\n+```bash\n(.*?)```", text, re.S)
    assert commands, "the README's first block is no longer its commands"
    assert [line.split()[:2] for line in commands.group(1).splitlines()] == [
        ["make", "parity"],
        ["make", "test"],
    ]


def test_the_readme_pair_passes_and_its_failure_is_what_a_bfloat16_fc1_prints():
    code, failure, line = first_blocks()
    # A real module: dataclasses (Linen modules) look their module up in sys.modules.
    module = types.ModuleType("readme_example")
    sys.modules[module.__name__] = module
    try:
        exec(compile("\n" * (line - 1) + code, str(README), "exec"), module.__dict__)
        module.test_mlp_port()  # as pytest would run it
        port = module.NNXMLP(nnx.Rngs(0))
        port.fc1 = nnx.Linear(4, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        with pytest.raises(AssertionError) as raised:
            module.assert_parity(module.LinenMLP(), port, jnp.ones((2, 4)))
    finally:
        del sys.modules[module.__name__]
    printed = [shown(row) for row in str(raised.value).splitlines()]
    at = 0
    for row in failure.splitlines():
        if row.strip() == "...":
            continue
        assert shown(row) in printed[at:], f"README: {row!r} is not printed here:\n{raised.value}"
        at = printed.index(shown(row), at) + 1
