"""What a module pair's failed comparison means, said where the records alone would mislead.

- A call Linen ran deterministically in which the NNX module drew random numbers (an
  `nnx.Dropout` left in training mode): every output and gradient differs, and no leaf says
  why. Read from the traced programs (random-bit primitives on one side only), never run.
- The drill-down's first divergence, named on the `forward` and `grads` verdicts: their worst
  records sit downstream of the cause (a transposed kernel in `fc1` shows largest at `fc2`).
- The sites one side alone captured (a layer the port renamed, or never calls), listed on the
  `layers` verdict, with the renames that pair them by position and shape (a module without
  parameters has no weights for the converter's suggestion to match).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from parity.engine.programs import count_primitives
from parity.engine.result import CheckResult

# `jax.random` draws lower to `random_bits` (typed keys) or threefry on raw uint32 keys.
DRAW_PRIMITIVES = frozenset({"random_bits", "threefry2x32"})
EXPLAINED = ("forward", "grads")  # the verdicts a randomness hint and the drill-down explain
STATE_RECORD = re.compile(r"/(state|sown)/")  # a record of what a call updates or sows
# Differences no larger than this many float32 ulp at the leaf's scale, or this absolute error
# where the leaf's scale is near zero (a gradient the math makes vanish), are rounding: the
# same math in another order (a fused matmul, a reordered sum), not a bug of the port.
ROUNDING_ULP = 64
ROUNDING_ABS = 1e-6

Path = tuple[str, ...]


def explained(pair: Any, results: Sequence[CheckResult]) -> list[CheckResult]:
    """`results` with the hints of this module: the forward and grads verdicts of a failed
    comparison name the cause the drill-down or the programs found; `layers` lists the
    one-sided sites and the renames that pair them."""
    out = list(results)
    failed = [r for r in out if r.name in EXPLAINED and r.status == "failed"]
    layers = next((r for r in out if r.name == "layers"), None)
    one_sided, renames = one_sided_sites(layers) if layers is not None else ([], {})
    if layers is not None and one_sided:
        at = next(i for i, r in enumerate(out) if r is layers)
        out[at] = _noted(layers, _one_sided_note(one_sided, renames))
    if not failed:
        return out
    notes = [note for note in (randomness_hint(pair), rounding_hint(failed)) if note]
    if layers is not None and layers.status == "failed":
        note = _first_divergence(pair, layers, one_sided, renames)
        state = next((r.where for r in failed if STATE_RECORD.search(r.where)), None)
        if state is not None:  # the drill-down compares outputs: the state parts ways first
            note += f" (outputs only: {state} differs before any output)"
        notes.append(note)
    if not notes:
        return out
    first, rest = failed[0], {id(r) for r in failed[1:]}  # by identity: records hold arrays
    see = f"cause: see {first.name}"
    return [
        _noted(r, *notes) if r is first else _noted(r, see) if id(r) in rest else r for r in out
    ]


def _first_divergence(pair: Any, layers: CheckResult, sites: list[dict], renames: dict) -> str:
    """The drill-down's first divergence, and the sites before it (in Linen's execution
    order) that it could not compare: renamed ones, and those one side alone captures (inside
    Linen's `nn.scan`, Linen's capture records nothing): the divergence may start there."""
    where = f"first divergence (layers drill-down): {layers.where}"
    first = next((d for d in layers.details if not d.get("passed", True)), {})
    if "call" in first:  # the pair makes several calls: which one parts ways first
        where += f" in call {first['call']!r}"
    try:
        before = pair.rank(layers.where)
        earlier = [s for s in sites if s["passed"] and pair.rank(s["tensor"]) < before]
    except Exception:  # no execution order: nothing is placed before it
        return where
    renamed = {"/".join(linen): "/".join(nnx) for linen, nnx in renames.items()}
    paired = set(renamed.values())
    named = [
        f"{s['tensor']} (NNX {renamed[s['tensor']]})" for s in earlier if s["tensor"] in renamed
    ]
    alone = [
        s["tensor"]
        for s in earlier
        if s["tensor"] not in renamed and s["tensor"] not in paired and s["tensor"] != "output"
    ]
    if named:
        where += (
            f", or before it at {', '.join(named)}, captured under other names and not "
            f"compared: rerun with renames={renames!r}"
        )
    if alone:
        sides = {s["tensor"]: "NNX" if s["side"] == "nnx" else "Linen" for s in earlier}
        listed = ", ".join(f"{t} ({sides[t]} only)" for t in alone)
        why = " (Linen's capture records nothing inside nn.scan)" if "NNX" in sides.values() else ""
        where += f", or before it in {listed}: captured by one side alone, not compared{why}"
    return where


def _noted(result: CheckResult, *notes: str) -> CheckResult:
    message = "; ".join((*notes, result.message)) if result.message else "; ".join(notes)
    return dataclasses.replace(result, message=message)


def randomness_hint(pair: Any) -> str | None:
    """A hint when one side draws random numbers in the calls compared exactly and the other
    does not (those calls pass neither side a key: Linen draws nothing without one)."""
    try:
        draws = {
            framework: count_primitives(
                pair.side(framework).jaxpr(pair.weights(framework, "linen")), DRAW_PRIMITIVES
            )
            for framework in ("linen", "nnx")
        }
    except Exception:  # a side that does not trace: its own error is the report
        return None
    if draws["nnx"] and not draws["linen"]:
        return (
            f"hint: the NNX side drew random numbers ({draws['nnx']} draw(s)) in a call Linen ran "
            "deterministically: a layer left in training mode (nnx.Dropout is stochastic "
            "unless deterministic=True; Linen's was deterministic here): build it with "
            "deterministic=True, or call with Call(x, nnx_attributes={'deterministic': True}); "
            "to compare the stochastic call itself, give both sides keys with Randomness"
        )
    if draws["linen"] and not draws["nnx"]:
        return (
            f"hint: the Linen side drew random numbers ({draws['linen']} draw(s)) and the NNX side "
            "none: the port runs deterministically (e.g. nnx.Dropout(deterministic=True) where "
            "Linen's dropout was on)"
        )
    return None


def rounding_hint(failed: Sequence[CheckResult]) -> str | None:
    """A hint when every failing value differs at rounding level only, with the tolerance
    that the measured errors need (rounded up to one significant digit)."""
    records = [d for r in failed for d in r.details if not d.get("passed", True)]
    if not records or any(
        "ulp_at_scale" not in d or d.get("note") or d.get("nonfinite") or d.get("mismatches", 0) < 0
        for d in records
    ):
        return None
    if not all(d["ulp_at_scale"] <= ROUNDING_ULP or d["max_abs"] <= ROUNDING_ABS for d in records):
        return None
    relative = [d["max_rel"] for d in records if d["ulp_at_scale"] <= ROUNDING_ULP]
    absolute = [d["max_abs"] for d in records if d["ulp_at_scale"] > ROUNDING_ULP]
    suggested = f"tolerance={_ceil(max(relative, default=0.0))}"
    if absolute:
        suggested = f"tolerance=({_ceil(max(relative, default=0.0))}, {_ceil(max(absolute))})"
    return (
        f"hint: every difference is rounding (at most {ROUNDING_ULP} float32 ulp at scale, or "
        f"under {ROUNDING_ABS:g} where the scale is near zero): the same math in another order "
        f"(a fused or reordered sum); where that is the port's intent, pass {suggested}"
    )


def _ceil(value: float) -> str:
    """`value` rounded up to one significant digit (`1.19e-07` -> `2e-07`)."""
    if value <= 0:
        return "0"
    exponent = math.floor(math.log10(value))
    return f"{math.ceil(value / 10**exponent) * 10**exponent:.0e}"


def one_sided_sites(layers: CheckResult) -> tuple[list[dict], dict[Path, Path]]:
    """The drill-down's sites one side alone captured, and the Linen -> NNX renames that pair
    a Linen-only site with an NNX-only site of the same output shape, in order (only where
    each shape has as many sites on both sides)."""
    sites = [d for d in layers.details if d.get("side") in ("linen", "nnx")]
    by_shape: dict[Any, tuple[list[str], list[str]]] = {}
    for site in sites:
        if not site["passed"] or site["tensor"] == "output" or site.get("shape") is None:
            continue
        linen, nnx = by_shape.setdefault(tuple(site["shape"]), ([], []))
        (linen if site["side"] == "linen" else nnx).append(site["tensor"])
    renames: dict[Path, Path] = {}
    for linen, nnx in by_shape.values():
        if linen and len(linen) == len(nnx):
            for linen_site, nnx_site in zip(linen, nnx, strict=True):
                renames[tuple(linen_site.split("/"))] = tuple(nnx_site.split("/"))
    return sites, renames


def _one_sided_note(sites: list[dict], renames: dict[Path, Path]) -> str:
    listed = "; ".join(
        f"{'Linen' if s['side'] == 'linen' else 'NNX'} {s['tensor']}"
        + (f" {tuple(s['shape'])}" if s.get("shape") is not None else "")
        + (" (a difference: " + s["note"] + ")" if not s["passed"] else "")
        for s in sites
    )
    note = f"captured on one side only: {listed}"
    return f"{note}; try renames={renames!r}" if renames else note
