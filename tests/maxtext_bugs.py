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


def dropped_query_scale() -> None:
    """The query kernels initialised without MaxText's folded `1/sqrt(head_dim)` (the scale
    dropped: every query kernel `sqrt(head_dim)` times too large)."""

    def change(model) -> None:
        from flax import nnx

        for path, node in nnx.iter_graph(model):
            tail = tuple(str(p) for p in path[-3:])
            if isinstance(node, nnx.Param) and tail == ("self_attention", "query", "kernel"):
                value = node.get_value()
                node.set_value(value * value.shape[-1] ** 0.5)

    _wrap_from_config(change)


def saved_everything_in_the_pipeline() -> None:
    """The pipeline iterations' remat policy changed to save every intermediate (a port that
    dropped `remat_policy` and its `iteration_input` names): the same numbers, more memory."""
    import jax
    from maxtext.layers import pipeline

    pipeline.PipelineBase.get_pipeline_remat_policy = lambda self: (
        jax.checkpoint_policies.everything_saveable
    )


def reversed_stage_order() -> None:
    """Stage s runs the layers of stage S-1-s (the stage axis of the pipeline's weights read
    backwards)."""
    import jax
    import jax.numpy as jnp
    from maxtext.layers import pipeline

    original = pipeline.NNXPipeline.get_current_stage_weights

    def get_current_stage_weights(self, *args, **kwargs):
        weights = original(self, *args, **kwargs)
        return jax.tree.map(lambda w: jnp.flip(w, 0) if getattr(w, "ndim", 0) else w, weights)

    pipeline.NNXPipeline.get_current_stage_weights = get_current_stage_weights


def pipeline_reads_a_missing_key() -> None:
    """The NNX release's pipeline built from a config without `num_pipeline_microbatches`:
    MaxText's own code raises (AttributeError) where it reads the key, as the side builds."""
    from maxtext.utils import model_creation_utils

    original = model_creation_utils.from_config

    class Without:
        def __init__(self, config) -> None:
            object.__setattr__(self, "_config", config)

        def __getattr__(self, name: str):
            if name == "num_pipeline_microbatches":
                raise AttributeError(f"the config has no {name}")
            return getattr(self._config, name)

    def from_config(config, *args, **kwargs):
        return original(Without(config), *args, **kwargs)

    model_creation_utils.from_config = from_config
