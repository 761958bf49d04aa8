"""Shared fixtures. 8 simulated CPU devices, requested before JAX is imported."""

from __future__ import annotations

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from migrate.config import Config, load_config  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
TINY_CONFIGS = ("llama2-tiny", "llama2-tiny-scan", "llama2-tiny-delay", "llama2-tiny-agonce")


def tiny(name: str, *overrides: str) -> Config:
    return load_config(CONFIG_DIR / f"{name}.yml", overrides)


@pytest.fixture(scope="session")
def config_dir() -> Path:
    return CONFIG_DIR
