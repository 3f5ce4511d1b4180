"""GPUs and sizing: the hardware catalogue, memory and cost models, the engine each pool gets and its arguments,
replicas, and the host memory of the Jobs."""
