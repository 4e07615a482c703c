"""Projections behind an op: y = x @ W^T, with a decode fast path for a few rows.

At decode a projection is a GEMV (or a GEMM with a handful of rows) that should stream its weight at
memory bandwidth, which MKL's small-M GEMMs do not; on CPU the C++ kernel's few-row loop (the one the
routed experts use) takes those, and more rows go to ATen's GEMM. On CUDA it is cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


linear = define("linear(Tensor x, Tensor weight) -> Tensor",
                fake=lambda x, weight: x.new_empty(x.shape[:-1] + (weight.shape[0],)), reference=linear_reference,
                cuda=linear_reference)
