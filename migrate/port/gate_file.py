"""The pytest file that gates a port: `compare_modules` on the Linen module and the written
NNX module, called as the port was traced (a stochastic call compared by `random`), with the
weight map's renames. `gate()` returns the exit status and the report (what `migrate port`
runs); `test_port` asserts it under pytest."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from migrate.port.layers import imports_for, literal
from migrate.port.spec import ArraySpec

INT_BOUND = 8  # integer inputs are drawn below this, or below the smallest embedding table


@dataclasses.dataclass(frozen=True)
class GateSpec:
    """What the generated test needs to know."""

    linen_module: str
    linen_class: str
    nnx_module: str
    fields: Mapping[str, Any]
    inputs: Sequence[ArraySpec]
    calls: Sequence[Mapping[str, Any]]
    stochastic: Sequence[bool]  # per call
    renames: Mapping[tuple[str, ...], tuple[str, ...]]
    int_bound: int = INT_BOUND
    fields_from: str | None = None  # `MODULE:FUNCTION` returning the fields (not literals)
    method: str | None = None  # the method called (None: `__call__`)
    collections: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)


def _input(i: int, spec: ArraySpec, bound: int) -> str:
    shape = repr(spec.shape)
    if spec.is_float:
        return f"jax.random.normal(keys[{i}], {shape}, jnp.{spec.dtype})"
    if spec.dtype == "bool":
        return f"jax.random.bernoulli(keys[{i}], 0.5, {shape})"
    return f"jax.random.randint(keys[{i}], {shape}, 0, {bound}, jnp.{spec.dtype})"


def render(spec: GateSpec, header: str) -> str:
    """The test file's text."""
    name = spec.linen_class
    if spec.fields_from is None:
        needs = sorted(set().union(set(), *(imports_for(v) for v in spec.fields.values())))
        written = ", ".join(f"{k!r}: {literal(v)}" for k, v in spec.fields.items())
        fields = "".join(f"from {m} import {n}\n" for m, n in needs) + f"\nFIELDS = {{{written}}}"
    else:
        module, function = spec.fields_from.split(":")
        fields = f"from {module} import {function} as fields\n\nFIELDS = fields()"
    imported = "".join(
        f"    from {stem} import {kind}\n" for stem, kind in spec.collections.values()
    )
    mapping = ", ".join(f"{c!r}: {kind}" for c, (_, kind) in spec.collections.items())
    collections = f"{imported}    return {{{mapping}}}"
    arrays = ", ".join(_input(i, s, spec.int_bound) for i, s in enumerate(spec.inputs))
    calls = []
    for i, (kwargs, stochastic) in enumerate(zip(spec.calls, spec.stochastic, strict=True)):
        randomness = ", randomness=Randomness()" if stochastic else ""
        method = f", method={spec.method!r}" if spec.method else ""
        calls.append(f"Call(args, kwargs={dict(kwargs)!r}{method}{randomness}, name='call{i}')")
    return f'''{header}"""The parity gate of `{spec.nnx_module}.{name}`, the NNX port of
`{spec.linen_module}.{name}`: `compare_modules` on both, bit-exact (what `migrate port` runs)."""

import jax
import jax.numpy as jnp
from flax import nnx

from parity.pairs import Call, Randomness, compare_modules, exit_status, format_report
from parity.testing import assert_passed
from {spec.linen_module} import {name} as Linen{name}
{fields}
RENAMES = {dict(spec.renames)!r}
TITLE = "{name} (Linen) vs {name} (NNX port)"


def port():
    """The NNX port, built (its file imported here: a port that does not import or build
    fails its gate, as one that computes otherwise does)."""
    from {spec.nnx_module} import {name} as NNX{name}

    with nnx.use_eager_sharding(False):
        return NNX{name}(**FIELDS, rngs=nnx.Rngs(0))


def calls() -> list[Call]:
    keys = jax.random.split(jax.random.key(0), {max(len(spec.inputs), 1)})
    args = ({arrays}{"," if len(spec.inputs) == 1 else ""})
    return [{", ".join(calls)}]


def results(built=None):
    built = port() if built is None else built
    return compare_modules(
        Linen{name}(**FIELDS), built, calls(), renames=RENAMES, collections=collections()
    )


def collections() -> dict:
    """The port's Variable type of each Linen collection NNX has no type of its own for."""
{collections}


def gate() -> tuple[int, str]:
    """The exit status of the checks (0 pass, 1 fail, 2 bad input) and their report."""
    try:
        built = port()
    except Exception as error:  # the written port itself is wrong: its gate fails
        first = (str(error).strip().splitlines() or [""])[0]
        return 1, f"{{TITLE}}: FAIL: the port does not build: {{type(error).__name__}}: {{first}}"
    found = results(built)
    return exit_status(found), format_report(found, TITLE)


def test_port():
    assert_passed(results(), TITLE)
'''
