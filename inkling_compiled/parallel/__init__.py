"""Tensor and expert parallelism: one rank's shard of the model (`group`) and the ranks' runtime
(`runtime`: spawning or joining them, sending each step, stopping them)."""
