"""Static addresses for the compiler: the one mark both the state pool and the step buffers put on the
tensors a compiled step reads in place (a leaf: it imports nothing of the project)."""

from __future__ import annotations

import torch


def mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """Tells Dynamo (and so CUDA graphs) that the tensor lives at one address for good: a graph reads it
    in place instead of copying it into a graph-owned input at every replay."""
    torch._dynamo.mark_static_address(tensor, guard=False)
    return tensor
