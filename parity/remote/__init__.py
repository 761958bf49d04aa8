"""A Side in another Python environment: a worker process started with another interpreter (or
another checkout), control as JSON lines, arrays through `.npy` files, every call bounded in
time. The engine's checks take a `RemoteSide` like any other and never know the difference."""
