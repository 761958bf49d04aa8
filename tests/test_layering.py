"""The layering reads from the folder names: `migrate/` never imports `parity/`, no module-level
import cycle anywhere, every module imports alone, and the two front ends share one engine."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("migrate", "parity")


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the two packages under `root`: dotted name -> file."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _never_run(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` blocks: imports for type checkers only."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)


def _import_nodes(tree: ast.Module, module_level_only: bool) -> list[ast.AST]:
    if module_level_only:
        return [n for n in tree.body if not _never_run(n)]
    found: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if not _never_run(child):
                found.append(child)
                pending.append(child)
    return found


def imports(path: Path, module_level_only: bool, known: Iterable[str] = ()) -> set[str]:
    """The project modules `path` imports: at the top of the module, or anywhere (inside
    functions too) with `module_level_only=False`. `from a.b import c` counts `a.b.c` when
    that is a module of `known`, else `a.b` (a package's `__init__` runs on every import of
    its submodules; those edges are not counted, and `__init__`s import nothing at their top:
    `test_package_inits_import_nothing_at_their_top`)."""
    known = set(known)
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in _import_nodes(tree, module_level_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph(root: Path = REPO, module_level_only: bool = False) -> dict[str, set[str]]:
    known = modules(root)
    return {
        name: {i for i in imports(path, module_level_only, known) if i in known and i != name}
        for name, path in known.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of `graph`, each as the path that closes it."""
    state: dict[str, str] = {}
    found: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_migrate_never_imports_parity():
    offenders = {
        name: sorted(i for i in imports(path, module_level_only=False) if i.startswith("parity"))
        for name, path in modules().items()
        if name.startswith("migrate")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_no_import_cycle_lazy_imports_included():
    """Imports inside functions count: a lazy import that closes a cycle is a cycle."""
    found = cycles(import_graph())
    assert not found, found[:3]


def test_a_seeded_lazy_cycle_is_found(tmp_path):
    """The cycle finder sees an import inside a function (the cycle that
    `parity.decoder.twins` -> `drilldown` once was), and ignores `TYPE_CHECKING` imports."""
    package = tmp_path / "parity"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from parity import b\n")
    (package / "b.py").write_text("def late():\n    from parity import a\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from parity import a\n"
    )
    (tmp_path / "migrate").mkdir()
    graph = import_graph(tmp_path)
    assert graph["parity.c"] == set()
    assert cycles(import_graph(tmp_path, module_level_only=True)) == []
    assert cycles(graph) == [["parity.a", "parity.b", "parity.a"]]


def test_package_inits_import_nothing_at_their_top():
    """Importing any module runs its packages' `__init__`s: they stay free of project imports
    (`parity/__init__.py` loads `compare_modules` on first use only)."""
    inits = {name: path for name, path in modules().items() if path.name == "__init__.py"}
    heavy = {name: sorted(imports(path, module_level_only=True)) for name, path in inits.items()}
    assert not {k: v for k, v in heavy.items() if v}


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


def test_the_front_ends_run_the_engine_checks():
    """`parity CONFIG`, `compare_modules` and the MaxText gates run the same check functions:
    no numeric or sharding comparison lives in only one of them (the twins' `program` is the
    engine's, read from the TPU programs with `--topology`)."""
    from parity.engine import numeric, programs, registry
    from parity.engine.registry import Front

    engine = (numeric.__name__, programs.__name__)
    for check in registry.REGISTRY:
        forms = {front: check.function(front) for front in check.forms}
        shared = {f for f in (Front.TWINS, Front.MODULES, Front.MAXTEXT_TWIN) if f in forms}
        if forms.get(Front.MODULES) is not None and forms[Front.MODULES].__module__ in engine:
            different = {f.name for f in shared if forms[f] is not forms[Front.MODULES]}
            assert different <= ({"TWINS"} if check.name == "program" else set()), check.name


def test_every_check_is_declared_once_and_resolves():
    """Each registry entry names a callable for every front end it runs on, a one-line help,
    and the commands take their checks, help and defaults from it (no list of their own)."""
    from parity import cli, pairs
    from parity.engine import registry
    from parity.engine.registry import Front

    assert len(registry.BY_NAME) == len(registry.REGISTRY)
    for check in registry.REGISTRY:
        assert check.help and "\n" not in check.help, check.name
        assert check.default <= check.forms.keys(), check.name
        for front in check.forms:
            assert callable(check.function(front)), (check.name, front)
    assert registry.names(Front.MODULES) == pairs.AVAILABLE
    assert registry.defaults(Front.MODULES) == pairs.CHECKS
    page = cli.help_text()
    assert all(f"  {name}" in page for name, _ in registry.help_lines(Front.MAXTEXT))


# What each shared folder may not import (inside functions too): the front ends (the twins'
# `decoder/`, `maxtext/`, the Flax module-pair adapter `module_pair/`) build on the engine,
# the analysis, the reports and the TPU target, never the other way round; `tpu/` compiles
# whatever program a front end lowers for it.
FRONT_ENDS = (
    "parity.decoder",
    "parity.maxtext",
    "parity.module_pair",
    "parity.pairs",
    "parity.cli",
)
SHARED = ("parity.engine", "parity.analysis", "parity.reports", "parity.remote", "parity.tpu")


def test_shared_folders_import_no_front_end():
    graph = import_graph()
    reaching = {
        name: sorted(i for i in imported if i.startswith(FRONT_ENDS))
        for name, imported in graph.items()
        if name.startswith(SHARED)
    }
    assert not {k: v for k, v in reaching.items() if v}


def test_the_readme_takes_the_checks_from_the_registry():
    """The README's check table is the registry's (`markdown_table`), between its markers:
    a check's description is written once."""
    from parity.engine import registry

    readme = (REPO / "README.md").read_text()
    begin = readme.index("<!-- the checks of `parity CONFIG`")
    table = readme[readme.index("\n", begin) + 1 : readme.index("<!-- end of the checks -->")]
    assert table.strip() == registry.markdown_table(registry.Front.TWINS)


def test_no_flags_below_the_front_doors():
    """Only the commands read absl's flags (`parity/cli.py`, `migrate/cli.py`, and the help
    page both render from the flags' definitions): everything below takes the options they
    parsed (`parity.run_options.RunOptions`)."""
    doors = {"parity.cli", "migrate.cli", "migrate.runtime.cli_help"}
    readers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = {alias.name for alias in node.names}
            from_absl = isinstance(node, ast.ImportFrom) and node.module == "absl"
            if (from_absl and "flags" in names) or (
                isinstance(node, ast.Import) and any(n.startswith("absl.flags") for n in names)
            ):
                readers.add(name)
    assert readers == doors, readers ^ doors


def test_one_module_name_one_job():
    """A module's name says its job, once: no two modules (or a module and a package) share a
    name, but the twins (`migrate/linen/X.py` and `migrate/nnx/X.py`: their sameness is the
    point) and the two commands' `cli.py`."""
    twins = {p.name for p in (REPO / "migrate" / "linen").glob("*.py")}
    twins &= {p.name for p in (REPO / "migrate" / "nnx").glob("*.py")}
    seen: dict[str, list[str]] = {}
    for name, path in modules().items():
        if path.name == "__init__.py":
            stem = path.parent.name
        elif path.name in twins and path.parent.name in ("linen", "nnx"):
            continue
        else:
            stem = path.stem
        seen.setdefault(stem, []).append(name)
    shared = {stem: names for stem, names in seen.items() if len(names) > 1 and stem != "cli"}
    assert not shared, shared


CEILING = 500  # lines; a module may pass it only with its reason in its first lines


def test_no_module_passes_the_ceiling_without_a_stated_reason():
    """A module's size follows its job; past `CEILING` lines it says in its first lines
    ("Longer than 500 lines: ...") why its job does not split."""
    unexplained = {
        name: lines
        for name, path in modules().items()
        if (lines := len((text := path.read_text()).splitlines())) > CEILING
        and f"Longer than {CEILING} lines" not in text[:3000]
    }
    assert not unexplained, unexplained


def test_every_folder_is_in_the_architecture_table():
    """`docs/architecture.md` lists every package folder with its job: the folders are the
    architecture, and a new folder without a line there fails here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    folders = sorted(
        str(path.parent.relative_to(REPO))
        for package in PACKAGES
        for path in (REPO / package).rglob("__init__.py")
        if path.parent != REPO / package
    )
    first_cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    missing = [f for f in folders if not any(f"`{f}/`" in cell for cell in first_cells)]
    assert not missing, missing
