"""The pipelined decoder as the engine's first client: its twins as Sides, its data, and the
checks that need its config (pipeline vs reference, bubbles, compiled cost, efficiency)."""
