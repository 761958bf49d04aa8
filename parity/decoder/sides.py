"""The pipelined decoder twins of a config as the two `Side`s of a pair.

`LinenDecoderSide` and `NNXDecoderSide` adapt `migrate/linen` and `migrate/nnx` (through the
compiled-function caches of `parity.decoder.twins`) to the protocol the checks are written
against. The program a side exposes is its jitted train step (shardings pinned), lowered for
the weights given.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from migrate.checkpoints import convert
from migrate.common import dropout, optim
from migrate.common import sharding as sharding_lib
from migrate.config.contract import Config
from parity.analysis import compare
from parity.decoder import cost, drilldown, twins
from parity.engine import compiles
from parity.engine.side import DrillStage, ProgramArray, Run, Side, Trainer
from parity.module_pair.calls import Randomness, draw_keys
from parity.multiprocess import distributed

# The `random` check's forward runs of a decoder with dropout, each with a new key: every draw
# is compared exactly (the twins take the same keys), so a few show that the masks follow the key.
DROPOUT_DRAWS = 4
# The decoder's one stochastic call: its rows' keys reach both twins' Dropout modules raw.
DECODER_RANDOMNESS = Randomness(
    linen_streams=(), linen_arg="dropout_keys", nnx_arg="dropout_keys", draws=DROPOUT_DRAWS
)

# The train step's positional arguments and results, as labels name them.
STEP_PARTS = {
    "input": ("params", "opt_state", "batch"),
    "output": ("params", "opt_state", "metrics"),
}


class DecoderSide(Side):
    """What both twins' sides share: the config, mesh, batch, and compiled programs cached by
    the weights they were lowered for."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        batch: Any,
        use_pipeline: bool | None = None,
        bubble_fill: float = 0.0,
    ) -> None:
        self.cfg, self.mesh, self.batch = cfg, mesh, batch
        self.use_pipeline, self.bubble_fill = use_pipeline, bubble_fill
        self.tx = optim.make_optimizer(cfg)
        self._programs: dict[int, tuple[Any, Any, Any]] = {}
        self._init_optimizer: Any = None

    # The train step: (jitted step, jitted eval step) and the declared state shardings.
    def train_fns(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def state_shardings(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def step_params(self, weights: Any) -> Any:
        """The train step's parameter argument for `weights`."""
        return weights

    def lowered(self, weights: Any) -> jax.stages.Lowered:
        return self._program(weights)[1]

    def compiled(self, weights: Any) -> jax.stages.Compiled:
        """The train step compiled for `weights`: once per program (the compile check's
        abstract lowering of the same step is the same program, `compiles.compile_once`)."""
        held, lowered, compiled = self._program(weights)
        if compiled is None:
            compiled = compiles.compile_once(lowered)[0].executable
            self._programs[id(weights)] = (held, lowered, compiled)
        return compiled

    def any_lowered(self) -> jax.stages.Lowered | None:
        """The train step as lowered for some weights already (the same program for any
        weights: its shardings are pinned), or None."""
        return next((lowered for _, lowered, _ in self._programs.values()), None)

    def step_batch(self) -> Any:
        """What the train step is lowered for: the model's batch, or, where a step accumulates
        gradients over several, the shape of a step's batch (`train_batch_size` rows)."""
        if self.cfg.train_batch_size == self.cfg.global_batch_size:
            return self.batch
        return cost.abstract_batch(self.cfg, self.mesh)

    def _program(self, weights: Any) -> tuple[Any, Any, Any]:
        if id(weights) not in self._programs:
            params = self.step_params(weights)
            step, _ = self.train_fns()
            # A real optimizer state, not `jax.eval_shape`'s (which carries no shardings): a
            # step jitted without pinned shardings (tests/test_injected_bugs.py) must be
            # compiled for the arguments the train check will pass it.
            lowered = step.lower(params, self.optimizer_state(params), self.step_batch())
            self._programs[id(weights)] = (weights, lowered, None)  # holds weights: ids stay
        return self._programs[id(weights)]

    def trainer(self, weights: Any) -> Trainer:
        """The train step donates its state: every call starts from a fresh copy of the
        weights (and a new optimizer state), so that the pair's own weights, which every other
        check reads, are never the ones consumed."""
        params = twins.fresh_copy(self.step_params(weights))
        _, evaluate = self.train_fns()
        return Trainer(params, self.optimizer_state(params), self.compiled(weights), evaluate)

    def optimizer_state(self, params: Any) -> Any:
        """A new optimizer state for `params`, placed as the train step declares it, in one
        program (eagerly, each moment's zeros compiled a program per shape and sharding)."""
        if self._init_optimizer is None:
            self._init_optimizer = jax.jit(self.tx.init, out_shardings=self.state_shardings()[1])
        return self._init_optimizer(params)

    def program_shardings(self, compiled: jax.stages.Compiled) -> dict[str, ProgramArray]:
        """Per array of the train step's inputs and outputs: its compiled sharding and the one
        declared (one per box, Variable or batch, broadcast over the step's leaves)."""
        params, opt_state = self.state_shardings()
        replicated = NamedSharding(self.mesh, PartitionSpec())
        batch = sharding_lib.batch_sharding(self.cfg, self.mesh)
        declared = {"input": (params, opt_state, batch), "output": (params, opt_state, replicated)}
        leaves = {}
        for io in ("input", "output"):
            if io == "input":
                actual, avals = compiled.input_shardings[0], compiled.args_info[0]
            else:
                actual, avals = compiled.output_shardings, compiled.out_info
            expected = jax.tree.map(
                lambda d, sub: jax.tree.map(lambda _: d, sub), declared[io], actual
            )
            flat_actual, _ = jax.tree_util.tree_flatten_with_path(actual)
            for (path, a), d, aval in zip(
                flat_actual, jax.tree.leaves(expected), jax.tree.leaves(avals), strict=True
            ):
                part, rest = STEP_PARTS[io][path[0].idx], compare.path_str(path[1:])
                name = "/".join(p for p in (part, rest) if p).removesuffix("/value")
                leaves[f"train step {io}: {name}"] = (a, len(aval.shape), d)
        return leaves

    def run_with(self, weights: Any, dropout_key: Any) -> Run:
        """`run`, dropping with the rows' keys of `dropout_key` (`twins.forward_keys`)."""
        raise NotImplementedError

    def run(self, weights: Any) -> Run:
        return self.run_with(weights, None)

    def stochastic_calls(self) -> dict[int, tuple[str, Any]]:
        """With dropout on, the decoder's forward (`DECODER_RANDOMNESS`)."""
        return {0: ("decoder", DECODER_RANDOMNESS)} if dropout.active(self.cfg) else {}

    def draws(self, weights: Any, index: int) -> Any:
        """The logits of `DROPOUT_DRAWS` forward runs, each with its draw's key."""
        keys = draw_keys(self.cfg.seed, index, DROPOUT_DRAWS)
        logits = [self.run_with(weights, key).outputs for key in keys]
        return {"outputs": jax.tree.map(lambda *x: np.stack(x), *logits), "sites": {}}

    def drill_stages(self, weights: Any) -> list[DrillStage]:
        common = distributed.to_host(self.to_common(weights))
        return drilldown.stages(self.framework, self.cfg, self.mesh, weights, common, self.batch)


class LinenDecoderSide(DecoderSide):
    """The Linen twin: boxed `{'params': ...}` variables are both native and common form."""

    framework = "linen"

    def own_weights(self) -> Any:
        return twins.linen_initial_variables(self.cfg, self.mesh, self.use_pipeline)

    def to_common(self, weights: Any) -> dict[str, Any]:
        return weights

    def from_common(self, variables: dict[str, Any]) -> Any:
        target = twins.linen_abstract_variables(self.cfg, self.mesh, self.use_pipeline)
        return convert.check_linen(variables, target)

    def plain(self, tree: Any) -> Any:
        return distributed.to_host(nn.meta.unbox(tree))

    def step_params(self, weights: Any) -> Any:
        return weights["params"]

    def run_with(self, weights: Any, dropout_key: Any) -> Run:
        cfg, batch = self.cfg, self.batch
        return twins.run_linen(
            cfg, self.mesh, weights, batch, self.use_pipeline, self.bubble_fill, dropout_key
        )

    def train_fns(self) -> tuple[Any, Any]:
        return twins.linen_train_fns(self.cfg, self.mesh)

    def state_shardings(self) -> tuple[Any, Any]:
        return twins.linen_train_shardings(self.cfg, self.mesh)


class NNXDecoderSide(DecoderSide):
    """The NNX twin: the Param `nnx.State`, moved to and from Linen's variables by the strict
    converters."""

    framework = "nnx"

    def own_weights(self) -> Any:
        return twins.nnx_initial_state(self.cfg, self.mesh, self.use_pipeline)

    def to_common(self, weights: Any) -> dict[str, Any]:
        return convert.nnx_to_linen(weights)

    def from_common(self, variables: dict[str, Any]) -> Any:
        return twins.linen_to_nnx_params(self.cfg, self.mesh, variables, self.use_pipeline)

    def plain(self, tree: Any) -> Any:
        tree = jax.tree.map(
            lambda x: nnx.to_pure_dict(x) if isinstance(x, nnx.State) else x,
            tree,
            is_leaf=lambda x: isinstance(x, nnx.State),
        )
        return distributed.to_host(nn.meta.unbox(tree))

    def run_with(self, weights: Any, dropout_key: Any) -> Run:
        cfg, batch = self.cfg, self.batch
        return twins.run_nnx(
            cfg, self.mesh, weights, batch, self.use_pipeline, self.bubble_fill, dropout_key
        )

    def train_fns(self) -> tuple[Any, Any]:
        return twins.nnx_train_fns(self.cfg, self.mesh)

    def state_shardings(self) -> tuple[Any, Any]:
        return twins.nnx_train_shardings(self.cfg, self.mesh)
