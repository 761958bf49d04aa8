"""Loading a config: a base (`base.yml` beside the model YAML, else the one the package ships),
then a model YAML, then MaxText-style `key=value` overrides, each read through
`migrate.config.safe_load` (bounded: no alias bombs, no deep nesting) and checked key by key
before `Config` validates the whole.

The package ships the project's configs (`configs/`, installed as `migrate/config/shipped/`):
a config is named by its path, or by the name of a shipped one (`llama2-tiny`,
`maxtext/pp4`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from migrate.config import safe_load
from migrate.config.contract import Config, ConfigError, check_known, from_dict

MAX_CONFIG_BYTES = 1 << 20
# The configs the package ships: the checkout's configs/ (a link to it), installed with the
# package as its data.
SHIPPED = Path(str(resources.files("migrate.config") / "shipped"))


def shipped_names(folder: str = "") -> list[str]:
    """The names of the shipped configs in `folder` (`""`: the twins', `"maxtext"`)."""
    return sorted(p.stem for p in (SHIPPED / folder).glob("*.yml") if p.stem != "base")


def resolve(config: str | Path, folder: str = "") -> Path:
    """`config` as a path: an existing file, else the shipped config of that name in `folder`
    (`llama2-tiny`, `pp4` in `maxtext`), else the path as given (its reader says it is
    missing, and names the shipped configs)."""
    path = Path(config)
    if path.exists() or path.is_symlink() or path.suffix or len(path.parts) != 1:
        return path
    shipped = SHIPPED / folder / f"{path.name}.yml"
    return shipped.resolve() if shipped.is_file() else path


def not_found(path: Path, folder: str = "") -> str:
    """The message for a config that is neither a file nor a shipped config's name."""
    names = ", ".join(shipped_names(folder))
    return f"config file not found: {path} (nor a shipped config of that name: {names})"


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists() and not path.is_symlink():
        raise ConfigError(not_found(path))
    try:
        data = safe_load.load_yaml(safe_load.read_text(path, MAX_CONFIG_BYTES, "config"), str(path))
    except safe_load.ParseError as e:
        raise ConfigError(str(e)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value, got {type(data).__name__}")
    check_known(data, str(path))
    return data


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """MaxText-style `key=value` strings -> {key: value}, values parsed as YAML scalars/lists."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        check_known([key], "override")
        try:
            parsed[key] = safe_load.load_yaml(raw, f"override {key}") if raw else ""
        except safe_load.ParseError as e:
            raise ConfigError(str(e)) from None
    return parsed


# Schedule keys that weights do not depend on: reset when a layout change leaves them invalid.
SCHEDULE_DEFAULTS = {"num_pipeline_microbatches": -1, "pipeline_delay_activation_forwarding": False}


def with_changes(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """`cfg` with `changes`; schedule keys that no longer fit (M, delay) reset to defaults.

    Weights do not depend on the schedule, so a re-staged layout (S=2 where the config says
    S=4) need not also restate a microbatch count that fits it.
    """
    try:
        return cfg.replace(**changes)
    except ConfigError:
        return cfg.replace(**{**SCHEDULE_DEFAULTS, **changes})


def base_config_path(model_path: Path, folder: str = "") -> Path:
    """`base.yml` beside the model YAML when there is one (it wins), else the shipped base of
    `folder` (`""`: the twins', `"maxtext"`)."""
    beside = model_path.parent / "base.yml"
    shipped = SHIPPED / folder / "base.yml"
    return beside if beside.exists() or beside.is_symlink() else shipped.resolve()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # missing, unreadable or looping: read (and report) each on its own
        return False


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The base, then the model YAML at `path` (or the shipped config of that name), then
    `key=value` overrides; validated."""
    model_path = resolve(path)
    if not model_path.exists() and not model_path.is_symlink():
        raise ConfigError(not_found(model_path))
    base_path = base_config_path(model_path)
    values = _read_yaml(base_path)
    if not _same_file(model_path, base_path):
        values.update(_read_yaml(model_path))
    values.update(parse_overrides(overrides))
    return from_dict(values, source=str(model_path))
