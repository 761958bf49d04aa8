"""Run in MaxText 0.2.5's environment: where its remat policies place each checkpoint name.

    python tests/maxtext_remat_policies.py '<json: [[policy, {tensor: place}], ...]>' NAMES_JSON

Prints JSON `{policy: {"layer": {name: place}, "iteration": {name: place} | "error text"}}`
with place one of remat, device, offload: MaxText's own `get_remat_policy` (its NNX decoder)
and `get_pipeline_remat_policy` (its pipeline), called on a stand-in holding the config keys
they read, each returned policy asked about a `checkpoint_name` primitive of every name.
"""

from __future__ import annotations

import functools
import json
import sys
import types

from jax._src.ad_checkpoint import name_p
from jax._src.interpreters import partial_eval


def placement(policy, name: str) -> str:
    """Where `policy` puts a tensor tagged `name` (None: `jax.checkpoint`'s default)."""
    if policy is None:
        return "remat"
    decision = policy(name_p, name=name)
    if isinstance(decision, partial_eval.Offloadable):
        return "offload"
    return "device" if decision is True or decision is partial_eval.Saveable else "remat"


def main() -> None:
    from maxtext.layers import nnx_decoders, pipeline

    cases, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {}
    for policy_name, places in cases:
        cfg = types.SimpleNamespace(
            remat_policy=policy_name,
            scan_layers=False,
            tensors_on_device=[t for t, p in places.items() if p == "device"],
            tensors_to_offload=[t for t, p in places.items() if p == "offload"],
        )
        decoder = types.SimpleNamespace(config=cfg)
        decoder.minimal_policy = functools.partial(nnx_decoders.NNXDecoder.minimal_policy, decoder)
        layer = nnx_decoders.NNXDecoder.get_remat_policy(decoder)
        stage = types.SimpleNamespace(config=cfg, remat_policy=layer)
        iteration = pipeline.PipelineBase.get_pipeline_remat_policy(stage)
        result = {"layer": {n: placement(layer, n) for n in names}}
        try:
            result["iteration"] = {n: placement(iteration, n) for n in names}
        except ValueError as error:  # raised when the policy is asked, as in a real trace
            result["iteration"] = f"ValueError: {error}"
        out[policy_name] = result
    print(json.dumps(out))


if __name__ == "__main__":
    main()
