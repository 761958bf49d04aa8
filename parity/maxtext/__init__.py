"""The MaxText gate: MaxText's own Linen decoder (one release) against its NNX decoder (another),
each built and run by its release in a worker of its own environment (`parity.remote`)."""
