"""Private parts of the simulator: the storage tracker, the fake training step, CUDA allocator rules, FLOPs."""
