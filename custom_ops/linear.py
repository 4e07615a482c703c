"""Projections behind an op: y = x @ W^T, with a decode fast path for a few rows.

At decode a projection is a GEMV (or a GEMM with a handful of rows) that should stream its weight at
memory bandwidth. MKL reaches about 17 GB/s on our CPUs for these shapes; the C++ kernel's few-row
loop (the one the routed experts use) about 28 GB/s. More rows go to ATen's GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


linear = define("linear(Tensor x, Tensor weight) -> Tensor", linear_reference,
                lambda x, weight: x.new_empty(x.shape[:-1] + (weight.shape[0],)))
