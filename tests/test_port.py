"""`migrate port`: Linen modules written as NNX ports that pass their own gate with no edit,
the weight map (identity, or renames), stubs for what it cannot translate, the generated
pytest file, and bad input refused in one line (exit 2)."""

from __future__ import annotations

import json
import textwrap

import pytest
from test_migrate_cli import migrate

from migrate import cli
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


class Gate(nn.Module):  # a user's own Linen layer: not translated in this step
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.sigmoid(nn.Dense(self.features)(x)) * x


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="proj")(x)
        x = Gate(4, name="gate")(x)
        return nn.Dense(2, name="out")(x)
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


def test_an_untranslated_submodule_is_a_bridged_stub_and_the_rest_passes(user_module, tmp_path):
    module = user_module("port_bridged", BRIDGED)
    result = command.port(module.Block, "float32[3,5]", tmp_path)
    assert [str(s) for s in result.stubs] == [
        "line 17: Gate(...) (not a layer `migrate port` translates yet): bridged through "
        "nnx.bridge.ToNNX; port it by hand"
    ]
    code = result.nnx_path.read_text()
    assert "self.gate = nnx.bridge.ToNNX(Gate(4), rngs=rngs)" in code
    assert "# migrate port: STUB (Linen line 17)" in code
    assert "from port_bridged import Gate" in code
    assert result.status == 0, result.gate.report


def test_bad_input_exits_2_in_one_line(user_module, tmp_path, capsys):
    user_module("port_ok", MLP)
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
    ]
    for args, message in cases:
        assert migrate(*args) == cli.EXIT_USAGE, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "port_ok_nnx.py").read_text() == "# my own file\n"
    assert not (tmp_path / "o").exists()
