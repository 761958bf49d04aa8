"""What a `parity` run was asked for: the command's flags, parsed once by its front door
(`parity.cli`) into `RunOptions`; nothing below the front door reads absl. No JAX."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


class Mode(enum.Enum):
    """What CONFIG is and which pair the run builds."""

    TWINS = "the project's decoder twins (configs/*.yml)"
    MAXTEXT = "MaxText's two releases (configs/maxtext/*.yml): `parity maxtext CONFIG`"


@dataclasses.dataclass(frozen=True)
class SideOptions:
    """Where each side runs: `{side}_python` / `{side}_path` (None: this interpreter and
    checkout), and how long each call to a side's worker may take."""

    linen_python: str | None = None
    nnx_python: str | None = None
    linen_path: str | None = None
    nnx_path: str | None = None
    worker_timeout_s: float = 600.0

    def python(self, side: str) -> str | None:
        return getattr(self, f"{side}_python")

    def path(self, side: str) -> str | None:
        return getattr(self, f"{side}_path")

    @property
    def any_given(self) -> bool:
        """A side was sent elsewhere: the run's sides are workers."""
        return any((self.linen_python, self.nnx_python, self.linen_path, self.nnx_path))


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Every flag of `parity`, as values; `given` names those set on the command line (the
    rest hold their defaults)."""

    mode: Mode = Mode.TWINS
    checks: tuple[str, ...] | None = None  # None: the front end's defaults
    steps: int = 5
    json: str | None = None
    junit: str | None = None
    plot: str | None = None
    golden: str | None = None
    update_golden: bool = False
    require_golden: bool | None = None  # None: required under CI (`run_inputs.golden_required`)
    compilation_cache_dir: str = ""
    num_processes: int = 1
    process_id: int | None = None
    coordinator_address: str | None = None
    timeout_s: float = 3600.0
    init_timeout_s: float = 120.0
    memory_check: bool = True
    checkpoint: str | None = None
    sides: SideOptions = SideOptions()
    against: str = "release"
    topology: str | None = None
    num_slices: int | None = None
    verbose: bool = False
    dry_run: bool = False
    given: frozenset[str] = frozenset()

    @classmethod
    def of(cls, values: Mapping[str, Any], given: frozenset[str], mode: Mode) -> RunOptions:
        """From each flag's value by name (`values` may hold more: absl's own)."""
        side_fields = {f.name for f in dataclasses.fields(SideOptions)}
        own = {f.name for f in dataclasses.fields(cls)} - {"mode", "sides", "given"}
        checks = values.get("checks")
        return cls(
            mode=mode,
            sides=SideOptions(**{k: values[k] for k in side_fields if k in values}),
            given=frozenset(given),
            **{k: values[k] for k in own if k in values and k != "checks"},
            checks=None if checks is None else tuple(checks),
        )

    def present(self, name: str) -> bool:
        """`--name` was given on the command line."""
        return name in self.given
