"""MaxText's training state in its two forms, as data: the Linen on-disk layout that both 0.2.3
and 0.2.5 write (`{step, params: {params: ...}, opt_state: {0: {count, mu: {params: ...}, nu},
1: None, 2: {count}}}`) and the `TrainStateNNX` that 0.2.5 restores it into (`{model: ...,
optimizer: {step, opt_state: {0: {count, mu, nu}, 2: {count}}}}`, plus the model's RNG state).

`NNX_TO_LINEN` maps the restored NNX state's leaves onto the Linen layout's paths, strictly
(`WeightMap`); `NNX_ONLY` are the leaves the Linen layout has no place for (the RNG streams'
keys and counts: 0.2.5 writes them under `nnx_aux`, 0.2.3 knows none). `STEP_DTYPES` is the one
declared dtype difference. No JAX.
"""

from __future__ import annotations

from migrate.checkpoints.weight_map import Entry, WeightMap, match

NNX_TO_LINEN = WeightMap(
    "maxtext TrainStateNNX -> Linen checkpoint layout",
    (
        Entry("model/{path...}", "params/params/{path...}", note="weights under params/params"),
        Entry("optimizer/step", "step", note="uint32 in NNX, int32 in Linen"),
        Entry("optimizer/opt_state/{i}/count", "opt_state/{i}/count"),
        Entry(
            "optimizer/opt_state/{i}/mu/{path...}",
            "opt_state/{i}/mu/params/{path...}",
            note="Linen's moments are wrapped in the params collection",
        ),
        Entry(
            "optimizer/opt_state/{i}/nu/{path...}",
            "opt_state/{i}/nu/params/{path...}",
            note="Linen's moments are wrapped in the params collection",
        ),
    ),
)
NNX_ONLY = ("model/{path...}/rngs/{stream}/{part}",)  # RNG state: no place in the Linen layout
STEP_DTYPES = {"linen": "int32", "nnx": "uint32"}  # the step counter's dtype in each form


def nnx_only(path: tuple[str, ...]) -> bool:
    """A leaf of the NNX state that the Linen layout does not hold (declared, reported)."""
    return any(match(pattern, path) is not None for pattern in NNX_ONLY)


def leaf_kind(linen_path: tuple[str, ...]) -> str:
    """A Linen-layout path's kind, for the cross-release table: params, mu, nu, count, step."""
    if linen_path == ("step",):
        return "step"
    if linen_path[0] == "params":
        return "params"
    return linen_path[2] if len(linen_path) > 2 and linen_path[2] in ("mu", "nu") else "count"
