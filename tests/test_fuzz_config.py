"""Property tests of the config loader, the override parser and the `parity` usage path:
whatever the YAML or the `key=value` strings, the answer is a Config or a ConfigError (exit 0
or 2), never another exception, and always within a few seconds. Derandomized and without an
example database, so that CI runs the same examples every time."""

from __future__ import annotations

import contextlib
import signal
import time

import pytest
from hostile import TINY, config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migrate.config import safe_load
from migrate.config.bounds import INT_BOUNDS
from migrate.config.contract import Config, ConfigError
from migrate.config.loading import load_config, parse_overrides
from parity import cli

SECONDS = 3.0  # per example, far above what a valid config takes (~10 ms)
KEYS = sorted(f.name for f in Config.__dataclass_fields__.values() if f.init)
FUZZ = settings(
    max_examples=150,
    deadline=None,  # timed below, with a bound that says "hang" and not "slow machine"
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _bombs() -> st.SearchStrategy[str]:
    """Alias bombs of random fan-out and depth (most expand far past the node budget)."""

    def bomb(fanout: int, depth: int) -> str:
        parts = ["&a0 [x]"]
        parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * fanout)}]" for i in range(1, depth)]
        return "[" + ", ".join(parts) + "]"

    return st.builds(bomb, st.integers(2, 12), st.integers(7, 12))


ODD_VALUES = [
    ".inf", "-.inf", ".nan", "1e999", "-1e999", "0x1F", "0o17", "~", "null", "true", "no", "[]",
    "{}", "[1, 2]", "{a: 1}", "&a [*a]", "*undefined", "!!binary aGVsbG8=",
    "!!python/object:os.system ls", '"\\x07"', '"\\udcff"', "2001-12-14", "9" * 5000,
    "[embed, [fsdp, fsdp]]", "[[embed, fsdp], [mlp, tensor]]", "llama2-tiny", "-1", "0", "1.5",
    "float32", "bfloat16", "highest", ": :", "- -", "'", '"', "[", "{", "\t",
]  # fmt: skip
ODD_DOCUMENTS = ["1: 2\n", "? [a]\n: b\n", "null: 1\n", "[a, b]\n", "--- a\n--- b\n", "&x a: 1\n"]
YAML_VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from([str(b) for bounds in INT_BOUNDS.values() for b in bounds]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(ODD_VALUES),
    st.integers(1, 80).map(lambda n: "[" * n + "1" + "]" * n),
    _bombs(),
    st.text(max_size=40),
)
OVERRIDES = st.lists(
    st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=12)), YAML_VALUES).map(
        lambda kv: f"{kv[0]}={kv[1]}"
    )
    | st.text(max_size=30),
    max_size=4,
)


class TookTooLong(Exception):
    pass


def _alarm(signum, frame):
    raise TookTooLong


def timed(fn, *args):
    """`fn(*args)`, failing the example when it runs past SECONDS (an alarm interrupts Python
    code that loops; the elapsed time is checked too)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    start = time.monotonic()
    try:
        return fn(*args)
    except TookTooLong:
        pytest.fail(f"{fn.__name__}{args!r:.300} ran past {SECONDS}s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        assert time.monotonic() - start < SECONDS, f"{fn.__name__}{args!r:.300} took too long"


@FUZZ
@given(OVERRIDES)
def test_overrides_give_a_config_or_a_config_error(overrides):
    try:
        cfg = timed(load_config, TINY, overrides)
    except ConfigError as e:
        assert len(str(e)) < 20_000
    else:
        assert isinstance(cfg, Config)


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=4))
def test_override_strings_of_any_text_parse_or_are_refused(items):
    try:
        parsed = timed(parse_overrides, items)
    except ConfigError:
        return
    assert set(parsed) <= set(KEYS)


@FUZZ
@given(
    st.one_of(
        st.dictionaries(st.sampled_from(KEYS), YAML_VALUES, max_size=5).map(
            lambda d: "".join(f"{k}: {v}\n" for k, v in d.items())
        ),
        st.sampled_from(ODD_DOCUMENTS),
        st.text(max_size=200),
        st.binary(max_size=100),
    )
)
def test_config_files_give_a_config_or_a_config_error(tmp_path, document):
    path = config_dir(tmp_path, document)
    with contextlib.suppress(ConfigError):
        timed(load_config, path)


@FUZZ
@given(YAML_VALUES)
def test_the_yaml_loader_loads_or_refuses_in_bounded_time(text):
    try:
        timed(safe_load.load_yaml, text, "fuzz")
    except safe_load.ParseError as e:
        assert len(str(e)) < 5_000


@pytest.mark.slow
@settings(FUZZ, max_examples=60)
@given(OVERRIDES)
def test_the_parity_usage_path_exits_0_or_2_without_a_traceback(capsys, overrides):
    """The command in-process up to the point where JAX would start (`--dry_run`)."""
    argv = cli.FLAGS(["parity", "--dry_run", "--checks=compile"])
    try:
        status = timed(cli.run, [*argv, TINY, *overrides])
    finally:
        cli.FLAGS.unparse_flags()
    err = capsys.readouterr().err
    assert status in (0, 2), err
    assert "Traceback" not in err
    assert (status == 2) == err.startswith("parity: error: ")


BENIGN = "".join(f"key_{i}: 64\n" for i in range(10))


@pytest.mark.parametrize("text", [BENIGN, "a: &a [1]\nb: [*a, *a]\n"])
def test_benign_yaml_still_loads(text):
    assert safe_load.load_yaml(text, "ok") is not None
