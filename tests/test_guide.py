"""docs/migration-guide.md cannot drift from the code: each numbered section's `python` blocks
run, in order, in a namespace of their own (one test per section: a section runs alone, as a
reader copies it); a ```text output block is what the python block before it prints (decimal
numbers and column padding aside); a ```python file=PATH block is that file's text, verbatim;
and every relative link, section anchor, linked function or class, and named test exists."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "migration-guide.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
# [`Pipeline.run_stages`](../migrate/linen/pipeline.py): a name that file must define.
NAME_LINK = re.compile(r"\[`([A-Za-z_][\w.]*)`\]\(([^)#\s]+\.py)\)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_REF = re.compile(r"`(tests/test_\w+\.py)::(\w+)(?:\[(\w+)\])?`")
# `## 3. Stacked layers: ...`: a numbered section's heading.
SECTION = re.compile(r"^## (\d+)\. ", re.M)
DECIMAL = re.compile(r"\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+")


@dataclass(frozen=True)
class Block:
    info: str  # the fence's info string: "python", "python no-run", "python file=PATH"
    code: str
    line: int  # 1-based line of the first code line in the guide

    @property
    def runs(self) -> bool:
        words = self.info.split()
        return bool(words) and words[0] == "python" and "no-run" not in words[1:]

    @property
    def file(self) -> str | None:
        return next((w[5:] for w in self.info.split() if w.startswith("file=")), None)


def guide_blocks(text: str) -> list[Block]:
    return [
        Block(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start(2)) + 1)
        for m in FENCE.finditer(text)
    ]


def defined_names(path: Path) -> set[str]:
    """Every class and function a file defines, by dotted name (`Pipeline.run_stages`)."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + child.name)
                visit(child, prefix + child.name + ".")

    visit(ast.parse(path.read_text()), "")
    return names


def guide_sections(text: str) -> dict[str, list[Block]]:
    """Each numbered section's blocks (`## 3. Stacked layers ...` -> "3"), in the guide's
    order; a section's subsections are part of it. Headings are read outside the fences (a
    block's `# comment` is none)."""
    outside = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    starts = [
        (outside.count("\n", 0, m.start()) + 1, m.group(1)) for m in SECTION.finditer(outside)
    ]
    ends = [line for line, _ in starts[1:]] + [text.count("\n") + 2]
    blocks = guide_blocks(text)
    return {
        number: [b for b in blocks if first < b.line < end]
        for (first, number), end in zip(starts, ends, strict=True)
    }


SECTIONS = guide_sections(GUIDE.read_text())


def test_the_guide_keeps_its_runnable_sections():
    runnable = {n: sum(b.runs for b in blocks) for n, blocks in SECTIONS.items()}
    assert sum(runnable.values()) >= 20, "the guide lost its runnable examples"
    assert [n for n, count in runnable.items() if count] == [str(n) for n in range(14)], runnable


@pytest.mark.parametrize("section", [n for n, blocks in SECTIONS.items() if blocks])
def test_each_guide_section_runs_alone(section):
    """A section's blocks, in order, in a fresh namespace: what a section uses, it defines or
    imports itself. A failure's traceback points at the guide's own line."""
    # The guide imports its example pairs as `docs.examples...`, from the repository's root.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    # A real module: dataclasses (Linen modules) look their module up in sys.modules.
    module = types.ModuleType(f"migration_guide_{section}")
    sys.modules[module.__name__] = module
    printed = ""
    try:
        for block in SECTIONS[section]:
            if block.info.split() == ["text", "output"]:
                assert shown(block.code) == shown(printed), (
                    f"guide line {block.line}: the shown output is not what the code prints:\n"
                    + printed
                )
            if not block.runs:
                continue
            source = "\n" * (block.line - 1) + block.code  # line numbers match the guide's
            with contextlib.redirect_stdout(io.StringIO()) as stdout:
                exec(compile(source, str(GUIDE), "exec"), module.__dict__)
            printed = stdout.getvalue()
    finally:
        del sys.modules[module.__name__]


def shown(text: str) -> str:
    """Output as compared: decimal numbers and column padding vary across the stacks."""
    return re.sub(r"[ \t]+", " ", DECIMAL.sub("#", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_section_link_has_its_heading():
    text = GUIDE.read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", FENCE.sub("", text), re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 10
    assert set(links) <= anchors, set(links) - anchors


def test_every_fence_is_declared_and_file_blocks_are_verbatim():
    blocks = guide_blocks(GUIDE.read_text())
    for block in blocks:
        assert block.info.split()[:1] in (["python"], ["bash"], ["text"]), block
        if block.file:
            assert (REPO / block.file).read_text() == block.code, (
                f"guide line {block.line}: the block differs from {block.file}"
            )
    assert any(block.file for block in blocks)


def test_every_relative_link_resolves():
    text = GUIDE.read_text()
    targets = [t for t in LINK.findall(text) if not t.startswith(("http", "#", "mailto:"))]
    assert targets
    missing = [t for t in targets if not (GUIDE.parent / t.split("#")[0]).exists()]
    assert not missing, missing


def test_every_linked_twin_name_is_defined_in_its_file():
    links = NAME_LINK.findall(GUIDE.read_text())
    assert len(links) >= 20
    for name, target in links:
        path = (GUIDE.parent / target).resolve()
        assert name in defined_names(path), f"{name} is not defined in {target}"


def test_every_named_test_exists():
    references = TEST_REF.findall(GUIDE.read_text())
    assert len(references) >= 15
    for file, test, param in references:
        source = (REPO / file).read_text()
        assert f"def {test}(" in source, f"{file}::{test}"
        if param:
            assert f"def {param}(" in source or f'"{param}"' in source, f"{file}::{test}[{param}]"


# Each idiom's Linen and NNX forms appear in runnable code; the rest are named in the text.
IN_CODE = (
    "init(",
    "nnx.Rngs",
    "LogicallyPartitioned",
    "out_sharding",
    "nn.scan",
    "nnx.scan",
    "nnx.transform_metadata",
    "nn.vmap",
    "jax.vmap",
    "nn.remat",
    "nnx.remat",
    "sow(",
    "nnx.capture",
    "nn.with_logical_constraint",
    "sharding.constrain",
    "rngs={",
    "value_and_grad",
    "compare_modules",
    "assert_parity",
)
IN_TEXT = ("jax.checkpoint", "make_rng", "spmd_axis_name", "capture_intermediates")


@pytest.mark.parametrize("idiom", IN_CODE + IN_TEXT)
def test_the_guide_covers_every_idiom(idiom):
    text = GUIDE.read_text()
    code = "\n".join(b.code for b in guide_blocks(text) if b.runs)
    assert idiom in (code if idiom in IN_CODE else text), idiom
