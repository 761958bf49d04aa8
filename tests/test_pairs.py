"""`compare_modules` and `assert_parity` on a contributor's own pair: the guide's MLP block
passes bit-exactly in every NNX mode, and each deliberate mismatch fails the right check at the
right place, with the same report in pytest."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from migrate.errors import BadInput
from parity import pairs, testing
from parity.analysis import compare
from parity.engine.result import CheckResult
from parity.pairs import PairArgumentError, compare_modules, format_report
from parity.testing import assert_parity

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

REPO = Path(__file__).resolve().parent.parent
MODES = [(True, True), (True, False), (False, True), (False, False)]


def _load_example():
    """docs/examples/mlp_pair.py as a module (registered: Linen dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(
        "mlp_pair", REPO / "docs" / "examples" / "mlp_pair.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ex = _load_example()
X = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def nnx_mlp(cls=None, *args, mesh=None, **kwargs):
    """An NNX block: without a mesh, eager sharding off; with one, placed eagerly."""
    cls = cls or ex.NNXMLP
    if mesh is None:
        with nnx.use_eager_sharding(False):
            return cls(4, 16, *args, rngs=nnx.Rngs(0), **kwargs)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(ex.RULES):
        return cls(4, 16, mesh, *args, rngs=nnx.Rngs(0), **kwargs)


def failing(results: list[CheckResult]) -> dict[str, str]:
    return {r.name: r.where for r in results if not r.passed}


# ------------------------------------------------------------------ deliberate mismatches


class ExactGeluMLP(ex.NNXMLP):
    """The exact GELU where Linen uses the tanh approximation (its default)."""

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x), approximate=False))


class SwappedNamesMLP(ex.NNXMLP):
    """`down` annotated with the up-projection's names."""

    def __init__(self, features, hidden, mesh=None, *, rngs):
        super().__init__(features, hidden, mesh, rngs=rngs)
        self.down.kernel = nnx.Param(self.down.kernel[...], out_sharding=ex.UP)


class RenamedMLP(nnx.Module):
    """The same block with its own attribute names (`proj_in`, `proj_out`)."""

    def __init__(self, features, hidden, *, rngs):
        block = ex.NNXMLP(features, hidden, rngs=rngs)
        self.proj_in, self.proj_out = block.up, block.down

    def __call__(self, x):
        return x + self.proj_out(jax.nn.gelu(self.proj_in(x)))


class LinenRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat(ex.LinenMLP)(16, name="block")(x)


class NNXNoRemat(nnx.Module):
    def __init__(self, features, hidden, *, rngs):
        self.block = ex.NNXMLP(features, hidden, rngs=rngs)

    def __call__(self, x):
        return self.block(x)


class Broken(ex.NNXMLP):
    def __call__(self, x):
        raise RuntimeError("the port is unfinished")


# ------------------------------------------------------------------ passing pairs


def test_the_example_pair_passes_every_check_bit_exactly():
    results = compare_modules(ex.LinenMLP(16), nnx_mlp(), (X,))
    assert [(r.name, r.passed) for r in results] == [(c, True) for c in pairs.CHECKS]
    assert all(r.value == 0.0 for r in results)
    tensors = {r.name: [d["tensor"] for d in r.details] for r in results}
    assert tensors["forward"] == ["linen-init/outputs", "nnx-init/outputs"]
    assert tensors["grads"] == [  # the parameters' gradients, then the input's
        f"{source}-init/{part}"
        for source in ("linen", "nnx")
        for part in ("grads/down/kernel", "grads/up/kernel", "input_grads/0")
    ]
    assert tensors["sharding"] == [
        "down/kernel: names",
        "down/kernel: rank",
        "up/kernel: names",
        "up/kernel: rank",
        "program: remat regions",
        "program: sharding constraints",
    ]
    assert all(d["mismatches"] == 0 for r in results[:3] for d in r.details)


def test_on_the_mesh_specs_placement_and_compiled_programs_are_compared(mesh):
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    results = compare_modules(
        ex.LinenMLP(16, mesh), nnx_mlp(mesh=mesh), (x,), rules=ex.RULES, mesh=mesh
    )
    assert not failing(results)
    sharding = {d["tensor"]: d for d in results[-1].details}
    assert sharding["up/kernel: spec"]["linen"] == str(P(None, "model"))
    assert sharding["up/kernel: placed"]["nnx"] == str(P(None, "model"))
    for tensor in (
        "compiled input params up/kernel",
        "compiled input input 0",
        "compiled output 0",
        "compiled grad down/kernel",
        "collectives: all-reduce",
    ):
        assert sharding[tensor]["passed"], tensor
    assert sharding["collectives: all-reduce"]["linen"] != "0"  # a real sharded program


@pytest.mark.parametrize("graph_mode,graph_updates", MODES)
def test_every_nnx_mode_gives_the_same_verdict(graph_mode, graph_updates):
    with nnx.set_graph_mode(graph_mode), nnx.set_graph_updates(graph_updates):
        results = compare_modules(ex.LinenMLP(16), nnx_mlp(), (X,))
        wrong = compare_modules(ex.LinenMLP(16), nnx_mlp(ExactGeluMLP), (X,), checks=["forward"])
    assert not failing(results)
    assert failing(wrong) == {"forward": "linen-init/outputs", "layers": "down"}


def test_renames_map_paths_that_differ():
    renamed = nnx_mlp(RenamedMLP)
    without = compare_modules(ex.LinenMLP(16), renamed, (X,), checks=["roundtrip", "sharding"])
    assert "up/kernel: missing on the NNX side" in without[0].message
    assert failing(without)["sharding"] == "down/kernel: names"
    renames = {("up",): ("proj_in",), ("down",): ("proj_out",)}
    results = compare_modules(ex.LinenMLP(16), renamed, (X,), renames=renames)
    assert not failing(results)
    # Records are named by Linen path, whichever side is renamed.
    assert results[2].details[0]["tensor"] == "linen-init/grads/down/kernel"


def test_a_looser_tolerance_is_honoured():
    results = compare_modules(
        ex.LinenMLP(16),
        nnx_mlp(ExactGeluMLP),
        (X,),
        tolerance=compare.Tolerance(1e-3, "exact vs tanh GELU"),
        checks=["forward", "grads"],
    )
    assert not failing(results)
    assert 0 < results[0].value <= 1e-3 and results[0].message == "exact vs tanh GELU"


# ------------------------------------------------------------------ failing pairs


def test_a_forward_bug_fails_forward_and_grads_at_the_largest_error():
    results = compare_modules(ex.LinenMLP(16), nnx_mlp(ExactGeluMLP), (X,))
    assert failing(results) == {
        "forward": "linen-init/outputs",
        "grads": "linen-init/grads/up/kernel",  # through the GELU's derivative: the largest
        "layers": "down",  # the GELU between `up` and `down` is no submodule: `down` reads it
    }
    assert results[1].message.startswith("first divergence (layers drill-down): down")
    grads = {d["tensor"]: d["max_rel"] for d in results[2].details}
    assert grads["linen-init/grads/up/kernel"] > grads["linen-init/grads/down/kernel"] > 0
    forward = results[1]
    assert forward.value > 0 and forward.tolerance == 0.0
    assert [d["passed"] for d in forward.details] == [False, False]  # from both sources


def test_a_wrong_logical_name_fails_sharding_and_the_converter():
    results = compare_modules(ex.LinenMLP(16), nnx_mlp(SwappedNamesMLP), (X,))
    where = failing(results)
    assert set(where) == set(pairs.CHECKS)
    assert where["sharding"] == "down/kernel: names"
    assert where["roundtrip"].startswith("down/kernel: logical names differ")
    record = results[3].details[0]
    assert (record["linen"], record["nnx"]) == (str(ex.DOWN), str(ex.UP))


def test_a_constraint_linen_skips_fails_the_sharding_check(mesh):
    """Linen's constraint is a no-op without a mesh; the NNX port's is not."""
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    results = compare_modules(ex.LinenMLP(16), nnx_mlp(mesh=mesh), (x,), rules=ex.RULES, mesh=mesh)
    assert failing(results) == {"sharding": "program: sharding constraints"}
    record = next(d for d in results[3].details if not d["passed"])
    assert (record["linen"], record["nnx"]) == ("0", "1")


def test_a_module_built_off_the_mesh_is_bad_input_naming_the_fix(mesh):
    """A setup mistake (the NNX module built outside `jax.set_mesh`), refused before
    tracing, not reported as placements that differ."""
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    off_mesh = nnx_mlp()  # eager sharding off: single-device arrays
    off_mesh.mesh = mesh
    with pytest.raises(
        PairArgumentError, match=r"2 array\(s\) of the NNX module are not on it"
    ) as e:
        compare_modules(ex.LinenMLP(16, mesh), off_mesh, (x,), rules=ex.RULES, mesh=mesh)
    assert "on 1 device(s), the mesh has 8" in str(e.value)
    assert "jax.set_mesh(mesh)" in str(e.value)
    assert isinstance(e.value, BadInput)  # exit status 2


def test_removed_remat_changes_no_value_but_fails_sharding():
    with nnx.use_eager_sharding(False):
        port = NNXNoRemat(4, 16, rngs=nnx.Rngs(0))
    results = compare_modules(LinenRemat(), port, (X,))
    assert failing(results) == {"sharding": "program: remat regions"}


def test_vacuous_gradients_and_nan_fail():
    zero = compare_modules(
        ex.LinenMLP(16), nnx_mlp(), (X,), loss_fn=lambda out: 0.0 * jnp.sum(out), checks=["grads"]
    )
    assert not zero[0].passed and "gradient norm is 0.0" in zero[0].message
    variables = ex.LinenMLP(16).init(jax.random.key(0), X)
    up = variables["params"]["up"]["kernel"]
    poisoned = {
        "params": {**variables["params"], "up": {"kernel": up.replace_boxed(up.value * jnp.nan)}}
    }
    nan = compare_modules(
        ex.LinenMLP(16), nnx_mlp(), (X,), linen_variables=poisoned, checks=["forward"]
    )
    assert failing(nan) == {"forward": "linen-init/outputs", "layers": "up"}
    assert nan[0].details[0]["nonfinite"] > 0 and nan[0].details[1]["passed"]


def test_an_error_in_a_module_fails_its_checks_with_the_message():
    results = compare_modules(ex.LinenMLP(16), nnx_mlp(Broken), (X,))
    assert failing(results).keys() == {"forward", "grads", "sharding", "layers"}
    assert "the port is unfinished" in results[1].message
    assert "the port is unfinished" in results[-1].message  # the drill-down cannot run it
    assert results[0].passed  # the weights still convert


def test_options_are_checked_and_checks_selected(mesh):
    with pytest.raises(ValueError, match="unknown check"):
        compare_modules(ex.LinenMLP(16), nnx_mlp(), (X,), checks=["speed"])
    with pytest.raises(ValueError, match="needs rules"):
        compare_modules(ex.LinenMLP(16), nnx_mlp(), (X,), mesh=mesh)
    results = compare_modules(ex.LinenMLP(16), nnx_mlp(), X, checks=["grads", "roundtrip"])
    assert [r.name for r in results] == ["grads", "roundtrip"]


def test_modules_and_inputs_are_unchanged():
    port = nnx_mlp()
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(port)))
    kernel = port.up.kernel[...]
    variables = ex.LinenMLP(16).init(jax.random.key(1), X)
    linen_before = jax.tree.map(np.array, nn.meta.unbox(variables))
    compare_modules(ex.LinenMLP(16), port, (X,), linen_variables=variables)
    assert port.up.kernel[...] is kernel
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(port)), before)
    jax.tree.map(np.testing.assert_array_equal, nn.meta.unbox(variables), linen_before)
    assert isinstance(variables["params"]["up"]["kernel"], nn.LogicallyPartitioned)


# ------------------------------------------------------------------ pytest helper and report


def test_assert_parity_returns_results_or_fails_with_the_report():
    assert len(assert_parity(ex.LinenMLP(16), nnx_mlp(), (X,))) == 4
    with pytest.raises(AssertionError) as raised:
        assert_parity(ex.LinenMLP(16), nnx_mlp(ExactGeluMLP), (X,))
    message = str(raised.value)
    assert message.startswith("LinenMLP (Linen) vs ExactGeluMLP (NNX): FAIL (3 of 5 checks)")
    assert "first divergence (layers drill-down): down" in message
    assert "forward FAIL linen-init/outputs: NNX vs Linen max_rel=" in message
    assert "grads FAIL nnx-init/grads/up/kernel" in message


def test_format_report_lists_failing_records_and_truncates():
    details = tuple(
        {"tensor": f"w{i}: names", "passed": False, "linen": "('a',)", "nnx": "('b',)"}
        for i in range(pairs.MAX_REPORTED + 2)
    )
    result = CheckResult("sharding", False, "max_rel", 1.0, 0.0, "w0: names", details, "note")
    text = format_report([result], "pair")
    assert text.splitlines()[0] == "pair: FAIL (1 of 1 checks)"
    assert "sharding FAIL w0: names: Linen ('a',) vs NNX ('b',)" in text
    assert "sharding: ... and 2 more failing" in text


def test_remat_regions_are_counted_inside_other_primitives():
    body = jax.checkpoint(lambda c, _: (jnp.sin(c), None))
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.scan(body, x, None, length=3)[0])(X)
    assert pairs.count_primitives(jaxpr.jaxpr, pairs.PROGRAM_PRIMITIVES["remat regions"]) == 1


@pytest.mark.slow
def test_importing_parity_does_not_import_jax():
    """parity/cli.py sets XLA_FLAGS before JAX loads: the package must stay light."""
    code = "import sys, parity, parity.cli; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_parity_exports_compare_modules_lazily():
    import parity

    if "compare_modules" not in getattr(parity, "__all__", ()):
        pytest.skip("parity/__init__.py does not re-export compare_modules yet")
    assert parity.compare_modules is compare_modules


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_compiled_programs_are_freed_only_past_the_map_limit_fraction():
    square = jax.jit(lambda x: x * x)
    square(X)
    assert square._cache_size() == 1 and testing.mapped_regions() > 0
    assert not testing.free_compiled_programs_near_map_limit(fraction=1.0)  # far below
    assert square._cache_size() == 1
    assert testing.free_compiled_programs_near_map_limit(fraction=0.0)  # any region is past it
    assert square._cache_size() == 0


RULES = (("embed", None), ("mlp", "model"))


def _dense_pair(linen_names: tuple, nnx_names: tuple):
    kernel_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), linen_names)
    with nnx.use_eager_sharding(False):
        port = nnx.Linear(4, 8, kernel_metadata={"out_sharding": nnx_names}, rngs=nnx.Rngs(0))
    return nn.Dense(8, kernel_init=kernel_init), port


def test_a_shared_annotation_defect_is_a_warning_and_mesh_axis_names_resolve_alike():
    # One name on a 2-D kernel, on both sides: the models share it; no migration difference.
    results = compare_modules(
        *_dense_pair(("embed",), ("embed",)), (X,), rules=RULES, checks=["sharding"]
    )
    assert results[0].passed, format_report(results)
    assert (
        "warning: 1 annotation(s)" in results[0].message
        and "kernel: 1 names on 2" in results[0].message
    )
    # One name on one side only: a difference.
    results = compare_modules(
        *_dense_pair(("embed",), ("embed", "mlp")), (X,), rules=RULES, checks=["sharding"]
    )
    assert failing(results) == {"sharding": "kernel: names"}
    # The port annotated with mesh axes: the same spec through the rules.
    mesh_named = _dense_pair(("embed", "mlp"), (None, "model"))
    results = compare_modules(*mesh_named, (X,), rules=RULES, checks=["sharding"])
    assert results[0].passed, format_report(results)
    names = next(d for d in results[0].details if d["tensor"] == "kernel: names")
    assert names["note"] == "different names, the same spec"
    wrong_axis = _dense_pair(("embed", "mlp"), ("model", None))
    results = compare_modules(*wrong_axis, (X,), rules=RULES, checks=["sharding"])
    assert failing(results) == {"sharding": "kernel: names"}


def test_a_port_annotated_with_mesh_axes_converts_and_gates_like_any_port():
    """The weights cross both ways through the rules (each side keeps its own annotations), so
    every check runs, not only `sharding`; names that resolve elsewhere are still refused."""
    linen, port = _dense_pair(("embed", "mlp"), (None, "model"))
    results = compare_modules(linen, port, (X,), rules=RULES)
    assert all(r.passed for r in results), format_report(results)
    assert {"roundtrip", "forward", "grads"} <= {r.name for r in results}
    linen, port = _dense_pair(("embed", "mlp"), ("model", None))
    results = compare_modules(linen, port, (X,), rules=RULES, checks=["roundtrip"])
    assert not results[0].passed and "logical names differ" in results[0].message


def test_renames_are_suggested_by_shape_and_position_and_lists_cut_at_whole_lines():
    from parity.engine.result import whole_lines
    from parity.module_pair.renames import suggest

    linen = {
        ("params", f"Block_{i}", leaf): shape
        for i in range(2)
        for leaf, shape in (("bias", (4,)), ("kernel", (4, 4)))
    } | {("params", "head", "kernel"): (4, 2)}
    nnx_paths = {
        ("params", f"layers_{i}", leaf): shape
        for i in range(2)
        for leaf, shape in (("bias", (4,)), ("kernel", (4, 4)))
    } | {("params", "head", "kernel"): (4, 2)}
    assert suggest(linen, nnx_paths) == {("Block_0",): ("layers_0",), ("Block_1",): ("layers_1",)}
    assert suggest(linen, {("params", "other"): (3,)}) == {}
    text = "\n".join(f"  - path/number/{i}: missing on the NNX side" for i in range(54))
    cut = whole_lines(text, 400)
    lines = cut.splitlines()
    assert all(line.endswith("missing on the NNX side") for line in lines[:-1])
    assert lines[-1] == f"  ... and {54 - (len(lines) - 1)} more lines"
