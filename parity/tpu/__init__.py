"""TPU programs compiled from this CPU host: MaxText's topology names (`topologies`, no JAX),
libtpu's compile-only devices and the config's mesh laid on them (`compile_devices`), and the twins'
train steps compiled for a slice, with the compiler's own verdict on HBM (`compile`).
"""
