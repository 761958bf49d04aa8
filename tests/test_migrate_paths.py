"""`migrate` with relative checkpoint paths: resolved against the working directory before
anything reads them (Orbax refuses a relative path), never reported as a corrupt checkpoint."""

from __future__ import annotations

import os

import pytest
from test_migrate_cli import CONFIG, migrate, nnx_ckpt  # noqa: F401 (nnx_ckpt: a fixture)

from migrate import cli
from migrate.checkpoints.meta import read_meta

pytestmark = [
    pytest.mark.compat,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
# The MaxText side is written scanned: its stacking maps no pipeline repeats.
SCANNED = "ici_pipeline_parallelism=1"


def test_convert_and_compare_take_relative_paths(nnx_ckpt, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    src = os.path.relpath(nnx_ckpt)  # relative, through `..`
    assert not os.path.isabs(src)
    twins = "out/linen"
    code = migrate("convert", CONFIG, "--from=nnx", "--to=linen", src, twins)
    assert code == cli.EXIT_OK, capsys.readouterr().err
    assert read_meta(tmp_path / twins)["framework"] == "linen"
    code = migrate("convert", CONFIG, "--from=nnx", "--to=maxtext", src, "out/mt", SCANNED)
    assert code == cli.EXIT_OK, capsys.readouterr().err
    steps = [p.name for p in (tmp_path / "out" / "mt").iterdir() if p.is_dir()]
    assert len(steps) == 1
    written = f"out/mt/{steps[0]}"
    capsys.readouterr()
    # A twins checkpoint first, then a MaxText one: Orbax refuses relative paths ("Checkpoint
    # path should be absolute"), so `migrate` makes them absolute where it reads them.
    relative = migrate("compare", CONFIG, twins, written)
    out = capsys.readouterr()
    assert relative == cli.EXIT_OK, out.err
    assert "bit-identical" in out.out and "corrupt" not in out.err
    absolute = migrate("compare", CONFIG, str(tmp_path / twins), str(tmp_path / written))
    assert absolute == cli.EXIT_OK
    assert capsys.readouterr().out == out.out  # the same result, both named absolute
    assert migrate("compare", CONFIG, written, twins) == cli.EXIT_OK  # MaxText first


def test_a_missing_relative_path_keeps_its_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    code = migrate("compare", CONFIG, "nope", "empty")
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert f"{tmp_path / 'nope'}: no checkpoint there" in err and "corrupt" not in err
