"""The memory lower bound: an exact parameter count, and the gate's message."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import pytest
from conftest import CONFIG_DIR, TINY_CONFIGS, tiny

from migrate.checkpoints import train_state
from migrate.common import sharding
from migrate.config.loading import load_config
from migrate.runtime import memory
from parity.decoder import twins

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)


def traced_parameters(cfg) -> int:
    variables = twins.linen_abstract_variables(cfg, sharding.make_mesh(cfg))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(variables)))


@pytest.mark.parametrize("name", [*TINY_CONFIGS, "llama2-tiny-tied", "mixtral-tiny"])
def test_parameter_count_is_the_traced_models_in_either_layout(name):
    cfg = tiny(name)
    assert memory.parameter_count(cfg) == traced_parameters(cfg)  # pipeline layout
    assert memory.parameter_count(cfg) == traced_parameters(train_state.reference_config(cfg))


def test_llama2_7b_has_its_published_parameter_count():
    assert memory.parameter_count(load_config(CONFIG_DIR / "llama2-7b.yml")) == 6_738_415_616


def test_mixtral_8x7b_has_its_published_parameter_count():
    """Every expert's wi_0, wi_1, wo and the router counted (Mixtral-8x7B: 46.7B)."""
    assert memory.parameter_count(load_config(CONFIG_DIR / "mixtral-8x7b.yml")) == 46_702_792_704


def test_the_estimate_adds_up_and_the_gate_names_it(monkeypatch):
    cfg = tiny("llama2-tiny")
    needed = memory.estimate(cfg, copies=2)
    assert needed.parameters == memory.parameter_count(cfg) * 4
    assert needed.optimizer == 2 * needed.parameters == 2 * needed.gradients
    assert needed.total == 2 * 4 * needed.parameters + needed.activations
    assert memory.estimate(cfg, copies=1, gradients=False).total == 3 * needed.parameters
    monkeypatch.setattr(memory, "available_bytes", lambda: needed.total - 1)
    with pytest.raises(memory.OutOfMemory, match=r"needs at least .* GiB: 2 x \(parameters"):
        memory.check_fits(needed)
    memory.check_fits(needed, share=0.5)  # half of it in this process: fits
