"""The `random` check: stochastic calls (dropout), written once over a pair of Sides.

Each side runs every stochastic call `draws` times from the same weights (its RNG state
carried from draw to draw, as training carries it). Then:

- **the stream advances**: on each side, how many draws differ from the draw before. A side
  whose draws repeat (a key that is never split, an RNG count that is not carried) while the
  other's do not fails, and so does a call where neither side varies (dropout never on);
- **aligned keys** (`Randomness.aligned`: the same raw key on both sides): every draw is
  compared leaf by leaf against the pair's tolerance (bit-exact by default);
- **otherwise, the distributions**: per output leaf and per submodule output (every site
  both sides capture, by Linen path, in execution order: a dropout missing at one site of
  several is named there, where the outputs alone barely move; bench/random_sites.py), seven
  statistics of each draw (mean, mean square, fraction of exact zeros, four fixed random
  projections) are compared between the sides, their means by Welch's t-test and their
  spreads by the Brown-Forsythe test. A wrong
  rate moves the zero fraction and the mean square; a mask applied at another place changes
  the zeros and the projections' spread. The significance `ALPHA` is shared by all tests of a
  check (Bonferroni), so that a correct port fails at most once in `1 / ALPHA` runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection
from typing import Any

import jax
import numpy as np

from parity.analysis import compare
from parity.engine.pair import Pair
from parity.engine.result import CheckResult, fact_record, keyed_records

# The family-wise significance of a check's distribution tests (Bonferroni over all of them):
# a correct port fails once in a million runs. Measured (bench/random_check.py, 128 draws, 40
# seeds, jax 0.12): over correct ports the smallest p-value times the number of tests was at
# least 9.1e-3 (nn.Dropout vs nnx.Dropout; 3.8e-2 for a Dense-BatchNorm-Dropout-Dense block),
# uniform as p-values of a true null are; over seeded bugs (rate 0.4 vs 0.5, 0.5 vs 0.25,
# dropout before the norm instead of after) the smallest p-value was at most 1.6e-21.
ALPHA = 1e-6
PROJECTIONS = 4


def _features(stacked: np.ndarray) -> dict[str, np.ndarray]:
    """Per draw (axis 0) statistics of one output leaf, float64."""
    draws = stacked.reshape(stacked.shape[0], -1).astype(np.float64)
    size = max(draws.shape[1], 1)
    features = {
        "mean": draws.mean(axis=1),
        "mean square": np.square(draws).mean(axis=1),
        "zero fraction": (draws == 0).mean(axis=1),
    }
    for k in range(PROJECTIONS):
        signs = np.random.default_rng(k).choice([-1.0, 1.0], size=draws.shape[1])
        features[f"projection {k}"] = draws @ signs / math.sqrt(size)
    return features


def _p_values(linen: np.ndarray, nnx: np.ndarray) -> dict[str, float]:
    """Welch's t (means) and Brown-Forsythe (spreads) p-values of two samples."""
    if np.ptp(linen) == 0 and np.ptp(nnx) == 0:  # constant on both sides: equal or not
        same = float(linen[0] == nnx[0])
        return {"mean": same, "spread": 1.0}
    from scipy import stats  # here: ~1 s to import, and every drill-down imports this module

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a side that does not vary: p = 0
        p_mean = float(stats.ttest_ind(linen, nnx, equal_var=False).pvalue)
        p_spread = float(stats.levene(linen, nnx, center="median").pvalue)
    return {
        "mean": 0.0 if math.isnan(p_mean) else p_mean,
        "spread": 0.0 if math.isnan(p_spread) else p_spread,
    }


def _summary(sample: np.ndarray) -> str:
    return f"{sample.mean():.4g} sd {sample.std():.3g}"


def distribution_records(name: str, linen: Any, nnx: Any, label: str = "outputs") -> list[dict]:
    """One record per leaf, statistic and test; `passed` is filled in by `random` once the
    number of tests (the Bonferroni divisor) is known."""
    records = []
    flat_linen = jax.tree_util.tree_flatten_with_path(linen)[0]
    flat_nnx = dict(
        (compare.path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(nnx)[0]
    )
    for path, linen_leaf in flat_linen:
        leaf = compare.path_str(path)
        nnx_leaf = flat_nnx.get(leaf)
        where = f"{name}/{label}/{leaf}" if leaf else f"{name}/{label}"
        if not np.issubdtype(np.asarray(linen_leaf).dtype, np.inexact):
            continue
        if nnx_leaf is None or np.shape(nnx_leaf) != np.shape(linen_leaf):
            shape = None if nnx_leaf is None else np.shape(nnx_leaf)[1:]
            records.append(fact_record(where, False, np.shape(linen_leaf)[1:], shape or "missing"))
            continue
        linen_features = _features(np.asarray(linen_leaf))
        nnx_features = _features(np.asarray(nnx_leaf))
        for feature, linen_sample in linen_features.items():
            nnx_sample = nnx_features[feature]
            for test, p in _p_values(linen_sample, nnx_sample).items():
                record = fact_record(
                    f"{where}: {feature} {test}",
                    True,
                    _summary(linen_sample),
                    _summary(nnx_sample),
                )
                records.append(record | {"p_value": p})
    return records


def _distinct(stacked: Any) -> int:
    """Draws that differ from the draw before, in any leaf."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(stacked)]
    if not leaves:
        return 0
    count = leaves[0].shape[0]
    changed = np.zeros(max(count - 1, 0), bool)
    for leaf in leaves:
        flat = leaf.reshape(count, -1)
        changed |= np.any(flat[1:] != flat[:-1], axis=1)
    return int(changed.sum())


def variation_record(name: str, count: int, linen: Any, nnx: Any) -> dict:
    """Both sides' draws vary, and repeat alike: a stream that never advances fails."""
    distinct = (_distinct(linen), _distinct(nnx))
    every = count - 1
    passed = any(distinct) and (distinct[0] == every) == (distinct[1] == every)
    linen_text, nnx_text = (f"{d} of {every} draws differ from the one before" for d in distinct)
    record = fact_record(f"{name}: draws vary", passed, linen_text, nnx_text)
    if not any(distinct):
        record["note"] = "neither side's output varies: the call is not stochastic"
    return record


def _worst(failing: list[dict], pair: Pair) -> dict:
    """The first failure that is not a test (draws that do not vary, draws that differ under
    the same keys), else the test with the strongest evidence (the smallest p-value), the
    earliest in execution order among equals."""
    certain = [r for r in failing if "p_value" not in r]
    if certain:
        return certain[0]
    rank = pair.rank or (lambda tensor: 0)
    return min(failing, key=lambda r: (r["p_value"], rank(r["tensor"].split(":")[0])))


def _module(site: str) -> str:
    """The module a site is a call of: `mlp/up/1` (its second call) -> `mlp/up`."""
    head, _, last = site.rpartition("/")
    return head if head and last.isdigit() else site


def one_sided(site: str, linen: Collection[str], nnx: Collection[str]) -> tuple[bool, str]:
    """A site one side captured and the other did not: (whether it is a difference, a note
    naming the side that captured it). A site only one side can capture (inside Linen's
    `nn.scan`, where `capture_intermediates` records nothing) is no divergence of values and
    is not compared; it is one when the other side captured another call of that very module."""
    side, other = ("Linen", nnx) if site in linen else ("NNX", linen)
    if any(_module(name) == _module(site) for name in other):
        return True, f"captured on the {side} side only (the other captured another call of it)"
    return False, f"captured on the {side} side only: not compared"


def site_records(name: str, linen: dict, nnx: dict, pair: Pair) -> list[dict]:
    """The distributions at every submodule output both sides capture (one side's bridged
    layers aside), in execution order: a dropout missing, added or misplaced at one site
    fails there, where the outputs alone dilute it among the other sites. A site one side
    captured alone is a passing note unless `one_sided` finds a difference."""
    records = []
    for site in sorted(set(linen) | set(nnx), key=pair.rank or (lambda site: 0)):
        if site not in nnx or site not in linen:
            lacking = pair.nnx if site not in nnx else pair.linen
            if not lacking.opaque(site):
                differs, note = one_sided(site, linen, nnx)
                found = ("captured" if site in caps else "missing" for caps in (linen, nnx))
                records.append(fact_record(f"{name}/{site}", not differs, *found) | {"note": note})
            continue
        records += distribution_records(name, linen[site], nnx[site], site)
    return records


def random(pair: Pair) -> CheckResult:
    """Stochastic calls: draws vary on both sides; with aligned keys every draw is compared
    against the pair's tolerance, otherwise the output distributions are compared."""
    stochastic = pair.linen.stochastic_calls()
    if not stochastic:
        return CheckResult(
            "random", True, "failed records", 0.0, 0.0, "-", message="no call is stochastic"
        )
    linen_weights, nnx_weights = pair.weights("linen", "linen"), pair.weights("nnx", "linen")
    records: list[dict] = []
    tested: list[dict] = []
    notes = []
    for index, (name, randomness) in stochastic.items():
        linen_draws = pair.linen.draws(linen_weights, index)
        nnx_draws = pair.nnx.draws(nnx_weights, index)
        linen, nnx = linen_draws["outputs"], nnx_draws["outputs"]
        records.append(variation_record(name, randomness.draws, linen, nnx))
        if randomness.aligned:
            records += keyed_records(f"{name}/draws", nnx, linen, pair.tolerance)
            notes.append(f"{name}: {randomness.draws} draws, same keys: {pair.tolerance.reason}")
        else:
            found = distribution_records(name, linen, nnx)
            found += site_records(name, linen_draws["sites"], nnx_draws["sites"], pair)
            tested += [r for r in found if "p_value" in r]
            records += found
            sites = len(set(linen_draws["sites"]) & set(nnx_draws["sites"]))
            alone = sum("note" in r and r["passed"] for r in found)
            notes.append(
                f"{name}: {randomness.draws} draws, distributions compared at the outputs and "
                f"{sites} submodule outputs"
                + (f" ({alone} captured on one side only, not compared)" if alone else "")
            )
    bound = ALPHA / max(len(tested), 1)
    for record in tested:
        record["passed"] = record["p_value"] >= bound
        record["max_rel"] = 0.0 if record["passed"] else 1.0
    failing = [r for r in records if not r["passed"]]
    smallest = min((r["p_value"] for r in tested), default=1.0)
    note = "; ".join(notes)
    if tested:
        note += (
            f"; smallest p-value {smallest:.3g}, significance {ALPHA:g} over {len(tested)} tests"
        )
    return CheckResult(
        name="random",
        passed=not failing,
        metric="failed records",
        value=float(len(failing)),
        tolerance=0.0,
        where=_worst(failing, pair)["tensor"] if failing else f"{len(records)} records agree",
        details=tuple(records),
        message=note if not failing else f"required: draws vary alike; {note}",
    )
