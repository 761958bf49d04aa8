"""The layering reads from the folder names: `migrate/` never imports `parity/`, no module-level
import cycle anywhere, every module imports alone, and the two front ends share one engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("migrate", "parity")


def modules() -> dict[str, Path]:
    """Every module of the two packages: dotted name -> file."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(path: Path, module_level_only: bool) -> set[str]:
    """The project modules `path` imports (`from a.b import c` counts `a.b` and `a.b.c`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # `if TYPE_CHECKING:` blocks never run
        nodes = [
            n for n in nodes if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test))
        ]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def test_migrate_never_imports_parity():
    offenders = {
        name: sorted(i for i in imports(path, module_level_only=False) if i.startswith("parity"))
        for name, path in modules().items()
        if name.startswith("migrate")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_no_module_level_import_cycle():
    known = modules()
    graph = {
        name: {i for i in imports(path, module_level_only=True) if i in known and i != name}
        for name, path in known.items()
    }
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles[:3]


@pytest.mark.slow
def test_every_module_imports_alone():
    """A fresh interpreter per module: an import that only works after another module was
    imported (a hidden cycle or order dependency) fails here."""

    def import_alone(name: str) -> tuple[str, int, str]:
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return name, done.returncode, done.stderr.strip().splitlines()[-1:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(import_alone, sorted(modules())))
    failed = {name: err for name, code, err in results if code != 0}
    assert not failed, failed


def test_both_front_ends_run_the_engine_checks():
    """`parity CONFIG` and `compare_modules` call the same check functions: no numeric or
    sharding comparison lives in only one of them."""
    from parity import cli, pairs
    from parity.decoder import checks as decoder_checks
    from parity.engine import checks as engine_checks
    from parity.engine import programs

    assert list(decoder_checks.CHECKS) == list(cli.CHECK_NAMES)
    shared = {"roundtrip", "init", "forward", "grads", "sharding", "program", "train", "layers"}
    for name in shared:
        assert decoder_checks.CHECKS[name] is pairs.AVAILABLE[name], name
        assert decoder_checks.CHECKS[name].__module__ in (engine_checks.__name__, programs.__name__)


def test_no_module_is_over_400_lines_without_a_stated_reason():
    """Short modules with one job; the exceptions say why in their first lines."""
    long = {
        name: len(path.read_text().splitlines())
        for name, path in modules().items()
        if len(path.read_text().splitlines()) > 400
    }
    unexplained = {
        name: lines
        for name, lines in long.items()
        if "Longer than 400 lines" not in modules()[name].read_text()[:3000]
    }
    assert not unexplained, unexplained
