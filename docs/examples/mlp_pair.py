"""A logically partitioned MLP block in Linen and in NNX: the migration guide's example pair.

The classes are twins: the same parameter paths (`up/kernel`, `down/kernel`), the same logical
names, the same arithmetic. `RULES` maps the logical names onto a `('data', 'model')` mesh.

    >>> x = jax.numpy.ones((8, 4))
    >>> variables = LinenMLP(16).init(jax.random.key(0), x)
    >>> with nnx.use_eager_sharding(False):  # no mesh: create annotated Params anyway
    ...     block = NNXMLP(4, 16, rngs=nnx.Rngs(0))
    >>> LinenMLP(16).apply(variables, x).shape == block(x).shape
    True
"""

from __future__ import annotations

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh

from migrate.common import sharding

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("layers", "data"))
UP = ("embed", "mlp")  # logical names of the up-projection kernel
DOWN = ("mlp", "embed")
HIDDEN = ("batch", "mlp")  # logical names of the hidden activation
init = jax.nn.initializers.lecun_normal()


class LinenMLP(nn.Module):
    """`x + down(gelu(up(x)))`; the hidden activation constrained to `HIDDEN` on `mesh`."""

    hidden: int
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        up = nn.Dense(
            self.hidden,
            use_bias=False,
            kernel_init=nn.with_logical_partitioning(init, UP),
            name="up",
        )
        down = nn.Dense(
            x.shape[-1],
            use_bias=False,
            kernel_init=nn.with_logical_partitioning(init, DOWN),
            name="down",
        )
        h = jax.nn.gelu(up(x))
        h = nn.with_logical_constraint(h, HIDDEN, rules=RULES, mesh=self.mesh)  # keywords!
        return x + down(h)


class NNXMLP(nnx.Module):
    """The NNX twin of `LinenMLP`: attributes named like the Linen submodules."""

    def __init__(self, features: int, hidden: int, mesh: Mesh | None = None, *, rngs: nnx.Rngs):
        self.mesh = mesh
        self.up = nnx.Linear(
            features, hidden, use_bias=False, kernel_init=nnx.with_partitioning(init, UP), rngs=rngs
        )
        self.down = nnx.Linear(
            hidden,
            features,
            use_bias=False,
            kernel_init=nnx.with_partitioning(init, DOWN),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.gelu(self.up(x))
        if self.mesh is not None:  # Linen's constraint is a no-op without a mesh: match it
            h = sharding.constrain(h, HIDDEN, self.mesh, RULES)
        return x + self.down(h)
