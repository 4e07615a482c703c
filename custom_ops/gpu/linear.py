"""Weight-only int8 projection on CUDA: y = x @ (q * scale)^T, q [O, H] int8 read tile by tile and
widened in registers (never a dequantized copy in memory), each output scaled once after its sum.

The grid is a function of the shapes only: capturable. fp32 activations use exact ("ieee") products;
bf16 ones go to the tensor cores with q widened to bf16 (every int8 value is exact in bf16).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BM, BN, BK = 16, 64, 64
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # see moe.py: upcast bf16 under the interpreter


@triton.jit
def _linear_int8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, sx, sw_n, sw_k, sy,
                        UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    m = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    n = (pn * BN + tl.arange(0, BN)).to(tl.int64)  # offsets past 2**31 elements: a vocabulary-wide lm_head
    mm, nm = m < M, n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = (k0 + tl.arange(0, BK)).to(tl.int64)
        km = kk < K
        xa = tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * sw_n + kk[:, None] * sw_k, mask=nm[None, :] & km[:, None], other=0)
        if UPCAST:
            acc += tl.dot(xa.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xa, w.to(xa.dtype))
    scale = tl.load(s_ptr + n, mask=nm, other=0.0)
    tl.store(y_ptr + m[:, None] * sy + n[None, :], (acc * scale[None, :]).to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def linear_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Signature and result of `linear.linear_int8_reference`."""
    (O, H), lead = weight.shape, x.shape[:-1]
    rows = x.reshape(-1, H)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    y = torch.empty(M, O, dtype=x.dtype, device=x.device)
    if M:
        upcast = _INTERPRETED or x.dtype == torch.float32
        _linear_int8_kernel[(triton.cdiv(M, BM), triton.cdiv(O, BN))](
            rows, weight, scale, y, M, O, H, rows.stride(0), weight.stride(0), weight.stride(1), y.stride(0),
            UPCAST=upcast, BM=BM, BN=BN, BK=BK)
    return y.view(*lead, O)
