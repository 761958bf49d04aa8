"""Bad input to `parity --maxtext` exits 2 with one line, never 4: an empty or twins-only
`--checks`, an interpreter without MaxText (refused before any worker starts), a config a
release refuses while it reads it or builds its mesh (classified where it was raised, in the
worker's `start`); and a worker whose start fails leaves no temporary directory behind."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import types

import pytest
from hostile import REPO, refused, run

from parity.engine.registry import Front
from parity.maxtext import decoder_factory, gate_config
from parity.remote import client, worker
from parity.remote.environments import Environment

PP4 = str(REPO / "configs" / "maxtext" / "pp4.yml")
MISSING = [s for s in gate_config.RELEASES if gate_config.default_python(s) is None]
if sys.version_info < (3, 12):  # MaxText needs 3.12; its gate runs on the default stack
    WHY = "the MaxText gate runs on the default stack (Python 3.12)"
else:
    WHY = f"MaxText environments not built ({MISSING}): run make maxtext-envs"
needs_envs = pytest.mark.skipif(bool(MISSING) or sys.version_info < (3, 12), reason=WHY)


def maxtext(*args: str, timeout: float = 60):
    return run("parity", "--maxtext", PP4, *args, timeout=timeout)


# ------------------------------------------------------------------ refused before any worker


@pytest.mark.slow
def test_empty_checks_refused_as_without_maxtext():
    """`--checks=` selects nothing: refused, not the default set run silently."""
    refused(maxtext("--checks=", "--dry_run"), 2, "--checks: no checks selected")
    refused(maxtext("--checks=,", "--dry_run"), 2, "--checks: no checks selected")


@pytest.mark.slow
def test_only_twin_checks_refused_before_anything_starts(tmp_path):
    """bubbles and efficiency call the project's twins: alone, nothing is left to run; refused,
    named, nothing written, no worker started (never exit 4)."""
    report = tmp_path / "x.json"
    err = refused(
        maxtext("--checks=bubbles,efficiency", f"--json={report}"),
        2,
        "--checks=bubbles,efficiency: none of these runs with --maxtext",
        "(bubbles, efficiency call the project's twins",
    )
    assert "--maxtext runs: roundtrip, init, forward" in err
    assert not report.exists()
    refused(maxtext("--checks=efficiency", "--dry_run"), 2, "(efficiency call")


def test_runnable_splits_the_selection():
    """pipeline, compile and layers have the gate's own forms (the registry's `Front.MAXTEXT`:
    pipeline each release against its own decoder without pipelining); bubbles calls the
    project's twins."""
    selected = ["pipeline", "bubbles", "forward", "compile", "layers"]
    assert gate_config.runnable(selected, Front.MAXTEXT) == (
        ["pipeline", "forward", "compile", "layers"],
        ["bubbles"],
    )


@pytest.mark.slow
@needs_envs
def test_mixed_selection_runs_the_rest():
    result = maxtext("--checks=bubbles,forward", "--dry_run")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "checks: forward" in result.stdout.decode()
    assert "skipped: bubbles" in err


@pytest.mark.slow
def test_interpreter_without_maxtext_refused_before_workers():
    """The project's own interpreter has no MaxText: exit 2, one line, before any worker."""
    if importlib.util.find_spec("maxtext") is not None:
        pytest.skip("this interpreter has MaxText installed")
    python = sys.executable
    refused(
        maxtext(f"--linen_python={python}", "--dry_run"),
        2,
        f"--linen_python={python}: has no MaxText installed (No module named 'maxtext')",
    )


# ------------------------------------------------------------------ a release refuses the config


@needs_envs
@pytest.mark.slow
def test_unknown_key_refused_naming_release_and_key(tmp_path, monkeypatch):
    """MaxText's `pyconfig.initialize` refuses an unknown key with a list of every valid one:
    exit 2, one line with the release, the side and just the key; the failed workers leave no
    temporary directory."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    err = refused(
        maxtext("bogus_key=3", "--checks=forward", timeout=600),
        2,
        "maxtext 0.2.3 (the linen side) rejects the config: unknown key 'bogus_key'",
    )
    assert "internal error" not in err and "emb_dim" not in err
    assert not list(temporary.glob("parity-worker-*"))


# The messages the releases raise (0.2.3 and 0.2.5 alike), as the audit quoted them.
UNKNOWN = "'bogus_key' not in 'emb_dim', 'mlp_dim', 'moe_mlp_dim', 'num_decoder_layers'" + (
    ", 'x'" * 3000
)
MICROBATCHES = (
    "1 validation error for MaxTextConfig\n  Assertion failed, The number of microbatches (3) "
    "must be divisible by the number of stages (4) [type=assertion_error, input_value={'run_nam"
    "e': 'parity', 'm...xp_with_fsdp', 'fsdp']]}, input_type=dict]\n    For further information "
    "visit https://errors.pydantic.dev/2.14/v/assertion_error"
)
DCN = (
    "1 validation error for MaxTextConfig\n  Assertion failed, The number of layers per stage (1)"
    " times the number of stages (8) must divide the number of pipeline_parallel_layers which "
    "defaults to decoder layers (4)  [type=assertion_error, input_value={'run_name': 'parity', "
    "'m...xp_with_fsdp', 'fsdp']]}, input_type=dict]\n    For further information visit "
    "https://errors.pydantic.dev/2.14/v/assertion_error"
)
FIELD = (
    "2 validation errors for MaxTextConfig\nnum_pipeline_microbatches\n  Input should be a valid "
    "integer, unable to parse string as an integer [type=int_parsing, input_value='abc', "
    "input_type=str]\n    For further information visit https://errors.pydantic.dev/2.14/v/int_"
    "parsing\nvocab_size\n  Input should be a valid integer [type=int_parsing, input_value='q', "
    "input_type=str]"
)


@pytest.mark.parametrize(
    ("message", "line"),
    [
        (UNKNOWN, "unknown key 'bogus_key'"),
        (str(KeyError(UNKNOWN)), "unknown key 'bogus_key'"),  # the same list as a KeyError
        (
            MICROBATCHES,
            "Assertion failed, The number of microbatches (3) must be divisible by the number "
            "of stages (4)",
        ),
        (
            DCN,
            "Assertion failed, The number of layers per stage (1) times the number of stages (8) "
            "must divide the number of pipeline_parallel_layers which defaults to decoder layers "
            "(4)",
        ),
        (
            FIELD,
            "num_pipeline_microbatches: Input should be a valid integer, unable to parse string "
            "as an integer (and 1 more validation errors)",
        ),
        ("mesh axes do not fit\nmore detail", "mesh axes do not fit"),
        ("", "(no message)"),
    ],
)
def test_config_error_line_trims_the_release_message(message, line):
    assert decoder_factory.config_error_line(message) == line


def test_config_error_line_is_short():
    assert len(decoder_factory.config_error_line("x" * 5000)) == 300


def test_a_factory_without_a_summariser_gets_the_first_line():
    """The transport's own summary of a config error (a factory module that declares no
    `config_error_line`): the first non-blank line, at most 300 characters."""
    assert worker.first_line("\n  mesh axes do not fit\nmore") == "mesh axes do not fit"
    assert worker.first_line("") == "(no message)"
    assert len(worker.first_line("x" * 5000)) == 300


READERS = decoder_factory.CONFIG_READERS


def _fake_module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def test_worker_classifies_an_error_by_where_it_was_raised():
    """An exception out of `pyconfig.initialize` or `get_mesh_from_config` called by the
    factory itself is the config's; one raised elsewhere (deeper in the factory's own code, or
    by the factory) is not."""
    pyconfig = _fake_module(
        "maxtext.configs.pyconfig",
        "def initialize(argv, **keys):\n    raise ValueError(\"'bogus_key' not in 'emb_dim'\")\n",
    )
    utils = _fake_module(
        "maxtext.utils.maxtext_utils",
        "def get_mesh_from_config(config):\n    raise AssertionError('mesh')\n"
        "def create_learning_rate_schedule(config):\n    raise KeyError('steps')\n",
    )

    def make_config(options, batch):
        return pyconfig.initialize([None])

    def make_mesh(options, batch):
        return utils.get_mesh_from_config(None)

    def make_other(options, batch):
        return utils.create_learning_rate_schedule(None)

    def make_own(options, batch):
        raise ValueError("a bug of the factory")

    def caught(factory):
        try:
            factory({}, None)
        except Exception as e:
            return e
        raise AssertionError("no exception")

    assert worker.raised_reading_config(caught(make_config), make_config, READERS)
    assert worker.raised_reading_config(caught(make_mesh), make_mesh, READERS)
    assert not worker.raised_reading_config(caught(make_other), make_other, READERS)
    assert not worker.raised_reading_config(caught(make_own), make_own, READERS)
    assert not worker.raised_reading_config(caught(make_config), make_mesh, READERS)  # not its own
    # the transport knows no reader of its own: a factory that declares none has none
    assert not worker.raised_reading_config(caught(make_config), make_config, ())


# ------------------------------------------------------------------ failed starts clean up


@pytest.mark.slow
def test_failed_start_removes_the_workers_directory(tmp_path, monkeypatch):
    """A worker whose side fails to build is stopped and its temporary directory removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    workers = client.WorkerSet()
    with pytest.raises(client.WorkerError, match="no_such_module"):
        workers.start(
            "linen", Environment(python=sys.executable), "parity.no_such_module:make", {}, {}
        )
    assert not list(tmp_path.glob("parity-worker-*"))
    assert "linen" not in workers


@pytest.mark.slow
def test_closed_on_failure_stops_the_workers_started_inside(tmp_path, monkeypatch):
    """The other side of a pair that failed to start is closed too; a worker the set held
    before the block (another pair's, `MaxTextPair(started=...)`) is left to its owner."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    workers = client.WorkerSet()
    workers["outside"] = outside = client.Worker(sys.executable, "outside")
    with pytest.raises(RuntimeError), workers.closed_on_failure():
        workers["linen"] = started = client.Worker(sys.executable, "linen")
        assert started.directory.exists()
        raise RuntimeError("the nnx side failed")
    assert started.directory is None and started.process.poll() is not None
    assert not list(tmp_path.glob("parity-worker-linen-*"))
    assert list(workers) == ["outside"] and outside.directory.exists()
    workers.close()
    assert not list(tmp_path.glob("parity-worker-*"))
