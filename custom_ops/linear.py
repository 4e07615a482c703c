"""Projections behind an op: y = x @ W^T, with a decode fast path for a few rows.

At decode a projection is a GEMV (or a GEMM with a handful of rows) that should stream its weight at
memory bandwidth, which MKL's small-M GEMMs do not; on CPU the C++ kernel's few-row loop (the one the
routed experts use) takes those, and more rows go to ATen's GEMM. On CUDA it is cuBLAS.

`linear_int8` is the same projection over a weight-only quantized W: int8 values q [O, H] and one
fp32 scale per output row, W = q * scale. The few-row kernels read q as it is (a quarter of fp32's
bytes) and scale each output once; many rows dequantize W and take the GEMM. On CUDA a Triton kernel
(`gpu/linear.py`) widens q tile by tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define, gpu_kernel


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


linear = define("linear(Tensor x, Tensor weight) -> Tensor",
                fake=lambda x, weight: x.new_empty(x.shape[:-1] + (weight.shape[0],)), reference=linear_reference,
                cuda=linear_reference)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an int8 weight stands for: q * scale per row (in fp32), then cast to `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def linear_int8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize(weight, scale, x.dtype))


linear_int8 = define("linear_int8(Tensor x, Tensor weight, Tensor scale) -> Tensor",
                     fake=lambda x, weight, scale: x.new_empty(x.shape[:-1] + (weight.shape[0],)),
                     reference=linear_int8_reference, cuda=gpu_kernel("linear", "linear_int8"))
