"""`migrate port`: Linen modules written as NNX ports that pass their own gate with no edit,
the weight map (identity, or renames), stubs for what it cannot translate, the generated
pytest file, and bad input refused in one line (exit 2)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from test_migrate_cli import migrate

from migrate import cli, errors
from migrate.port import command

MLP = '''
import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """A small MLP."""

    hidden: int = 16
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, train: bool = False):
        # the first layer keeps this comment
        h = nn.Dense(self.hidden, name="fc1")(x)  # and this one
        h = nn.LayerNorm()(nn.relu(h))
        h = nn.Dropout(self.rate)(h, deterministic=not train)
        return nn.Dense(x.shape[-1], use_bias=False)(jax.nn.gelu(h)) + jnp.tanh(x)
'''

CNN = """
import flax.linen as nn


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), padding="SAME")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.silu(x)
        x = nn.Conv(4, (3, 3), strides=(2, 2), use_bias=False)(x)
        return nn.Dense(2)(x.reshape((x.shape[0], -1)))
"""

TAGGER = """
import flax.linen as nn
import jax.numpy as jnp


class Tagger(nn.Module):
    vocab: int = 10

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(self.vocab, 8, name="embed")(ids)
        h = nn.RMSNorm(name="norm")(h)
        h = nn.DenseGeneral((2, 4), name="heads")(h)
        scale = self.param("scale", nn.initializers.ones, (h.shape[-1],))
        return jnp.sum(h * scale, axis=-2)
"""

BRIDGED = """
import flax.linen as nn


class Gate(nn.Module):  # a user's own Linen layer: ported with the module that builds it
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.sigmoid(nn.Dense(self.features)(x)) * x


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="proj")(x)
        x = Gate(4, name="gate")(x)
        x = Gate(x.shape[-1])(x)
        y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)(x[:, None, :])
        return nn.Dense(2, name="out")(x + y[:, 0])
"""

SETUP = """
import flax.linen as nn
import jax.numpy as jnp


class Scale(nn.Module):
    features: int

    def setup(self):
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        self.scale = self.param("scale", init, (self.features,))

    def __call__(self, x):
        return x * self.scale


class Shift(nn.Module):
    features: int

    def setup(self):
        self.shift = self.param("shift", nn.initializers.zeros, (self.features,))

    def __call__(self, x):
        return x + self.shift


class Head(nn.Module):
    \"\"\"Setup-style: a Linen layer sized by the trace, a user's class chosen by a field, a
    parameter held under another attribute name, a second method reading it.\"\"\"

    features: int = 6
    shifted: bool = False

    def setup(self):
        # the projection, sized by the trace
        self.proj = nn.Dense(self.features, use_bias=False)
        self.post = Shift(self.features) if self.shifted else Scale(self.features)
        self.w = self.param("bias", nn.initializers.normal(1.0), (self.features,))

    def __call__(self, x):
        return self.post(nn.relu(self.proj(x))) + self.w

    def attend(self, y):
        return y * self.w
"""

UNEVEN = """
import flax.linen as nn


class Gate(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = Gate(3)(x)
        return Gate(2)(y)
"""

WRAPPED = """
import flax.linen as nn
from flax import nnx


class Scaled(nnx.Module):
    def __init__(self, features: int, scale: float = 1.0, bias: bool = True, *, rngs):
        self.linear = nnx.Linear(features, features, use_bias=bias, rngs=rngs)
        self.scale = scale

    def __call__(self, x):
        return self.linear(x) * self.scale


def scaled(features, scale=1.0, bias=True, name=None):
    kwargs = {"scale": scale, "bias": bias}
    return nnx.bridge.ToLinen(Scaled, args=(features,), kwargs=kwargs, name=name)


class Half(nn.Module):
    \"\"\"A half-migrated module: an NNX layer wrapped for Linen by a factory.\"\"\"

    width: int = 4
    scale: float = 0.5

    @nn.compact
    def __call__(self, x):
        width = self.width
        y = scaled(width, scale=self.scale, name="inner")(x)
        return nn.Dense(width)(y)
"""

STACK = """
import flax.linen as nn


class Block(nn.Module):
    width: int

    def setup(self):
        self.dense = nn.Dense(self.width)

    def __call__(self, x, scale):
        return nn.tanh(self.dense(x)) * scale


class Stack(nn.Module):
    depth: int = 3
    width: int = 4
    remat: bool = True

    def setup(self):
        block = Block
        if self.remat:
            block = nn.remat(block, static_argnums=2)
        self.blocks = [block(self.width, name=f"blocks.{i}") for i in range(self.depth)]

    def __call__(self, x):
        for b in self.blocks:
            x = b(x, 2.0)
        return x
"""

LOOPED = """
import flax.linen as nn


class Tower(nn.Module):
    depth: int = 3

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.relu(nn.Dense(x.shape[-1], name=f"dense_{i}")(x))
        return nn.Dense(2)(x)
"""

HALF_LINEN = """
import enum

import flax.linen as nn
import jax.numpy as jnp


class Kind(enum.Enum):
    PLAIN = 1
    SCALED = 2


class Counter(nn.Module):  # Linen-only code: not ported, bridged where it is built
    @nn.compact
    def __call__(self, x):
        scale = 1.0 if self.is_initializing() else 2.0
        return nn.Dense(4)(x) * scale


class Codec(nn.Module):
    vocab: int = 10
    kind: Kind = Kind.SCALED

    def setup(self):
        self.table = self.param("table", nn.initializers.normal(1.0), (self.vocab, 4))
        self.counter = Counter()

    def encode(self, ids):
        rows = jnp.take(self.table, ids, axis=0)
        rows = rows * 2.0 if self.kind == Kind.SCALED else rows
        return self.counter(rows)
"""

STATEFUL = """
import flax.linen as nn
import jax.numpy as jnp


class Tracker(nn.Module):
    features: int = 3

    @nn.compact
    def __call__(self, x):
        ema = self.variable("stats", "ema", jnp.zeros, (self.features,))
        ema.value = 0.9 * ema.value + 0.1 * x.mean(0)
        return nn.Dense(self.features)(x) + ema.value


class Counted(nn.Module):
    def setup(self):
        self.count = self.variable("batch_stats", "count", jnp.zeros, ())
        self.tracker = Tracker()

    def __call__(self, x):
        self.count.value = self.count.value + 1.0
        return self.tracker(x) * self.count.value
"""

SCANNED = """
import flax.linen as nn
import jax.numpy as jnp


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, carry, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        kernel = self.param("kernel", init, (self.width, self.width))
        h = carry @ kernel + nn.Dense(self.width)(x)
        return jnp.tanh(h), h.sum(-1)


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


class Layers(nn.Module):
    width: int = 4
    depth: int = 3

    def setup(self):
        scanned = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=nn.broadcast, length=self.depth,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        self.layers = scanned(self.width)
        mapped = nn.vmap(
            Head, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0,
            out_axes=0, axis_size=2,
        )
        self.heads = mapped()

    def __call__(self, x):
        carry, ys = self.layers(x, x)
        return self.heads(jnp.stack([carry, 2 * carry])), ys
"""

SCANNED_BY_HELPERS = """
import flax.linen as nn
import jax
import jax.numpy as jnp


class Cell(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, scale):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return jnp.tanh(x @ self.param("kernel", init, (self.width, self.width))) * scale


def checkpointed(policy):
    return nn.remat(lambda cell, x, scale: cell(x, scale), policy=policy, prevent_cse=False)


def scan_cells(cell: nn.Module, x, scale, depth, axis_name):
    call = checkpointed(jax.checkpoint_policies.nothing_saveable)

    def body(module, carry, scale, step):
        y = call(module, carry, scale) + step
        return y, y.sum()

    scanned = nn.scan(
        body, variable_axes={"params": 0}, split_rngs={"params": True},
        in_axes=(nn.broadcast, 0), length=depth,
        metadata_params={nn.PARTITION_NAME: axis_name},
    )
    return scanned(cell, x, scale, jnp.arange(depth, dtype=x.dtype))


def map_heads(head, x):
    mapped = nn.vmap(
        lambda module, x: module(x), variable_axes={"params": 0},
        split_rngs={"params": True}, in_axes=0, out_axes=0, axis_size=x.shape[0],
    )
    return mapped(head, x)


def tilted(cell, x):
    return nn.scan(lambda m, c, _: (m(c, 1.0), None), variable_axes={"params": 1},
                   length=2)(cell, x, None)


class InMethod(nn.Module):
    def setup(self):
        self.cell = Cell(4)

    def __call__(self, x):
        scanned = nn.scan(
            lambda m, c, _: (m(c, 1.0), None), variable_axes={"params": 0},
            split_rngs={"params": True}, length=2, metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return scanned(self.cell, x, None)[0]


class Stack(nn.Module):
    width: int = 4
    depth: int = 3

    def setup(self):
        self.cells = Cell(self.width)
        self.heads = nn.Dense(2)

    def __call__(self, x):
        depth = self.depth
        y, sums = scan_cells(self.cells, x, 0.5, depth, "layers")
        return map_heads(self.heads, jnp.stack([y, -y])), sums
"""


FUNCTIONAL = """
import flax.linen as nn
import jax
import jax.numpy as jnp


class Cell(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return jnp.tanh(x @ self.param("kernel", init, (self.width, self.width)))


class Cells(nn.Module):
    width: int
    depth: int = 2

    def setup(self):
        for i in range(self.depth):
            setattr(self, f"cell_{i}", Cell(self.width))
        self.drop = nn.Dropout(0.5)

    def __call__(self, x):
        for i in range(self.depth):
            x = getattr(self, f"cell_{i}")(x)
        return self.drop(x, deterministic=True, rng=jax.random.key(0))


def stacked(stages):
    return nn.vmap(
        Cells, in_axes=0, out_axes=0, axis_size=stages, variable_axes={"params": 0},
        split_rngs={"params": True}, metadata_params={nn.PARTITION_NAME: "stage"},
    )


class Functional(nn.Module):
    width: int = 4
    stages: int = 2

    def setup(self):
        self.cells = stacked(self.stages)(self.width)

    def __call__(self, x):
        if self.is_initializing():
            return self.cells(x)
        template = Cells(self.width, parent=None)
        weights = nn.meta.unbox(self.variables["params"]["cells"])
        specs = nn.get_partition_spec(self.variables["params"]["cells"])
        names = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
        scale = sum(n[0] == "stage" for n in names)
        return jax.vmap(lambda w, x: template.apply({"params": w}, x))(weights, x) * scale
"""


NORMS = """
import flax.linen as nn


class Norms(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.GroupNorm(num_groups=2)(x)
        x = nn.ConvTranspose(4, (3, 3), strides=(2, 2))(x)
        x = nn.InstanceNorm()(x)
        return nn.GroupNorm(num_groups=None, group_size=2, use_scale=False)(x)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a user's module file (importable under its name) and returns the module."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def write(name: str, text: str):
        import importlib

        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
        return importlib.import_module(name)

    return write


@pytest.fixture
def passing_port(user_module, tmp_path):
    """Writes a user's module file, ports its class, asserts the port passed its gate and
    returns the `PortResult` (into `tmp_path` unless told `out`)."""

    def port(module_name, text, class_name, inputs, out=None, **options):
        module = user_module(module_name, text)
        result = command.port(getattr(module, class_name), inputs, out or tmp_path, **options)
        assert result.status == 0, result.gate.report
        return result

    return port


def test_an_mlp_ports_to_a_passing_gate_with_no_edit(user_module, tmp_path):
    """Dense (named and auto-named), LayerNorm, Dropout and activations: the port passes
    forward and grads in eval mode and `random` in train mode; comments are kept."""
    module = user_module("port_mlp", MLP)
    result = command.port(
        module.MLP,
        "float32[4,8]",
        tmp_path / "out",
        call_kwargs=[{"train": False}, {"train": True}],
    )
    assert result.status == 0, result.gate.report
    assert "random     PASS" in result.gate.report
    assert [(p.linen, p.attribute) for p in result.placed] == [
        ("fc1", "fc1"),
        ("LayerNorm_0", "LayerNorm_0"),
        ("Dropout_0", "Dropout_0"),
        ("Dense_0", "Dense_0"),
    ]
    assert result.renames == {} and not result.stubs
    code = result.nnx_path.read_text()
    assert "# the first layer keeps this comment" in code and "# and this one" in code
    assert "self.fc1 = nnx.Linear(8, out_features=self.hidden, rngs=rngs)" in code
    assert "h = self.Dropout_0(h, deterministic=not train)" in code
    assert "nnx.relu(h)" in code and "@nn.compact" not in code
    entries = json.loads(result.weight_map_path.read_text())["entries"]
    assert {"linen": "params/fc1/kernel", "nnx": "fc1/kernel", "shape": [8, 16],
            "dtype": "float32"} in entries  # fmt: skip


def test_a_cnn_with_batch_norm_ports_with_snake_names_and_their_renames(user_module, tmp_path):
    """Conv and BatchNorm (its mode moved to the call), statistics compared after each call;
    snake_case attributes give a weight map of renames, which the gate uses."""
    module = user_module("port_cnn", CNN)
    result = command.port(
        module.CNN, "float32[2,6,6,3]", tmp_path, call_kwargs=[{"train": True}, {"train": False}],
        names="snake",
    )  # fmt: skip
    assert result.status == 0, result.gate.report
    assert result.renames[("BatchNorm_0",)] == ("batch_norm_0",)
    code = result.nnx_path.read_text()
    assert "nnx.BatchNorm(8, momentum=0.9, rngs=rngs)" in code
    assert "self.batch_norm_0(x, use_running_average=not train)" in code
    mapped = json.loads(result.weight_map_path.read_text())
    assert ["BatchNorm_0"], ["batch_norm_0"] in mapped["renames"]
    assert {"params/Conv_1/kernel", "batch_stats/BatchNorm_0/mean"} <= {
        e["linen"] for e in mapped["entries"]
    }


def test_embed_norm_dense_general_and_a_param_and_the_written_test_passes(user_module, tmp_path):
    """Integer inputs drawn inside the table; `self.param` becomes an `nnx.Param`; the written
    pytest file's own test passes when imported and run."""
    module = user_module("port_tagger", TAGGER)
    result = command.port(module.Tagger(vocab=12), "int32[2,5]", tmp_path, run_gate=False)
    code = result.nnx_path.read_text()
    assert "self.scale = nnx.Param(nn.initializers.ones(rngs.params(), (4,)))" in code
    assert "scale = self.scale[...]" in code
    assert "nnx.LinearGeneral((8,), out_features=(2, 4)" in code
    written = command.run_written_gate(result.test_path)
    assert written.status == 0, written.report
    test_file = command.importlib.import_module(result.test_path.stem)
    assert test_file.FIELDS == {"vocab": 12}
    test_file.test_port()


def test_a_users_own_class_is_ported_once_and_an_untranslated_layer_bridged(passing_port):
    """A user's Linen class built in the module is ported beside it (one NNX class, two
    instances, the constructor argument computed in `__call__` written as its traced value);
    a layer with no NNX form stays a marked `ToNNX` stub; the whole port passes its gate."""
    result = passing_port("port_bridged", BRIDGED, "Block", "float32[3,4]")
    assert [(c.cls.__name__, c.instances) for c in result.classes] == [
        ("Gate", (("gate",), ("Gate_0",))),
        ("Block", ((),)),
    ]
    assert [str(s) for s in result.stubs] == [
        "line 19: nn.MultiHeadDotProductAttention(...) (not a layer `migrate port` translates "
        "yet): bridged through nnx.bridge.ToNNX; port it by hand"
    ]
    code = result.nnx_path.read_text()
    assert code.count("class Gate(nnx.Module):") == 1 and "from port_bridged import" not in code
    assert "self.gate = Gate(4, rngs=rngs)" in code
    assert "self.Gate_0 = Gate(features=4, rngs=rngs)" in code  # x.shape[-1], traced
    assert "# migrate port: STUB (Linen line 19)" in code
    assert "nnx.bridge.ToNNX(nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)" in code
    assert "ported with it: Gate" in result.summary()


def test_group_and_instance_norms_and_a_transposed_conv_port_bit_exact(passing_port):
    """Their feature sizes from the trace, the group options carried as written."""
    result = passing_port("port_norms", NORMS, "Norms", "float32[2,6,6,4]")
    code = result.nnx_path.read_text()
    assert "nnx.GroupNorm(4, num_groups=2, rngs=rngs)" in code
    assert "nnx.ConvTranspose(4, out_features=4, kernel_size=(3, 3), strides=(2, 2)," in code
    assert "nnx.InstanceNorm(4, rngs=rngs)" in code
    assert "nnx.GroupNorm(4, num_groups=None, group_size=2, use_scale=False," in code


def test_a_setup_style_module_ports_with_its_own_classes_and_renamed_parameter(
    user_module, tmp_path
):
    """`setup` becomes `__init__` (comments kept): `nn.Dense` sized by the trace, the user's
    class chosen by a field kept as a conditional (both branches ported, the untraced one
    from its source alone), `with_logical_partitioning` as `out_sharding`, a parameter read
    as a value in every method; `self.w = self.param("bias", ...)` gives a weight-map rename."""
    module = user_module("port_setup", SETUP)
    result = command.port(module.Head, "float32[2,5]", tmp_path)
    assert result.status == 0, result.gate.report
    assert [c.cls.__name__ for c in result.classes] == ["Shift", "Scale", "Head"]
    assert result.renames == {("bias",): ("w",)}
    code = result.nnx_path.read_text()
    assert "# the projection, sized by the trace" in code
    assert (
        "self.proj = nnx.Linear(5, out_features=self.features, use_bias=False, rngs=rngs)" in code
    )
    assert (
        "self.post = Shift(self.features, rngs=rngs) if self.shifted "
        "else Scale(self.features, rngs=rngs)"
    ) in code
    assert (
        "self.scale = nnx.Param(nn.initializers.ones(rngs.params(), (self.features,)), "
        'out_sharding=("embed",))'
    ) in code
    assert "return x * self.scale[...]" in code and "+ self.w[...]" in code
    assert "def setup" not in code
    entries = json.loads(result.weight_map_path.read_text())["entries"]
    assert {"linen": "params/bias", "nnx": "w", "shape": [6], "dtype": "float32"} in entries
    shifted = command.port(module.Head(shifted=True), "float32[2,5]", tmp_path / "shifted")
    assert shifted.status == 0, shifted.gate.report
    assert shifted.nnx_path.read_text() == code  # one port serves either branch


def test_instances_needing_different_sizes_leave_their_class_bridged(passing_port):
    """Two instances of one class whose traced input sizes differ and match no field: the class
    is not ported (its reason in the summary) and each site is bridged; the rest passes."""
    result = passing_port("port_uneven", UNEVEN, "Twice", "float32[2,5]")
    gate_class = result.classes[0]
    assert gate_class.emitted is None and "need different NNX code" in gate_class.refused
    assert [s.line for s in result.stubs] == [16, 17]
    assert "not ported: Gate (its instances at Gate_0 and Gate_1" in result.summary()


def test_a_wrapped_nnx_module_is_its_own_port_and_locals_read_as_fields(passing_port, tmp_path):
    """`nnx.bridge.ToLinen` built by a factory with `name=`: the port builds the NNX class
    itself, each argument the call's expression where it gives the traced value (else the
    value), the class's own defaults left out; `width = self.width` read through the field."""
    result = passing_port("port_wrapped", WRAPPED, "Half", "float32[2,4]", out=tmp_path / "out")
    assert [(p.linen, p.form) for p in result.placed] == [
        ("inner", "Scaled (NNX, unwrapped)"),
        ("Dense_0", "nn.Dense -> nnx.Linear"),
    ]
    code = result.nnx_path.read_text()
    assert "self.inner = Scaled(4, scale=self.scale, rngs=rngs)" in code  # bias: the default
    assert "self.Dense_0 = nnx.Linear(self.width, out_features=self.width, rngs=rngs)" in code
    assert "from port_wrapped import Scaled" in code


def test_a_list_of_rematerialised_blocks_made_in_setup(passing_port):
    """`[block(..., name=f"blocks.{i}") for ...]` through a local holding `nn.remat(Block)`:
    an `nnx.List` of the ported class rematerialised by the port's `remat_class`; the
    weight map carries `blocks.0` to `blocks/0`."""
    result = passing_port("port_stack", STACK, "Stack", "float32[2,4]")
    code = result.nnx_path.read_text()
    assert "def remat_class(cls, **options):" in code
    assert "block = remat_class(block, static_argnums=2)" in code and "block = Block\n" in code
    assert (
        "self.blocks = nnx.List([block(self.width, rngs=rngs) for i in range(self.depth)])"
    ) in code
    assert result.renames == {(f"blocks.{i}",): ("blocks", str(i)) for i in range(3)}
    assert [p.attribute for p in result.placed] == ["blocks/0", "blocks/1", "blocks/2"]


def test_submodules_made_in_a_compact_loop_are_made_in_the_same_loop_in_init(passing_port):
    """`for i in range(self.depth): nn.Dense(..., name=f"dense_{i}")(x)`: the same loop in
    `__init__` sets each layer by its Linen name, `__call__` reads it back with `getattr`."""
    result = passing_port("port_tower", LOOPED, "Tower", "float32[2,4]")
    code = result.nnx_path.read_text()
    assert (
        "        for i in range(self.depth):\n"
        '            setattr(self, f"dense_{i}", nnx.Linear(4, out_features=4, rngs=rngs))\n'
    ) in code
    assert 'x = nnx.relu(getattr(self, f"dense_{i}")(x))' in code
    assert [p.linen for p in result.placed] == ["dense_0", "dense_1", "dense_2", "Dense_0"]
    assert result.renames == {}


def test_linen_only_code_leaves_its_class_bridged_and_another_method_is_gated(
    user_module, tmp_path
):
    """A class reading `self.is_initializing()` and `self.variables` is bridged where it is
    built (the reason named), the rest ported; an enum field is written by name in the gate;
    `method="encode"` traces and gates that method."""
    module = user_module("port_codec", HALF_LINEN)
    result = command.port(module.Codec(kind=module.Kind.PLAIN), "int32[2,3]", tmp_path,
                          method="encode")  # fmt: skip
    assert result.status == 0, result.gate.report
    counter = result.classes[0]
    assert counter.cls.__name__ == "Counter" and counter.emitted is None
    assert counter.refused == "line 16: self.is_initializing"
    assert "nnx.bridge.ToNNX(Counter(), rngs=rngs)" in result.nnx_path.read_text()
    gate = result.test_path.read_text()
    assert "from port_codec import Kind" in gate and "FIELDS = {'kind': Kind.PLAIN}" in gate
    assert "method='encode'" in gate
    with pytest.raises(errors.BadInput, match="Codec has no method 'decode'"):
        command.port(module.Codec, "int32[2,3]", tmp_path / "x", method="decode")


def test_variables_of_linen_collections_become_nnx_variables_compared_after_each_call(passing_port):
    """`self.variable("batch_stats", ...)` -> `nnx.BatchStat`, another collection -> a
    `Variable` subclass the port file defines (and the gate maps); `.value` -> `[...]`."""
    result = passing_port("port_counted", STATEFUL, "Counted", "float32[2,3]", call_kwargs=[{}, {}])
    code = result.nnx_path.read_text()
    assert "class Stats(nnx.Variable):" in code
    assert "self.ema = Stats(jnp.zeros((self.features,)))" in code
    assert "ema[...] = 0.9 * ema[...] + 0.1 * x.mean(0)" in code
    assert "self.count = nnx.BatchStat(jnp.zeros(()))" in code
    assert "self.count[...] = self.count[...] + 1.0" in code
    assert "return {'stats': Stats}" in result.test_path.read_text()
    assert "batch_stats/count" in {
        e["linen"] for e in json.loads(result.weight_map_path.read_text())["entries"]
    }


def test_scanned_and_vmapped_classes_become_stacked_nnx_modules(passing_port):
    """`nn.scan(Block, ...)` and `nn.vmap(Head, ...)` of classes: the port file's
    `scan_class` / `vmap_class` build the instances stacked under `nnx.vmap` (the stacked axis
    named in the sharding metadata) and call them under `nnx.scan` / `nnx.vmap`."""
    result = passing_port("port_scanned", SCANNED, "Layers", "float32[2,4]")
    code = result.nnx_path.read_text()
    assert "def scan_class(cls, *, length," in code and "def vmap_class(cls, *, axis_size," in code
    assert "scanned = scan_class(" in code and "mapped = vmap_class(" in code
    assert "self.layers = scanned(self.width, rngs=rngs)" in code
    kernel = next(
        e for e in json.loads(result.weight_map_path.read_text())["entries"]
        if e["linen"] == "params/layers/kernel"
    )  # fmt: skip
    assert kernel["shape"] == [3, 4, 4]


def test_functions_applying_lifted_transforms_to_a_submodule_are_ported_beside_it(
    passing_port, tmp_path
):
    """`scan_cells(self.cells, ...)` applies `nn.scan` (and, through `checkpointed`,
    `nn.remat`) to a function of the module handed to it, `map_heads` `nn.vmap`: both are
    ported into the port file (`scan_function` / `vmap_function`, `nnx.remat`), the submodules
    they stack built stacked in `__init__`, with the size and axis name written as the call
    gives them where `__init__` can evaluate that (`self.depth`, `"layers"`), else as traced
    (2 heads); bit-exact, the stacked axis named in the sharding. A function stacking on
    another axis than 0 is not ported, and says why; a transform of a function inside a
    method is marked as such."""
    from migrate.port import functions

    result = passing_port("port_helpers", SCANNED_BY_HELPERS, "Stack", "float32[5,4]")
    code = result.nnx_path.read_text()
    assert (
        "self.cells = stacked_modules(lambda rngs: Cell(self.width, rngs=rngs), self.depth, "
        '"layers", rngs)' in code
    )
    assert (
        "self.heads = stacked_modules(lambda rngs: nnx.Linear(self.width, out_features=2, "
        "rngs=rngs), 2, "
        "None, rngs)" in code
    )
    assert "return nnx.remat(lambda cell, x, scale: cell(x, scale), policy=policy" in code
    assert "scanned = scan_function(" in code and "in_axes=(None, 0)" in code
    assert "metadata_params={nnx.PARTITION_NAME: axis_name}" in code
    assert "mapped = vmap_function(" in code and "def tilted" not in code
    helpers = code[code.index("def checkpointed") : code.index("class Cell")]
    assert "nn." not in helpers.replace("nnx.", "")
    assert not result.stubs
    kernel = next(
        e for e in json.loads(result.weight_map_path.read_text())["entries"]
        if e["linen"] == "params/cells/kernel"
    )  # fmt: skip
    assert kernel["shape"] == [3, 4, 4] and kernel["nnx"] == "cells/kernel"
    module = sys.modules["port_helpers"]
    assert functions.port(module.tilted).refusal == (
        'variable_axes={"params": 1}: only a leading axis 0 is ported'
    )
    in_method = command.port(module.InMethod, "float32[5,4]", tmp_path / "in_method")
    assert in_method.status == 1  # the transform left as written: the gate says so
    (stub,) = in_method.stubs
    assert stub.idiom == "nn.scan of a function" and "inside a method" in stub.note


def test_linen_functional_application_ports_to_nnx_state_and_merge(passing_port):
    """Linen's functional idioms, each in its NNX form: `if self.is_initializing():` (NNX has
    no init pass: the branch is dropped), a function returning `nn.vmap` of a class
    (`vmap_class`, the class ported), `self.variables["params"]["cells"]` ->
    `nnx.state(self.cells, nnx.Param)`, `nn.meta.unbox` (an NNX Variable is its own box) and
    `nn.get_partition_spec` -> NNX's, an unbound `Cells(..., parent=None)` applied by
    `.apply({"params": w}, x)` -> a `GraphDef` merged with `w`; submodules `setattr` in a
    setup loop; a dropout given its key at every call holds no key stream. Bit-exact."""
    result = passing_port("port_functional", FUNCTIONAL, "Functional", "float32[2,3,4]")
    code = result.nnx_path.read_text()
    assert "is_initializing" not in code and "self.cells(x)" not in code
    assert "self.cells = stacked(self.stages)(self.width, rngs=rngs)" in code
    assert "return vmap_class(" in code
    assert "weights = nnx.state(self.cells, nnx.Param)" in code
    assert "specs = nnx.get_partition_spec(nnx.state(self.cells, nnx.Param))" in code
    assert "template = module_template(lambda rngs: Cells(self.width, rngs=rngs))" in code
    assert "nnx.merge(template, w)(x)" in code
    assert 'setattr(self, f"cell_{i}", Cell(self.width, rngs=rngs))' in code
    assert "self.drop = nnx.Dropout(rate=0.5)" in code
    assert not result.stubs
    kernel = next(
        e for e in json.loads(result.weight_map_path.read_text())["entries"]
        if e["linen"] == "params/cells/cell_1/kernel"
    )  # fmt: skip
    assert kernel["shape"] == [2, 4, 4] and kernel["nnx"] == "cells/cell_1/kernel"


def test_classes_from_another_file_of_the_package_are_ported_into_their_own_file(
    tmp_path, monkeypatch
):
    """A model file in, a model file out: the user's class imported from a sibling module is
    ported into that module's NNX file, which the root's port imports."""
    package = tmp_path / "portpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "parts.py").write_text(textwrap.dedent(BRIDGED).split("class Block")[0])
    (package / "whole.py").write_text(
        "import flax.linen as nn\nfrom portpkg.parts import Gate\n\n\n"
        "class Whole(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n"
        "        return Gate(3, name='gate')(nn.Dense(3)(x))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from portpkg import whole

    result = command.port(whole.Whole, "float32[2,5]", tmp_path / "out")
    assert result.status == 0, result.gate.report
    assert [p.name for p in result.other_files] == ["parts_nnx.py"]
    assert "from parts_nnx import Gate" in result.nnx_path.read_text()
    assert "class Gate(nnx.Module):" in result.other_files[0].read_text()


@pytest.mark.slow
def test_the_twins_decoder_ports_whole_pipeline_included(tmp_path, monkeypatch):
    """The whole twins' Linen decoder ports to a bit-exact gate with no stub and no hand edit.
    Pipelined: Linen's functional pipeline in NNX (`stacked_stages`' nested `nn.vmap` of
    `StageLayers` as `vmap_class`, the weights read as `nnx.state`, the stage applied by
    `nnx.merge` of a template, the init-only branch dropped). As the non-pipelined reference:
    its layers, scanned by the helper `scan_layers` (`nn.scan` of a function of the module,
    through `remat_layer`'s `nn.remat`), built stacked on the `layers` axis and scanned by the
    helper's port in `pipeline_nnx.py`."""
    from migrate.linen import decoder

    pipelined = command.port(
        decoder.Decoder, "int32[16,16]", tmp_path / "pipelined",
        fields_from="migrate.port.corpus:llama2_tiny",
    )  # fmt: skip
    assert pipelined.status == 0, pipelined.gate.report
    assert not pipelined.stubs and not [c for c in pipelined.classes if c.refused]
    assert {"Pipeline", "StageLayers"} <= {c.cls.__name__ for c in pipelined.classes}
    code = (tmp_path / "pipelined" / "pipeline_nnx.py").read_text()
    assert "self.layers = stacked_stages(cfg)(cfg, self.mesh, rngs=rngs)" in code
    assert "stage = module_template(lambda rngs: StageLayers(cfg, self.mesh, rngs=rngs))" in code
    assert "boxed_weights = nnx.state(self.layers, nnx.Param)" in code
    assert "return nnx.merge(stage, stage_weights)(x, pos, first_layer)" in code
    assert "is_initializing" not in code and "flax.linen" not in code
    # imported as the Linen file imports them, not through it
    assert "from collections.abc import Callable" in code
    assert "from jax.sharding import Mesh, NamedSharding" in code
    reference = command.port(
        decoder.Decoder, "int32[16,16]", tmp_path / "reference",
        fields_from="migrate.port.corpus:llama2_tiny_reference",
    )  # fmt: skip
    assert reference.status == 0, reference.gate.report
    assert not reference.stubs
    code = reference.nnx_path.read_text()
    assert (
        "self.layers = stacked_modules(lambda rngs: DecoderLayer(cfg, self.mesh, rngs=rngs), "
        "self.config.base_num_decoder_layers, axes.REFERENCE_LAYERS, rngs)" in code
    )
    assert "from pipeline_nnx import Pipeline, scan_layers" in code
    helpers = (tmp_path / "reference" / "pipeline_nnx.py").read_text()
    assert "def scan_layers(" in helpers and "def remat_layer(" in helpers


@pytest.mark.parametrize(
    "fields", ["llama2_tiny", pytest.param("mixtral_tiny", marks=pytest.mark.slow)]
)
def test_the_twins_decoder_layer_ports_to_a_passing_gate_with_no_stub(
    tmp_path, monkeypatch, fields
):
    """The twins' Linen `DecoderLayer` (setup-style, its norm, attention, rotary, MLP or MoE
    and dense layers the user's own, boxed parameters) is ported whole, from its file, to a
    bit-exact gate on a shipped config and its mesh; the generated test passes too."""
    from migrate.linen import layers

    result = command.port(
        layers.DecoderLayer, "float32[2,16,64];int32[2,16]", tmp_path,
        fields_from=f"migrate.port.corpus:{fields}",
    )  # fmt: skip
    assert result.status == 0, result.gate.report
    assert not result.stubs and result.renames == {}
    hand = ["DenseGeneral", "RMSNorm", "RotaryEmbedding", "Attention", "MLP", "MoeBlock"]
    assert sorted(c.cls.__name__ for c in result.classes) == sorted([*hand, "DecoderLayer"])
    code = result.nnx_path.read_text()
    assert "out_sharding=self.kernel_axes" in code and "from migrate.port.corpus" not in code
    monkeypatch.syspath_prepend(str(tmp_path))
    for written in (result.test_path.stem, result.nnx_path.stem):
        monkeypatch.delitem(sys.modules, written, raising=False)
    test_file = command.importlib.import_module(result.test_path.stem)
    test_file.test_port()


def test_the_command_ports_with_fields_from_and_snake_names_nest_their_renames(
    passing_port, tmp_path, capsys
):
    """`migrate port ... --fields_from=...` exits 0 with its summary; `--names=snake` renames
    the auto-named layers inside a ported class too, at their full paths."""
    args = ("port", "migrate.linen.layers:RMSNorm", "--inputs=float32[2,16,64]", "--out=norm")
    fields = "--fields_from=migrate.port.corpus:llama2_tiny_config"
    assert migrate(*args, fields) == cli.EXIT_PASS
    assert "RMSNorm (Linen) vs RMSNorm (NNX port): PASS" in capsys.readouterr().out
    result = passing_port(
        "port_nested", BRIDGED, "Block", "float32[3,4]", out=tmp_path / "snake", names="snake"
    )
    assert result.renames[("gate", "Dense_0")] == ("gate", "dense_0")
    assert result.renames[("Gate_0",)] == ("gate_0",)


def test_bad_input_exits_2_in_one_line(user_module, tmp_path, capsys):
    module = user_module("port_ok", MLP)
    (tmp_path / "port_ok_nnx.py").write_text("# my own file\n")
    cases = [
        (("port", "no_such_module:MLP", "--inputs=float32[4,8]"), "cannot import no_such_module"),
        (("port", "port_ok:MLP", "--inputs=float32(4,8)"), "is not DTYPE[SHAPE]"),
        (("port", "port_ok:MLP"), "--inputs is required"),
        (("port", "port_ok:MLP", "--inputs=float32[4,8]", "--force"), "not written by migrate"),
        (
            ("port", "port_ok:MLP", "--inputs=float32[4,8]", "--out=o", "--call_kwargs=nope=1"),
            "does not run on",
        ),  # fmt: skip,
        (("port", "port_ok:MLP", "--inputs=float32[4,8]", "--fields_from=x"), "MODULE:FUNCTION"),
        (
            ("port", "port_ok:MLP(hidden=4)", "--inputs=float32[4,8]", "--fields_from=a:b"),
            "give one of them",
        ),
        (
            ("port", "port_ok:MLP", "--inputs=float32[4,8]", "--out=o", "--fields_from=os:getcwd"),
            "returned str, not a mapping",
        ),
        (
            ("port", "migrate.linen.layers:RMSNorm", "--inputs=float32[2,8]", "--out=o"),
            "missing 1 required positional argument: 'config' (give the fields",
        ),
    ]
    for args, message in cases:
        assert migrate(*args) == cli.EXIT_USAGE, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "port_ok_nnx.py").read_text() == "# my own file\n"
    assert not (tmp_path / "o").exists()
    from migrate.config.loading import load_config, resolve
    from migrate.linen import layers

    with pytest.raises(errors.BadInput, match="field config is not a literal the gate can write"):
        command.port(layers.RMSNorm(load_config(resolve("llama2-tiny"))), "float32[2,64]", "o")
    with pytest.raises(errors.BadInput, match="fields_from is given with a module instance"):
        command.port(module.MLP(), "float32[4,8]", "o", fields_from="os:environ")
