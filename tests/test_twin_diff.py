"""The twins' diff is the migration: `migrate/linen/X.py` against `migrate/nnx/X.py`, statement by
statement, differs only where an idiom of `migrate.common.idioms` says it does.

Both files are read as statements (`ast.unparse`, one per line, without docstrings, comments
and type annotations; module-level imports sorted), the Linen twin's dataclass fields and
`setup` read as the `__init__` they stand for, and each idiom's rewrites applied. What still
differs must be a line an idiom lists for that twin, or lie in a function an idiom names; any
other difference fails, with its file, line and statement. Every pattern of the table must
explain something, so that the table stays the list of what the twins' diff holds.
"""

from __future__ import annotations

import ast
import copy
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from migrate.common import idioms

pytestmark = pytest.mark.compat  # no JAX: the oldest stack's layer (README, Stacks)

REPO = Path(__file__).resolve().parent.parent
TWINS = sorted(
    p.name
    for p in (REPO / "migrate" / "linen").glob("*.py")
    if (REPO / "migrate" / "nnx" / p.name).exists() and p.name != "__init__.py"
)
SIDES = ("linen", "nnx")


@dataclass(frozen=True)
class Statement:
    depth: int
    line: int  # in the twin's file
    text: str  # normalised
    scope: tuple[str, ...]  # enclosing classes and functions, a def's own name included

    @property
    def shown(self) -> str:
        return "    " * self.depth + self.text


@dataclass
class Usage:
    """Which patterns of the table explained something (keys: (idiom, kind, index))."""

    seen: set[tuple[str, str, int]] = field(default_factory=set)


def _strip_annotations(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            arguments = node.args
            for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
                arg.annotation = None
            for arg in (arguments.vararg, arguments.kwarg):
                if arg is not None:
                    arg.annotation = None


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _linen_constructor(cls: ast.ClassDef) -> bool:
    """Replace a Linen module's fields and `setup` by the `__init__` they stand for: its
    parameters are the fields (defaults kept), its body stores each on `self`, then `setup`'s."""
    fields = [
        s
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.simple
    ]
    if not fields:
        return False
    setup = next(
        (s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "setup"), None
    )
    names = [f.target.id for f in fields]
    stores = [
        ast.Assign(
            targets=[ast.Attribute(ast.Name("self", ast.Load()), name, ast.Store())],
            value=ast.Name(name, ast.Load()),
            lineno=f.lineno,
        )
        for name, f in zip(names, fields, strict=True)
    ]
    body = [s for s in (setup.body if setup else []) if not _is_docstring(s)]
    init = ast.FunctionDef(
        name="__init__",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg("self"), *(ast.arg(n) for n in names)],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[f.value for f in fields if f.value is not None],
        ),
        body=stores + body,
        decorator_list=[],
        returns=None,
        type_params=[],
        lineno=fields[0].lineno,
    )
    at = cls.body.index(fields[0])
    cls.body = [s for s in cls.body if s not in fields and s is not setup]
    cls.body.insert(at, init)
    ast.fix_missing_locations(init)
    return True


def _header(node: ast.stmt) -> str:
    """The first line of a compound statement (`def f(x):`, `if x:`), without its body."""
    bare = copy.copy(node)
    if hasattr(bare, "decorator_list"):
        bare.decorator_list = []
    for name in ("body", "orelse", "finalbody", "handlers"):
        if hasattr(bare, name):
            setattr(bare, name, [ast.Pass()] if name == "body" else [])
    return ast.unparse(bare).splitlines()[0]


def statements(source: str, side: str, usage: Usage) -> list[Statement]:
    """`source` as normalised statements, each idiom's rewrites for `side` applied."""
    tree = ast.parse(source)
    _strip_annotations(tree)
    if side == "linen":
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and _linen_constructor(node):
                usage.seen.add(("constructor", "constructor", 0))
    imports: list[Statement] = []
    out: list[Statement] = []

    def visit(body: list[ast.stmt], depth: int, scope: tuple[str, ...]) -> None:
        for i, node in enumerate(body):
            if i == 0 and _is_docstring(node):
                continue
            if depth == 0 and isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(Statement(0, node.lineno, ast.unparse(node), scope))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = (*scope, node.name)
                for decorator in node.decorator_list:
                    text = "@" + ast.unparse(decorator)
                    out.append(Statement(depth, decorator.lineno, text, inner))
                out.append(Statement(depth, node.lineno, _header(node), inner))
                visit(node.body, depth + 1, inner)
            elif isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                out.append(Statement(depth, node.lineno, _header(node), scope))
                visit(node.body, depth + 1, scope)
                if getattr(node, "orelse", None):
                    out.append(Statement(depth, node.orelse[0].lineno, "else:", scope))
                    visit(node.orelse, depth + 1, scope)
            else:
                out.append(Statement(depth, node.lineno, ast.unparse(node), scope))

    visit(tree.body, 0, ())
    rewritten = [_rewrite(s, side, usage) for s in imports + out]
    return sorted(rewritten[: len(imports)], key=lambda s: s.text) + rewritten[len(imports) :]


def _rewrite(statement: Statement, side: str, usage: Usage) -> Statement:
    text = statement.text
    for idiom in idioms.IDIOMS:
        for index, (rewrite_side, pattern, replacement) in enumerate(idiom.rewrites):
            if rewrite_side == side:
                text, count = re.subn(pattern, replacement, text)
                if count:
                    usage.seen.add((idiom.name, "rewrite", index))
    return Statement(statement.depth, statement.line, text, statement.scope)


def _explained(statement: Statement, side: str, usage: Usage) -> bool:
    found = False
    for idiom in idioms.IDIOMS:
        lines = idiom.linen_lines if side == "linen" else idiom.nnx_lines
        for index, pattern in enumerate(lines):
            if re.fullmatch(pattern, statement.text):
                usage.seen.add((idiom.name, f"{side}_lines", index))
                found = True
        where = ".".join(statement.scope)
        for index, scope in enumerate(idiom.scopes):
            if where == scope or where.startswith(scope + "."):
                usage.seen.add((idiom.name, "scopes", index))
                found = True
    return found


def unexplained(
    name: str, linen_source: str, nnx_source: str, usage: Usage | None = None
) -> list[str]:
    """The differences between the twins' `name` that no idiom explains, as
    `path:line: statement` (the normalised statement, as compared)."""
    usage = Usage() if usage is None else usage
    both = {"linen": statements(linen_source, "linen", usage)}
    both["nnx"] = statements(nnx_source, "nnx", usage)
    matcher = difflib.SequenceMatcher(
        None, [s.shown for s in both["linen"]], [s.shown for s in both["nnx"]], autojunk=False
    )
    problems = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for side, (start, stop) in zip(SIDES, ((i1, i2), (j1, j2)), strict=True):
            for statement in both[side][start:stop]:
                if not _explained(statement, side, usage):
                    path = f"migrate/{side}/{name}"
                    problems.append(f"{path}:{statement.line}: {statement.text}")
    return problems


def _twin_sources(name: str) -> tuple[str, str]:
    return tuple((REPO / "migrate" / side / name).read_text() for side in SIDES)


@pytest.mark.parametrize("name", TWINS)
def test_every_difference_between_the_twins_is_a_listed_idiom(name):
    problems = unexplained(name, *_twin_sources(name))
    assert not problems, (
        "differences between the twins that are no idiom of migrate/common/idioms.py (remove "
        "the noise, or list the idiom with its why):\n" + "\n".join(problems)
    )


def test_every_pattern_of_the_idiom_table_explains_a_difference():
    """A pattern that explains nothing is stale: the table lists what the diff holds."""
    assert TWINS == ["decoder.py", "layers.py", "pipeline.py", "train.py"]
    usage = Usage()
    for name in TWINS:
        unexplained(name, *_twin_sources(name), usage=usage)
    declared = set()
    for idiom in idioms.IDIOMS:
        declared |= {(idiom.name, "rewrite", i) for i in range(len(idiom.rewrites))}
        declared |= {(idiom.name, "linen_lines", i) for i in range(len(idiom.linen_lines))}
        declared |= {(idiom.name, "nnx_lines", i) for i in range(len(idiom.nnx_lines))}
        declared |= {(idiom.name, "scopes", i) for i in range(len(idiom.scopes))}
        if idiom.constructor:
            declared.add((idiom.name, "constructor", 0))
    assert declared - usage.seen == set()
    assert len({i.name for i in idioms.IDIOMS}) == len(idioms.IDIOMS)


# Noise injected into one twin's text, in memory: (twin, file, anchor, replacement, the
# statement the failure must name, as the file spells it on one line).
INJECTED = [
    pytest.param(
        "nnx",
        "layers.py",
        "query = constrain(query, axes.BATCH_LENGTH_HEADS_KV, self.mesh, rules)",
        "query = sharding.constrain(query, axes.BATCH_LENGTH_HEADS_KV, self.mesh, rules)",
        "query = sharding.constrain(query, axes.BATCH_LENGTH_HEADS_KV, self.mesh, rules)",
        id="a call site spelled its own way",
    ),
    pytest.param(
        "linen",
        "pipeline.py",
        "        num_micro = cfg.num_microbatches\n",
        "        num_micro = self.config.num_microbatches\n",
        "num_micro = self.config.num_microbatches",
        id="the same value read another way",
    ),
    pytest.param(
        "nnx",
        "decoder.py",
        "        x = self.decoder_norm(x)\n",
        "        x = self.decoder_norm(x)\n        x = x.astype(x.dtype)\n",
        "x = x.astype(x.dtype)",
        id="a statement only one twin has",
    ),
    pytest.param(
        "linen",
        "train.py",
        "    loss_fn = make_loss_fn(cfg, model)\n    return lambda",
        "    loss = make_loss_fn(cfg, model)\n    loss_fn = loss\n    return lambda",
        "loss = make_loss_fn(cfg, model)",
        id="a renamed local",
    ),
]


@pytest.mark.parametrize("side,name,anchor,replacement,named", INJECTED)
def test_a_difference_that_is_no_idiom_fails_naming_its_file_line_and_text(
    side, name, anchor, replacement, named
):
    sources = dict(zip(SIDES, _twin_sources(name), strict=True))
    assert sources[side].count(anchor) == 1, "the injection's anchor moved"
    sources[side] = sources[side].replace(anchor, replacement)
    line = next(n for n, text in enumerate(sources[side].splitlines(), 1) if text.strip() == named)
    problems = unexplained(name, sources["linen"], sources["nnx"])
    assert f"migrate/{side}/{name}:{line}: {named}" in problems, problems
    # Nothing else is named but the statement it displaced in the other twin.
    assert len([p for p in problems if p.startswith(f"migrate/{side}/")]) <= 2, problems
    assert len(problems) <= 3, problems
    assert not unexplained(name, *_twin_sources(name)), "the twins themselves must pass"


def test_the_migration_guide_shows_the_idiom_table():
    """The guide renders the table (`markdown_table`) and names what the diff normalises."""
    guide = (REPO / "docs" / "migration-guide.md").read_text()
    assert idioms.markdown_table() in guide, "render `idioms.markdown_table()` into the guide"
    prose = " ".join(guide.split())
    for normalisation in idioms.NORMALISATIONS:
        assert normalisation.name in prose, normalisation.name
