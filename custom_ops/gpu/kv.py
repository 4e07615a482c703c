"""KV-cache write: one program per (token, block of its nkv*hd values); a negative location skips."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _kv_write_kernel(k_cache, v_cache, k, v, loc_ptr, hd, width, s_cache_row, s_cache_head, s_row, s_head,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    loc = tl.load(loc_ptr + t)
    keep = (i < width) & (loc >= 0)
    head, dim = i // hd, i % hd
    src = t * s_row + head * s_head + dim
    dst = loc.to(tl.int64) * s_cache_row + head * s_cache_head + dim
    tl.store(k_cache + dst, tl.load(k + src, mask=keep).to(k_cache.dtype.element_ty), mask=keep)
    tl.store(v_cache + dst, tl.load(v + src, mask=keep).to(v_cache.dtype.element_ty), mask=keep)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             locations: torch.Tensor) -> None:
    T, nkv, hd = k.shape
    if T == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k.stride() == v.stride(), "k and v must share a layout"
    assert k_cache.stride(2) == 1 and k.stride(2) == 1, "head dims must be contiguous"
    _kv_write_kernel[(T, triton.cdiv(nkv * hd, BLOCK))](
        k_cache, v_cache, k, v, locations, hd, nkv * hd, k_cache.stride(0), k_cache.stride(1), k.stride(0),
        k.stride(1), BLOCK=BLOCK)
