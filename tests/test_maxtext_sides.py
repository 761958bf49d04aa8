"""A MaxText side on the wrong release is refused: the Linen side must build a pure Linen
decoder (0.2.5's `TransformerLinen` is a `ToLinen` over its NNX model), the NNX side an NNX one
(0.2.3's `Transformer` holds its Linen decoder in a `ToNNX`). Either way the run exits 2 with one
line saying which release built what, before any check
(`parity.maxtext.decoder_factory.WrongRelease`)."""

from __future__ import annotations

import pytest
from test_maxtext import gate, needs_envs

from migrate import errors
from parity.maxtext import gate_config

pytestmark = pytest.mark.slow


@needs_envs
@pytest.mark.parametrize(
    ("side", "release", "message"),
    [
        (
            "linen",
            "nnx",
            "the Linen side (maxtext 0.2.5) builds a decoder with NNX modules inside "
            "(TransformerLinen is a ToLinen): run the Linen side on a release whose decoder is "
            "Linen (0.2.3)",
        ),
        (
            "nnx",
            "linen",
            "the NNX side (maxtext 0.2.3) builds a decoder with Linen modules inside (ToNNX at "
            "decoder): run the NNX side on a release whose decoder is NNX (0.2.5)",
        ),
    ],
)
def test_a_side_on_the_other_release_is_bad_input(side, release, message, tmp_path):
    python = gate_config.default_python(release)
    status, report, err = gate(tmp_path, "pp4.yml", "--checks=init", f"--{side}_python={python}")
    assert status == errors.EXIT_USAGE, err[-3000:]
    assert f"parity: error: {message}\n" in err, err[-3000:]
    assert "Traceback" not in err and report == {}
