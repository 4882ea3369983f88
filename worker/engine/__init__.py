"""The step: the runner, sampling, constraints, guards, memory budget and CUDA graphs."""
