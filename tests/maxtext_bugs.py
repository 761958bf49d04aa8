"""Bugs injected into MaxText's NNX release at run time, in its worker (never in the installed
package): each wraps `model_creation_utils.from_config`, so only the model it builds changes.
Imported by the worker in the MaxText environment (no pytest there)."""

from __future__ import annotations


def _wrap_from_config(change) -> None:
    from maxtext.utils import model_creation_utils

    original = model_creation_utils.from_config

    def from_config(*args, **kwargs):
        model = original(*args, **kwargs)
        change(model)
        return model

    model_creation_utils.from_config = from_config


def wrong_norm_axis_name() -> None:
    """The final norm's scale annotated ('embed',) instead of ('norm',)."""

    def change(model) -> None:
        scale = model.decoder.decoder_norm.scale
        key = "out_sharding" if "out_sharding" in scale.get_metadata() else "sharding"
        scale.set_metadata(key, ("embed",))

    _wrap_from_config(change)


def scaled_logits() -> None:
    """The decoder's logits multiplied by 1.001 (a port that changed the output head)."""

    def change(model) -> None:
        decoder_call = type(model.decoder).__call__

        def call(self, *args, **kwargs):
            out = decoder_call(self, *args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] * 1.001, *out[1:])
            return out * 1.001

        type(model.decoder).__call__ = call

    _wrap_from_config(change)
