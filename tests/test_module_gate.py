"""The gate on a module with every kind of state: Dense -> BatchNorm -> Dropout -> Dense that
sows its hidden activations, called in train mode then eval mode. The correct port passes;
each bug seeded in the port (a wrong running-average momentum, dropout left on in eval, a
missing `sow`, a wrong rate, a mask at the wrong place, a key that never advances) fails at
the place it is; every misuse of `compare_modules` is refused in one line before anything is
traced; the exit status follows the project's contract."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from migrate import errors
from parity import pairs
from parity.analysis import compare
from parity.engine import numeric
from parity.engine.result import CheckResult
from parity.pairs import Call, PairArgumentError, Randomness, compare_modules, format_report

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

D, HIDDEN = 6, 16
X = jax.random.normal(jax.random.key(3), (32, D))
RATE = 0.25


class LinenBlock(nn.Module):
    """The original; `dropout_key` (when given) is the dropout mask's raw key."""

    @nn.compact
    def __call__(self, x, train: bool, dropout_key=None):
        h = nn.Dense(HIDDEN, name="up")(x)
        self.sow("intermediates", "hidden", h)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="norm")(h)
        h = nn.Dropout(RATE, deterministic=not train, name="drop")(h, rng=dropout_key)
        return nn.Dense(4, name="down")(nn.relu(h))


class NNXBlock(nnx.Module):
    """The port."""

    def __init__(self, *, rngs: nnx.Rngs, momentum: float = 0.9, rate: float = RATE):
        self.up = nnx.Linear(D, HIDDEN, rngs=rngs)
        self.norm = nnx.BatchNorm(HIDDEN, momentum=momentum, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, 4, rngs=rngs)

    def hidden(self, x):
        h = self.up(x)
        self.sow(nnx.Intermediate, "hidden", h)
        return self.norm(h)

    def __call__(self, x, dropout_key=None):
        return self.down(jax.nn.relu(self.drop(self.hidden(x), rngs=dropout_key)))


# ------------------------------------------------------------------ seeded bugs


class DropoutInEval(NNXBlock):
    def __call__(self, x, dropout_key=None):
        h = self.drop(self.hidden(x), rngs=dropout_key, deterministic=False)  # mode ignored
        return self.down(jax.nn.relu(h))


class NoSow(NNXBlock):
    def hidden(self, x):
        return self.norm(self.up(x))


class DropoutBeforeNorm(NNXBlock):
    def __call__(self, x, dropout_key=None):
        h = self.up(x)
        self.sow(nnx.Intermediate, "hidden", h)
        h = self.norm(self.drop(h, rngs=dropout_key))  # Linen: after the norm
        return self.down(jax.nn.relu(h))


class RepeatedKey(NNXBlock):
    def __call__(self, x, dropout_key=None):
        h = self.drop(self.hidden(x), rngs=jax.random.key(0))  # the same mask every step
        return self.down(jax.nn.relu(h))


def port(cls=NNXBlock, **kwargs) -> NNXBlock:
    return cls(rngs=nnx.Rngs(0), **kwargs)


TRAIN_MODE = {"deterministic": False, "use_running_average": False}
EVAL_MODE = {"deterministic": True, "use_running_average": True}


def calls(randomness: Randomness) -> list[Call]:
    """Train mode (stochastic), then eval mode: Linen by its `train` argument, NNX by the
    mode attributes of its Dropout and BatchNorm (what `nnx.view` switches)."""
    return [
        Call(
            (X,),
            linen={"train": True},
            nnx_attributes=TRAIN_MODE,
            randomness=randomness,
            name="train",
        ),
        Call((X,), linen={"train": False}, nnx_attributes=EVAL_MODE, name="eval"),
    ]


ALIGNED = calls(Randomness(linen_arg="dropout_key", nnx_arg="dropout_key", draws=16))
STREAMS = calls(Randomness())  # Linen: rngs={'dropout': key}; NNX: its own Rngs streams
GATE = ["roundtrip", "forward", "grads", "random"]


def failing(results) -> dict[str, str]:
    return {r.name: r.where for r in results if not r.passed}


def test_the_port_passes_with_aligned_keys_every_state_compared():
    results = compare_modules(LinenBlock(), port(), ALIGNED, checks=[*GATE, "train", "layers"])
    assert not failing(results), format_report(results)
    forward = [d["tensor"] for d in results[1].details if d["tensor"].startswith("linen-init")]
    assert forward == [
        "linen-init/train/outputs",
        "linen-init/train/state/batch_stats/norm/mean",
        "linen-init/train/state/batch_stats/norm/var",
        "linen-init/train/sown/intermediates/hidden/0",
        "linen-init/eval/outputs",
        "linen-init/eval/state/batch_stats/norm/mean",
        "linen-init/eval/state/batch_stats/norm/var",
        "linen-init/eval/sown/intermediates/hidden/0",
    ]
    roundtrip = {d["tensor"] for d in results[0].details}
    assert "linen-init/linen->nnx->linen/batch_stats/norm/mean" in roundtrip
    assert pairs.exit_status(results) == errors.EXIT_PASS


@pytest.mark.parametrize(
    "bug,where",
    [
        (
            dict(momentum=0.99),
            {"forward": "linen-init/train/state/batch_stats/norm/mean", "layers": "norm"},
        ),
        (dict(cls=DropoutInEval), {"forward": "linen-init/eval/outputs", "layers": "drop"}),
        (dict(cls=NoSow), {"forward": "linen-init/train/sown/intermediates/hidden/0"}),
    ],
    ids=["momentum", "dropout_in_eval", "missing_sow"],
)
def test_a_seeded_bug_fails_forward_where_it_is(bug, where):
    results = compare_modules(LinenBlock(), port(**bug), ALIGNED, checks=["forward"])
    assert failing(results) == where, format_report(results)
    assert pairs.exit_status(results) == errors.EXIT_FAIL
    if "momentum" in bug:  # outputs differ first in eval, after the train call's statistics
        assert results[0].message.startswith(
            "first divergence (layers drill-down): norm in call 'eval' (outputs only: "
            "linen-init/train/state/batch_stats/norm/mean differs before any output)"
        )
    if "cls" in bug and bug["cls"] is NoSow:
        record = next(d for d in results[0].details if not d["passed"])
        assert record["note"] == "on the Linen side only"


def test_the_port_passes_with_each_side_drawing_its_own_keys():
    results = compare_modules(LinenBlock(), port(), STREAMS, checks=GATE)
    assert not failing(results), format_report(results)
    assert "smallest p-value" in results[-1].message


@pytest.mark.parametrize(
    "bug,where",
    [
        # Named at the dropout itself: its output's keep rate, its scale.
        (dict(rate=0.5), "train/drop: zero fraction mean"),
        (dict(cls=DropoutBeforeNorm), "train/drop: mean square mean"),
        (dict(cls=RepeatedKey), "train: draws vary"),
    ],
    ids=["rate", "mask_before_norm", "repeated_key"],
)
def test_a_seeded_randomness_bug_fails_the_random_check(bug, where):
    results = compare_modules(LinenBlock(), port(**bug), STREAMS, checks=["random"])
    assert failing(results) == {"random": where}, format_report(results)


def test_a_repeated_key_is_caught_with_aligned_keys_too():
    results = compare_modules(LinenBlock(), port(RepeatedKey), ALIGNED, checks=["random"])
    assert failing(results) == {"random": "train: draws vary"}
    record = results[0].details[0]
    assert record["linen"] == "15 of 15 draws differ from the one before"
    assert record["nnx"] == "0 of 15 draws differ from the one before"


# ------------------------------------------------------------------ misuse and exit status

MISUSE = {
    "swapped": (lambda: (port(), LinenBlock(), X), {}, "the modules are swapped"),
    "class": (lambda: (LinenBlock(), NNXBlock, X), {}, "nnx_module is the class NNXBlock"),
    "renames": (
        lambda: (LinenBlock(), port(), X),
        {"renames": {"up": "proj"}},
        "renames key 'up' is not a tuple of names",
    ),
    "tolerance": (
        lambda: (LinenBlock(), port(), X),
        {"tolerance": "1e-6"},
        "tolerance is '1e-6'; expected a number (max_rel), a (max_rel, max_abs) pair",
    ),
    "negative_tolerance": (
        lambda: (LinenBlock(), port(), X),
        {"tolerance": (1e-6, -1.0)},
        "tolerance has max_rel=1e-06, max_abs=-1.0; expected finite numbers >= 0",
    ),
    "dict_inputs": (lambda: (LinenBlock(), port(), {"x": X}), {}, "inputs is a dict"),
    "checks": (lambda: (LinenBlock(), port(), X), {"checks": "forward"}, "checks is 'forward'"),
    "numbers": (lambda: (LinenBlock(), port(), ([1.0, 2.0],)), {}, "is a list of numbers"),
    "collection": (
        lambda: (LinenBlock(), port(), X),
        {"collections": {"batch_stats": "BatchStat"}},
        "collections['batch_stats'] is 'BatchStat'",
    ),
    "attribute": (
        lambda: (
            LinenBlock(),
            port(),
            Call((X,), {"train": False}, nnx_attributes={"is_training": 1}),
        ),
        {},
        "nnx_attributes 'is_training' is an attribute of no module in NNXBlock",
    ),
    "method": (
        lambda: (LinenBlock(), port(), Call((X,), method="attend")),
        {},
        "linen_module (LinenBlock) has no method 'attend'",
    ),
    "twice": (
        lambda: (LinenBlock(), port(), Call((X,), {"train": True}, linen={"train": False})),
        {},
        "['train'] given both in kwargs and in linen",
    ),
}


@pytest.mark.parametrize("name", MISUSE)
def test_a_misuse_is_refused_in_one_line_before_tracing(name, monkeypatch):
    arguments, options, message = MISUSE[name]
    traced = []
    monkeypatch.setattr(jax, "jit", lambda *a, **k: traced.append(a))
    with pytest.raises(PairArgumentError) as raised:
        compare_modules(*arguments(), **options)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value) and not traced
    status, _, _ = errors.classify(raised.value)
    assert status == errors.EXIT_USAGE and isinstance(raised.value, ValueError)


class UnmappedCounter(nnx.Variable):
    pass


def test_nnx_state_without_a_linen_collection_is_refused_with_the_fix():
    block = port()
    block.calls = UnmappedCounter(jnp.zeros(()))
    with pytest.raises(PairArgumentError, match=r"collections=\{'<collection>': Unmapped"):
        compare_modules(LinenBlock(), block, ALIGNED)


class Unfinished(NNXBlock):
    def __call__(self, x, dropout_key=None):
        raise NotImplementedError("the port is unfinished\nsee the migration guide")


def test_a_module_that_raises_fails_or_is_bad_input_by_side():
    """The NNX port raising where Linen runs is a parity failure (exit 1); the Linen module
    itself refusing the call is bad input (exit 2); the report gives the error's first line
    and, on request, its traceback."""
    broken = compare_modules(
        LinenBlock(), port(Unfinished), ALIGNED, checks=["forward"], drill_down=False
    )
    assert [r.status for r in broken] == ["failed"]
    assert broken[0].message == (
        "the NNX module raised NotImplementedError in call 'train': the port is unfinished"
    )
    assert pairs.exit_status(broken) == errors.EXIT_FAIL
    short, verbose = format_report(broken), format_report(broken, verbose=True)
    assert "see the migration guide" not in short and "see the migration guide" in verbose
    assert "Traceback" in verbose
    unfit = compare_modules(LinenBlock(), port(), X, checks=["forward"])  # `train` missing
    assert [r.status for r in unfit] == ["bad_input"]
    assert unfit[0].message.startswith("the Linen module raised TypeError in init (call0)")
    assert pairs.exit_status(unfit) == errors.EXIT_USAGE


def test_a_harness_error_is_an_internal_error(monkeypatch):
    def crash(pair):
        raise KeyError("a bug in the harness")

    monkeypatch.setattr(numeric, "forward", crash)  # the registry imports it at the call
    results = compare_modules(LinenBlock(), port(), ALIGNED, checks=["forward"])
    assert [r.status for r in results] == ["errored"]
    assert pairs.exit_status(results) == errors.EXIT_INTERNAL


def test_the_report_keeps_verdicts_records_and_notes_apart():
    results = compare_modules(
        LinenBlock(), port(momentum=0.99), ALIGNED, checks=["forward"], drill_down=False
    )
    lines = format_report(results, "block").splitlines()
    assert lines[0] == "block: FAIL (1 of 1 checks)"
    assert lines[3].startswith(
        "  forward FAIL linen-init/train/state/batch_stats/norm/mean: NNX vs Linen max_rel="
    )
    notes = lines.index("notes:")
    assert all(" FAIL " in line for line in lines[3:notes] if "more failing" not in line)
    assert lines[notes + 1] == "  forward: required: identical computation: bit-exact"
    one_sided = format_report(
        compare_modules(LinenBlock(), port(NoSow), ALIGNED, checks=["forward"])
    )
    assert "linen-init/train/sown/intermediates/hidden/0: on the Linen side only" in one_sided


def test_passing_results_render_and_give_exit_zero():
    result = CheckResult("forward", True, "max_rel", 0.0, 0.0, "x", message="note")
    assert pairs.exit_status([result]) == 0 and "notes:\n  forward: note" in format_report([result])


# ------------------------------------------------------------------ collections of your own


class Counter(nnx.Variable):
    """The port's counterpart of Linen's `counters` collection."""


class Probe(nnx.Intermediate):
    """Sown into Linen's `probes` collection."""


class LinenCounting(nn.Module):
    @nn.compact
    def __call__(self, x):
        calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))
        total = self.variable("counters", "total", lambda: jnp.zeros((), jnp.float32))
        if not self.is_initializing():
            calls.value += 1
            total.value += x.sum()
        y = nn.Dense(3, name="proj")(x)
        self.sow("probes", "projected", y)
        return y


class NNXCounting(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, step: int = 1):
        self.calls = Counter(jnp.zeros((), jnp.int32))
        self.total = Counter(jnp.zeros((), jnp.float32))
        self.proj = nnx.Linear(D, 3, rngs=rngs)
        self.step = step

    def __call__(self, x):
        self.calls[...] = self.calls[...] + self.step
        self.total[...] = self.total[...] + x.sum()
        y = self.proj(x)
        self.sow(Probe, "projected", y)
        return y


def test_collections_of_your_own_are_mapped_moved_and_compared():
    mapped = {"counters": Counter, "probes": Probe}
    twice = [Call((X,), name="first"), Call((X * 2.0,), name="second")]
    results = compare_modules(
        LinenCounting(), NNXCounting(rngs=nnx.Rngs(0)), twice, collections=mapped, checks=GATE[:3]
    )
    assert not failing(results), format_report(results)
    tensors = {d["tensor"] for d in results[1].details}
    assert {
        "linen-init/second/state/counters/calls",
        "linen-init/second/state/counters/total",
        "linen-init/second/sown/probes/projected/0",
    } <= tensors
    assert "linen-init/linen->nnx->linen/counters/calls" in {
        d["tensor"] for d in results[0].details
    }
    off_by_one = compare_modules(
        LinenCounting(),
        NNXCounting(rngs=nnx.Rngs(0), step=2),
        twice,
        collections=mapped,
        checks=["forward"],
    )
    assert failing(off_by_one) == {"forward": "linen-init/first/state/counters/calls"}
    with pytest.raises(PairArgumentError, match="holds Counter variables"):
        compare_modules(LinenCounting(), NNXCounting(rngs=nnx.Rngs(0)), twice)


class ReturnsHidden(NNXBlock):
    def __call__(self, x, dropout_key=None):
        return super().__call__(x, dropout_key), self.up(x)


def test_outputs_of_another_structure_are_named_by_side_and_path():
    results = compare_modules(LinenBlock(), port(ReturnsHidden), ALIGNED[1:], checks=["forward"])
    failed = {d["tensor"]: d["note"] for d in results[0].details if not d["passed"]}
    assert failed["linen-init/outputs"] == "on the Linen side only"
    assert failed["linen-init/outputs/1"] == "on the NNX side only"
    with pytest.raises(compare.TreeMismatch, match=r"only in NNX: \['b'\]; only in Linen: \['a'\]"):
        compare.compare_trees({"b": X}, {"a": X}, ("NNX", "Linen"))
    with pytest.raises(compare.TreeMismatch, match=r"w: shapes differ: NNX \(2,\) vs Linen \(3,\)"):
        compare.compare_trees({"w": X[0, :2]}, {"w": X[0, :3]}, ("NNX", "Linen"))
