"""Logical axis names: declared once per parameter and activation, read by both twins."""

from __future__ import annotations

# Parameters (docs/pipeline.md, "Logical names").
EMBEDDING = ("vocab", "embed")
NORM_SCALE = ("norm",)
QUERY = ("embed", "q_heads", "kv")
KEY = ("embed", "kv_heads", "kv_head_dim")
VALUE = ("embed", "kv_heads", "kv_head_dim")
ATTENTION_OUT = ("heads", "kv", "embed")
MLP_IN = ("embed", "mlp")
MLP_OUT = ("mlp", "embed")
LOGITS_KERNEL = ("embed", "vocab")
# Mixture of experts (MaxText's names): the router is replicated over experts; expert weights
# carry their expert dim as `exp` and their embed dim as `embed_no_exp`.
ROUTER = ("embed", None)
EXPERT_MLP_IN = ("exp", "embed_no_exp", "mlp")
EXPERT_MLP_OUT = ("exp", "mlp", "embed_no_exp")

# Stacked-layer axes, prepended to a layer's parameter names.
REFERENCE_LAYERS = "layers"  # the non-pipelined decoder: all layers on one axis
STAGE = "layers"  # the pipeline's stage axis (mapped to the `stage` mesh axis by the rules)
CIRCULAR_REPEATS = "circular_repeats"
LAYERS_PER_STAGE = "layers_per_stage"
# The layers after a pipelined subset (`pipeline_parallel_layers`): they run on every stage, on
# the batch split over stages too, so their stacked axis is replicated (a remainder such as 5
# does not divide the stage axis, and a layer sharded over stages would be gathered per use).
LAYERS_AFTER_PIPELINE = "layers_after_pipeline"

# Activations (and token batches, `[B, T]`).
BATCH_LENGTH = ("activation_batch", "activation_length")
BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
BATCH_LENGTH_HEADS_KV = (
    "activation_batch",
    "activation_length",
    "activation_heads",
    "activation_kv",
)
BATCH_LENGTH_KV_HEADS_KV = (
    "activation_batch",
    "activation_length",
    "activation_kv_heads",
    "activation_kv",
)
BATCH_LENGTH_MLP = ("activation_batch", "activation_length", "activation_mlp")
# Inside a MoE block the tokens leave the `expert` axis (`activation_batch_no_exp`) so that it
# can split the experts (`activation_exp`): each expert shard computes its experts for its tokens.
BATCH_NO_EXP_LENGTH_EMBED = ("activation_batch_no_exp", "activation_length", "activation_embed")
BATCH_NO_EXP_LENGTH_EXP_MLP = (
    "activation_batch_no_exp",
    "activation_length",
    "activation_exp",
    "activation_mlp",
)
PER_STAGE = ("activation_stage",)  # one value per stage (its summed load-balancing loss)
STAGE_BATCH_LENGTH_EMBED = ("activation_stage", *BATCH_LENGTH_EMBED)
# The embedding's rows as the lookup hands them on: split over the batch axes, `embed` whole.
EMBEDDING_ROWS = ("activation_batch", "activation_length", None)
MICROBATCH_BATCH_LENGTH_EMBED = (None, *BATCH_LENGTH_EMBED)
STAGE_MICROBATCH_BATCH_LENGTH_EMBED = ("activation_stage", *MICROBATCH_BATCH_LENGTH_EMBED)
# The non-pipelined part (embedding, final norm, logits head, loss) runs on a batch of its own
# name (MaxText's), split over the stage axis too, so that the stages do not all compute it.
LOGITS_BATCH_LENGTH_EMBED = (
    "activation_embed_and_logits_batch",
    "activation_length",
    "activation_embed",
)
# The logits head's input: `embed` whole (gathered over tensor), so that the head's kernel is
# used as stored (`vocab` over tensor): with `embed` split over tensor on both operands XLA's
# partitioner replicates the kernel instead (docs/performance.md, "No involuntary
# rematerialisation").
LOGITS_HEAD_INPUT = ("activation_embed_and_logits_batch", "activation_length", None)
LOGITS_BATCH_LENGTH_VOCAB = (
    "activation_embed_and_logits_batch",
    "activation_length",
    "activation_vocab",
)
# Named scopes of the reshards between the two batch splits, on their sharding constraints in
# the lowered program. XLA does not keep these names on the collectives it derives from them:
# the compile check counts those by where they run (outside the loops, across stages:
# `parity.analysis.hlo.outside_loops`).
INTO_PIPELINE = "reshard_into_pipeline"
OUT_OF_PIPELINE = "reshard_out_of_pipeline"

# Remat checkpoint names (docs/pipeline.md, "Remat").
ITERATION_INPUT = "iteration_input"
DECODER_LAYER_INPUT = "decoder_layer_input"

# Every logical name the decoder gives a parameter or an activation dimension (the tuples above
# and the stacked-layer axes). A rule for any other name resolves nothing: a misspelled rule
# (`embd`) would leave every `embed` dimension replicated and the run would pass, so the config
# refuses it (`migrate.config.rules`).
LOGICAL_NAMES: frozenset[str] = frozenset(
    name
    for value in list(globals().values())
    if isinstance(value, tuple)
    for name in value
    if isinstance(name, str)
) | {REFERENCE_LAYERS, STAGE, CIRCULAR_REPEATS, LAYERS_PER_STAGE, LAYERS_AFTER_PIPELINE}
