"""User-style pairs (`tests/user_pairs.py`) through `compare_modules`, as a user gates a port
(issue 53): each correct port passes `assert_parity`; each seeded bug fails with exit status 1
and the report names the module the bug is in.

How the report names it (`blamed`): the `layers` drill-down's first divergence (run by itself
when `forward` or `grads` fails), the `random` check's site, the `grads` record where the
backward pass parts ways, the `forward` check's first failing state path (a bug that shows in
`batch_stats` or the cache first), or the path a `roundtrip` names.

| pair | seeded bug | must name | the harness names |
| --- | --- | --- | --- |
| mlp (dropout) | transposed fc1 kernel | `fc1` | `fc1` |
| | missing residual | `output` (the block itself) | `output` |
| | dropout in eval | `drop` | `drop` |
| | dropout rate | `train/drop` (random) | `train/drop: zero fraction mean` |
| | fc1 detached (backward only) | `fc1` (grads) | `linen-init/grads/fc1/bias` |
| cnn (BatchNorm) | BatchNorm momentum (bn2) | `.../train/state/batch_stats/bn2/mean` | same |
| | VALID padding (conv1) | `conv1` | `conv1: shapes differ: (2, 4, 4, 4) vs (2, 6, 6, 4)` |
| | flipped kernel (conv2) | `conv2` | `conv2` |
| | batch statistics in eval (bn1) | `bn1` | `bn1` |
| attention (cache) | cache index not advanced | `.../step0/state/cache/attn/cache_index` | same |
| | scores scaled by 1/head_dim | `attn/out` (step1) | `attn/out` |
| stack (nn.scan) | scan over the wrong axis | `layers` | `final_ln`; before it `layers` * |
| | LayerNorm epsilon inside the stack | `layers` (`layers/ln`) | `final_ln`; before it `layers` * |
| | final LayerNorm epsilon | `final_ln` | `final_ln` |
| fused_qkv (hook) | interleaved head split | `out` | `out` (query/key/value, qkv: one side) |
| | transposed out kernel | `out` | `out` |
| | conversion fuses k, q, v | `out` | `out` |
| | conversion not its own inverse | `key` (roundtrip) | `linen-init/linen->nnx->linen/key/kernel` |
| | qkv without bias | `qkv/bias` (roundtrip) | `qkv/bias: not in the target (got float32[24])` |

* not compared: Linen's capture records nothing inside `nn.scan`; the verdict names the stack
as the place before the first divergence that it could not compare.

With several calls the verdict says which call the first divergence is in: the CNN's eval-only
bug (`bn1` in call 'eval'), the attention's bug that shows at the second step (`attn/out` in
call 'step1').
"""

from __future__ import annotations

import pytest
from user_pairs import GRADS, LAYERS, PAIRS, RANDOM, ROUNDTRIP, STATE, Bug, UserPair

from parity.engine.result import CheckResult
from parity.pairs import compare_modules, exit_status, format_report
from parity.testing import assert_parity

# Bugs inside `nn.scan`: Linen's `capture_intermediates` records nothing inside the scan (nor
# the scanned module's own output), NNX's capture does; the first site both sides compare is
# the final norm after the stack, and the verdict names the stack before it as not compared.
INSIDE_THE_SCAN = {
    ("stack", "scan over the wrong axis"),
    ("stack", "LayerNorm epsilon inside the stack"),
}
# `compare_modules` runs the `layers` drill-down by itself when `forward` or `grads` fails; a
# harness without that needs it asked for: ("layers",).
DRILL_DOWN: tuple[str, ...] = ()


def blamed(results: list[CheckResult], by: str = LAYERS) -> str:
    """The place the report names for a failure, read as `by` says (`user_pairs.Bug.by`)."""
    found = {r.name: r for r in results}
    if by == LAYERS:  # the drill-down's first divergence: "conv1: shapes differ: ..." -> conv1
        return found["layers"].where.split(": ")[0]
    if by == RANDOM:  # "train/drop: zero fraction mean" -> train/drop
        return found["random"].where.split(": ")[0]
    if by == GRADS:  # "linen-init/grads/fc1/bias" -> fc1
        return found["grads"].where.split("/grads/", 1)[1].rsplit("/", 1)[0]
    if by == STATE:  # the first failing record: a state path
        return found["forward"].where
    if by == ROUNDTRIP:  # "linen-init/linen->nnx->linen/key/kernel" -> key/kernel
        return found["roundtrip"].where.split("->linen/")[-1].split("->nnx/")[-1].split(": ")[0]
    raise ValueError(by)


def names(place: str, module: str) -> bool:
    """`place` is `module` or inside it (a state path names the module it ends in)."""
    return place == module or place.startswith(f"{module}/")


def test_blamed_reads_each_kind_of_report():
    def result(name: str, where: str) -> CheckResult:
        return CheckResult(name, False, "max_rel", 1.0, 0.0, where)

    assert blamed([result("layers", "conv1: shapes differ: (2,) vs (3,)")]) == "conv1"
    assert blamed([result("random", "train/drop: zero fraction mean")], RANDOM) == "train/drop"
    assert blamed([result("grads", "nnx-init/grads/a/fc1/bias")], GRADS) == "a/fc1"
    assert blamed([result("roundtrip", "nnx-init/nnx->linen->nnx/k/kernel")], ROUNDTRIP) == (
        "k/kernel"
    )
    assert names("attn/out", "attn") and names("out", "out") and not names("outer", "out")
    assert all(bug in PAIRS[pair].bugs for pair, bug in INSIDE_THE_SCAN)  # no stale entry


@pytest.mark.parametrize("name", PAIRS)
def test_the_correct_port_passes(name):
    pair: UserPair = PAIRS[name]
    results = assert_parity(pair.linen(), pair.port(), list(pair.calls), **pair.options)
    assert {"roundtrip", "forward", "grads"} <= {r.name for r in results}


BUGS = [
    pytest.param(pair, bug, id=f"{pair}-{bug.replace(' ', '_')}")
    for pair in PAIRS
    for bug in PAIRS[pair].bugs
]


@pytest.mark.parametrize("pair_name,bug_name", BUGS)
def test_a_seeded_bug_fails_and_the_report_names_its_module(pair_name, bug_name):
    pair: UserPair = PAIRS[pair_name]
    bug: Bug = pair.bugs[bug_name]
    options = pair.options if bug.options is None else bug.options
    results = compare_modules(
        pair.linen(), bug.port(), list(pair.calls), checks=(*bug.checks, *DRILL_DOWN), **options
    )
    report = format_report(results, f"{pair_name}: {bug_name}")
    assert exit_status(results) == 1, report
    if (pair_name, bug_name) in INSIDE_THE_SCAN:
        forward = next(r for r in results if r.name == "forward")
        assert blamed(results, bug.by) == "final_ln", report
        assert (
            "first divergence (layers drill-down): final_ln, or before it in layers/ln (NNX "
            "only), layers/dense (NNX only), layers (NNX only): captured by one side alone, "
            "not compared (Linen's capture records nothing inside nn.scan)"
        ) in forward.message, report
        return
    assert names(blamed(results, bug.by), bug.blamed), report
    if bug.call is not None:  # several calls: the verdict says which one parts ways first
        forward = next(r for r in results if r.name == "forward")
        assert f"(layers drill-down): {bug.blamed} in call {bug.call!r}" in forward.message
