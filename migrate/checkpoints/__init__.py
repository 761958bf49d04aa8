"""Weights and checkpoints between Linen and NNX and between layouts: trees (convert), training
states, the Orbax format, re-staging, validated meta, safe destinations, the checkpoint
commands' work."""
