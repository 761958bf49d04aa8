"""Multi-process runs: the launcher, JAX's distributed runtime on 127.0.0.1, the coordinator's
checks."""
