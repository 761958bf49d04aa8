"""Flax's errors for a call that does not fit an NNX module (a mode flag no one set, random
numbers no one supplied, a cache never made), each turned into a one-line hint naming the
`Call` or `Randomness` option that supplies what is missing. A call that raises one of these
is bad input (exit 2), not a parity failure: the port was never compared."""

from __future__ import annotations

import re

# "No `decode` argument was provided to MultiHeadAttention as either a __call__ argument, ..."
MODE = re.compile(r"No `(\w+)` argument was provided to (\w+)")
NO_RNGS = re.compile(r"`deterministic` is False, but no `rngs` argument was provided to (\w+)")
NO_CACHE = "cache not initialized"
NOT_CALLABLE_KEY = re.compile(r"'\w*(Tracer|Array)' object (is not callable|has no attribute)")


def nnx_hint(error: BaseException, nnx_arg: str | None) -> str | None:
    """A one-line hint for an NNX module's error raised by a call that does not fit it, or
    None (`nnx_arg`: the keyword argument the call passes the NNX module its key in)."""
    text = " ".join(str(error).split())
    if found := NO_RNGS.search(text):
        return (
            f"hint: {found.group(1)} draws random numbers and has no `rngs`: give the module "
            "an nnx.Rngs stream at construction (rngs=nnx.Rngs(dropout=0)), or pass one per "
            "call with Randomness(nnx_arg='rngs', nnx_arg_as='rngs'), or switch it off with "
            "Call(nnx_attributes={'deterministic': True})"
        )
    if found := MODE.search(text):
        flag, module = found.groups()
        return (
            f"hint: {module} needs `{flag}`: set it for this call with "
            f"Call(nnx_attributes={{{flag!r}: ...}}) (or Call(nnx={{{flag!r}: ...}}) where "
            "the NNX module takes it as an argument)"
        )
    if NO_CACHE in text:
        return (
            "hint: the NNX module decodes but has no cache: call its `init_cache(input_shape)` "
            "before compare_modules (Linen makes its cache in `init`)"
        )
    if nnx_arg is not None and NOT_CALLABLE_KEY.search(text):
        return (
            f"hint: the NNX module calls what it gets as `{nnx_arg}` (an nnx.Rngs), but the "
            f"call passes a raw key: use Randomness(nnx_arg={nnx_arg!r}, nnx_arg_as='rngs')"
        )
    return None
