"""The layering reads from the folder names: `migrate/` never imports `parity/`, no module-level
import cycle anywhere, every module imports alone, and the two front ends share one engine."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


# Run in one fresh interpreter: before each module, every project module is dropped from
# `sys.modules`, so each is imported first with none of ours loaded (JAX and Flax stay loaded:
# one interpreter per module cost ~30 s of the suite for the same proof about our modules).
IMPORT_EACH_ALONE = """
import importlib, json, sys, traceback
failed = {}
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("migrate", "parity")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc().strip().splitlines()[-1]
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_module_imports_alone():
    """Each module imported with no other project module loaded: an import that only works
    after another module was imported (a hidden cycle or order dependency) fails here."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, *sorted(modules())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
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
