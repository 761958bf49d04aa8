"""Every place the repository names exists: a path (`parity/remote/worker.py`, `configs/`), a
Markdown link, a document by name (`pipeline.md`) and a module or a name in one
(`parity.maxtext.decoder_factory.WrongRelease`), wherever it is named: documents, configs,
scripts, and in Python the comments and strings (a test's own strings aside: a test names what
does not exist on purpose; its docstrings and comments count). A path inside an environment the
tools build (`.venv*`) or a pattern (`constraints/py$(...)`, `configs/*.yml`, `NAME.yml`) names
no one file. A move that leaves a stale name behind fails here."""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

REPO = Path(__file__).resolve().parent.parent
TOP = ("migrate", "parity", "tests", "bench", "docs", "configs", "constraints", ".ci")
SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".sh", ".txt", ".cfg"}
# `parity/remote/worker.py`, `configs/maxtext/`, `.ci/run`: a path from the repository's root.
TOPS = "|".join(re.escape(top) for top in TOP)
PATH = re.compile(rf"(?<![\w./-])((?:{TOPS})/[\w./-]*[\w/])")
# `parity.maxtext.decoder_factory.WrongRelease`: a module of ours, and a name in it.
DOTTED = re.compile(r"(?<![\w./-])((?:migrate|parity)(?:\.[A-Za-z_]\w*)+)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
DOCUMENT = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
# A name standing for any file: `configs/maxtext/NAME.yml`, `migrate/linen/X.py`, `<run>`.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[<{*]")


@functools.cache
def tracked_files() -> tuple[Path, ...]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [REPO / name for name in listed]
    return tuple(
        f for f in files if f.is_file() and (f.suffix in SUFFIXES or f.name in ("Makefile", "run"))
    )


def _placeholder(path: str) -> bool:
    parts = [part for part in path.split("/") if part]
    return any(PLACEHOLDER.search(Path(p).stem) or p.startswith(".venv") for p in parts)


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The first line of every docstring (module, class, function) of a parsed module."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                lines.add(body[0].lineno)
    return lines


def named_text(file: Path) -> str:
    """The text of `file` that names things: all of it, or of Python its comments and strings
    (of a test, its comments and docstrings)."""
    text = file.read_text(errors="replace")
    if file.suffix != ".py":
        return text
    is_test = file.parent.name == "tests"
    docstrings = _docstring_lines(ast.parse(text)) if is_test else set()
    # Python 3.12 tokenizes an f-string's text as FSTRING_MIDDLE
    strings = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    kept = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        named = token.type == tokenize.COMMENT or (
            token.type in strings and (not is_test or token.start[0] in docstrings)
        )
        if named:
            kept.append(token.string)
    return "\n".join(kept)


@functools.cache
def _defined(module_file: Path) -> frozenset[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.ClassDef):
                    names.add(inner.name)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
                elif isinstance(inner, ast.Import | ast.ImportFrom):
                    names.update((a.asname or a.name).split(".")[0] for a in inner.names)
    return frozenset(names)


def dotted_problem(name: str) -> str | None:
    """Why `name` (`parity.engine.side.Side`) names nothing, or None: its longest module prefix
    must be a module or package of ours, and the first part after it a name that module binds."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        module = base.with_suffix(".py")
        package = base / "__init__.py"
        if module.is_file() or package.is_file():
            rest = parts[cut:]
            if not rest:
                return None
            source = module if module.is_file() else package
            if rest[0] in _defined(source) or (base / rest[0]).exists():
                return None
            return f"{'.'.join(parts[:cut])} has no {rest[0]!r}"
    return "no such module"


def problems_in(file: Path) -> list[str]:
    text = named_text(file)
    found = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        pattern = text[match.end() : match.end() + 1] in ("$", "*", "{", "<", "%")
        if not pattern and not _placeholder(path) and not (REPO / path).exists():
            found.append(f"path {path}")
    if file.suffix == ".md":
        for match in MARKDOWN_LINK.finditer(text):
            target = match.group(1)
            if "://" in target or target.startswith("mailto:") or _placeholder(target):
                continue
            if not (file.parent / target).resolve().exists():
                found.append(f"link {target}")
    documents = {p.name for p in tracked_files() if p.suffix == ".md"}
    for match in DOCUMENT.finditer(text):
        if match.group(1) not in documents:
            found.append(f"document {match.group(1)}")
    for match in DOTTED.finditer(text):
        name = match.group(1).rstrip(".")
        if (why := dotted_problem(name)) is not None:
            found.append(f"module {name}: {why}")
    return found


def test_every_named_path_module_and_document_exists():
    missing = {
        str(file.relative_to(REPO)): sorted(set(found))
        for file in tracked_files()
        if (found := problems_in(file))
    }
    assert not missing, missing


@pytest.mark.parametrize(
    "text",
    [
        "see `parity/remote/maxtext.py`",
        "the factory `parity.remote.maxtext:make`",
        "`parity.decoder.checks._no_such_name`",
        "[the spec](no-such-doc.md)",
        "as PIPELINE.md says",
    ],
)
def test_a_stale_name_is_found(tmp_path, text):
    """Each kind of reference, pointing nowhere, is reported."""
    file = tmp_path / "note.md"
    file.write_text(text + "\n")
    assert problems_in(file)


def test_placeholders_and_existing_names_pass(tmp_path):
    note = tmp_path / "note.md"
    note.write_text(
        "`configs/maxtext/NAME.yml`, `migrate/linen/X.py`, `parity/engine/side.py`, "
        "`parity.engine.side.Side`, `parity.remote`, architecture.md\n"
    )
    assert problems_in(note) == []
