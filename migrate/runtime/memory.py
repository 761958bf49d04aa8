"""A lower bound of the memory a run needs, from the config alone (no JAX), checked against the
memory this machine has before any weight is allocated.

The bound counts only what certainly exists at once, each array once (no replication):

- `parameters`: every weight of the decoder (embedding, per layer attention q/k/v/out, MLP
  wi_0/wi_1/wo, or those of every expert and the router, and two norms, final norm, logits
  kernel unless tied) in `weight_dtype`;
- `optimizer`: AdamW's two moments (the parameters' dtype, as optax keeps them);
- `gradients`: one gradient per parameter;
- `activations`: the float32 logits of one step and the embedded tokens, and one layer's
  float32 attention scores and MLP activations (every expert's: the MoE block is dense) for the
  rows it runs at once (the pipeline: a
  microbatch in each of the S stages; otherwise the whole batch).

`parity` holds both twins at once (`copies=2`); a checkpoint command one state (`copies=1`,
2 with `--verify`). Measured, the harness holds far more than this bound (weights replicated
over mesh axes, cached runs, host copies): 88 x the parameter bytes at the peak of a default
`parity` run with 8 simulated devices (docs/performance.md, "Memory gate"). A config refused
by the bound can therefore never fit; one that passes it may still run out of memory, which
is then reported as exit 2 (`migrate.errors`).
"""

from __future__ import annotations

import dataclasses

import psutil

from migrate.config.contract import Config
from migrate.errors import BadInput

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class OutOfMemory(BadInput):
    """A config whose lower-bound memory exceeds what this machine has."""


def parameter_count(cfg: Config) -> int:
    """Weights of the decoder; the same for every layout (the pipeline stacks the N layers)."""
    e, f, n, v = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.base_num_decoder_layers, cfg.vocab_size
    attention = e * cfg.head_dim * (2 * cfg.base_num_query_heads + 2 * cfg.base_num_kv_heads)
    # wi_0, wi_1, wo once per expert (E=1: the dense MLP), plus the router's [e, E] kernel
    experts = cfg.num_experts
    mlp = experts * 3 * e * f + (e * experts if experts > 1 else 0)
    per_layer = attention + mlp + 2 * e  # q, o; k, v; the MLP or experts; two norms
    tables = 1 if cfg.logits_via_embedding else 2  # embedding (and an untied logits kernel)
    return tables * v * e + e + n * per_layer  # tables, final norm, layers


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, summed over the mesh (each array once)."""

    parameters: int
    optimizer: int
    gradients: int
    activations: int
    copies: int  # models held at once

    @property
    def total(self) -> int:
        return self.copies * (self.parameters + self.optimizer + self.gradients) + self.activations

    def describe(self) -> str:
        twins = f"{self.copies} x " if self.copies > 1 else ""
        return (
            f"at least {gib(self.total)}: {twins}(parameters {gib(self.parameters)} + AdamW "
            f"moments {gib(self.optimizer)} + gradients {gib(self.gradients)}) + activations "
            f"{gib(self.activations)}"
        )


def gib(count: float) -> str:
    return f"{count / 2**30:,.2f} GiB"


def estimate(cfg: Config, copies: int = 2, gradients: bool = True) -> MemoryEstimate:
    """The lower bound for `cfg` with `copies` models (parameters + optimizer state) at once."""
    parameters = parameter_count(cfg) * DTYPE_BYTES[cfg.weight_dtype]
    length, act_bytes = cfg.max_target_length, DTYPE_BYTES[cfg.dtype]
    tokens = cfg.global_batch_size * length
    rows = cfg.microbatch_size * cfg.num_stages if cfg.using_pipeline else cfg.global_batch_size
    one_layer = (
        rows
        * length
        * (4 * cfg.base_num_query_heads * length + act_bytes * cfg.base_mlp_dim * cfg.num_experts)
    )
    batch = 2 * 4 * cfg.train_batch_size * length  # a train step's int32 inputs and targets
    activations = tokens * (4 * cfg.vocab_size + act_bytes * cfg.base_emb_dim) + one_layer + batch
    return MemoryEstimate(
        parameters=parameters,
        optimizer=2 * parameters,
        gradients=parameters if gradients else 0,
        activations=activations if gradients else 0,
        copies=copies,
    )


def available_bytes() -> int:
    """Memory this process can still get: available RAM plus free swap."""
    return int(psutil.virtual_memory().available + psutil.swap_memory().free)


def check_fits(needed: MemoryEstimate, share: float = 1.0, what: str = "the run") -> None:
    """Raise OutOfMemory when `share` of `needed` (this process's part of the mesh) exceeds the
    memory available now, with the estimate in the message."""
    have = available_bytes()
    if needed.total * share > have:
        part = f" ({share:.0%} of it in this process)" if share < 1 else ""
        raise OutOfMemory(
            f"{what} needs {needed.describe()}{part}, but {gib(have)} of memory is available; "
            "use smaller sizes (or pass --nomemory_check to try anyway)"
        )
