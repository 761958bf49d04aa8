"""The oldest stack (Python 3.11, jax 0.10.2, flax 0.12.8) runs a declared compatibility layer,
the tests marked `compat` (README, "Stacks"); the default stack runs everything. This file holds
the layer to its declaration:

- every module that names a JAX, Flax or Orbax version in its code or comments (where it
  branches on one, works around one, or was calibrated on one) or reads a version at run time
  has a test in the layer that imports it or names it (a worker's `python -m` module);
- the layer holds one `--checks=all` run of llama2-tiny (the config matrix's entry) and one
  injected bug per check kind.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
VERSION = re.compile(
    r"\b(?:jax|jaxlib|flax|orbax-checkpoint|orbax)[ -]v?\d+\.\d+|__version__|version_info"
)
# Each check an injected bug must fail in the layer (a bug per kind of check; `layers` is the
# drill-down that names a layer, or a pipeline iteration).
CHECK_KINDS = {"init", "forward", "grads", "sharding", "program", "pipeline", "bubbles", "train"}
CHECK_KINDS |= {"layers", "compile"}


def version_dependent_modules() -> set[str]:
    """Dotted names of the modules of `migrate/` and `parity/` whose text matches `VERSION`."""
    found = set()
    for package in ("migrate", "parity"):
        for path in (REPO / package).rglob("*.py"):
            if VERSION.search(path.read_text()):
                parts = path.relative_to(REPO).with_suffix("").parts
                found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def in_layer(source: str) -> bool:
    return "mark.compat" in source


def imported(source: str) -> set[str]:
    """Every module a test file imports, anywhere in it (`from a.b import c`: `a.b` and
    `a.b.c`)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_version_dependent_module_has_a_test_in_the_layer():
    layer = [p.read_text() for p in TESTS.glob("test_*.py") if in_layer(p.read_text())]
    covered = set().union(*(imported(source) for source in layer))
    dependent = version_dependent_modules()
    assert dependent, "the search for version-dependent modules finds none: it is broken"
    named = {m for m in dependent if any(f'"{m}"' in s or f"{m}:" in s for s in layer)}
    missing = sorted(dependent - covered - named)
    assert not missing, (
        f"{missing}: each names a JAX/Flax/Orbax version; import it from a test marked compat"
    )


def test_a_module_naming_a_version_is_found(tmp_path):
    assert VERSION.search("# XlaRuntimeError (jax 0.10) / JaxRuntimeError (0.12)")
    assert VERSION.search("not exported by orbax-checkpoint 0.12.8")
    assert VERSION.search("if sys.version_info < (3, 12):")
    assert not VERSION.search("a 0.12 ratio; jaxpr of the step")


def _compat_bugs() -> list[tuple]:
    import test_injected_bugs as bugs

    params = [bugs._bug_param(b) for b in bugs.BUGS]
    return [p.values[0] for p in params if any(m.name == "compat" for m in p.marks)]


def test_the_layer_holds_one_bug_per_check_kind_and_one_full_run():
    import test_cli

    caught = set().union(*(set(expected) for _, _, _, expected, *_ in _compat_bugs()))
    assert caught >= CHECK_KINDS, sorted(CHECK_KINDS - caught)
    matrix = test_cli.matrix_params()
    full = [p for p in matrix if any(m.name == "compat" for m in p.marks)]
    assert [p.values[0] for p in full] == ["llama2-tiny"]
