"""Top-k / top-p filtering without a sort: both cut-offs are found by bisection over the values' order.

A float32's bits, with the magnitude bits flipped for negatives, order like the floats do, so the
k-th largest value of a row is the largest 32-bit key t with count(key >= t) >= k: 32 counting passes
find it exactly (-0.0 counts as +0.0, as it compares equal). Top-p is the same over the top-k's probability mass: the smallest key v (at or above
the top-k cut) whose strictly larger values hold less than top_p of the mass. Ties behave as in the
sorting reference (`sampling.filter_rows`): the top-k mass counts exactly k values, and every value
equal to the final cut is kept. One program per row; a row that filters nothing is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _key(x):
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are one value to the reference
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _count_at_or_above(row, V, t, BLOCK: tl.constexpr):
    n = tl.zeros([BLOCK], tl.int64)
    for v0 in range(0, V, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + i, mask=i < V, other=float("-inf"))
        n += ((_key(x) >= t) & (i < V)).to(tl.int64)
    return tl.sum(n, axis=0)


@triton.jit
def _mass_above(row, V, t, m, BLOCK: tl.constexpr):
    """sum of exp(x - m) over the values whose key is strictly above t."""
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + i, mask=i < V, other=float("-inf"))
        s += tl.where((_key(x) > t) & (i < V), tl.exp(x - m), 0.0)
    return tl.sum(s, axis=0)


@triton.jit
def _filter_kernel(x_ptr, k_ptr, p_ptr, out_ptr, V, sx, so, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = x_ptr + b * sx
    k = tl.load(k_ptr + b).to(tl.int64)
    k = tl.where((k > 0) & (k < V), k, V)
    p = tl.load(p_ptr + b).to(tl.float32)
    cut = tl.full([], -2147483649, tl.int64)  # below every key: keep all
    if (k < V) | (p < 1.0):
        m = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            i = v0 + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.max(tl.load(row + i, mask=i < V, other=float("-inf")), axis=0))
        if k < V:  # the k-th largest key: largest t with count(key >= t) >= k
            lo = tl.full([], -2147483648, tl.int64)
            hi = tl.full([], 2147483647, tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2  # floor: // truncates toward zero on negatives
                enough = _count_at_or_above(row, V, mid, BLOCK) >= k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            cut = lo
        if p < 1.0:
            # Mass of exactly k values: those above the cut, and as many copies of the cut value as fill k.
            above = _mass_above(row, V, cut, m, BLOCK)
            if k < V:
                n_above = _count_at_or_above(row, V, cut + 1, BLOCK)
                at_cut = tl.zeros([BLOCK], tl.float32)
                for v0 in range(0, V, BLOCK):
                    i = v0 + tl.arange(0, BLOCK)
                    x = tl.load(row + i, mask=i < V, other=float("-inf"))
                    at_cut = tl.maximum(at_cut, tl.where((_key(x) == cut) & (i < V), tl.exp(x - m), 0.0))
                total = above + (k - n_above).to(tl.float32) * tl.max(at_cut, axis=0)
            else:
                total = above
            # smallest key v >= cut with mass_above(v) < p * total (the row's max key always qualifies)
            lo = tl.maximum(cut, tl.full([], -2147483648, tl.int64))
            hi = _key(m)
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                small = _mass_above(row, V, mid, m, BLOCK) < p * total
                hi = tl.where(small & (lo < hi), mid, hi)
                lo = tl.where(small | (lo >= hi), lo, mid + 1)
            cut = lo
    for v0 in range(0, V, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + i, mask=i < V, other=float("-inf"))
        tl.store(out_ptr + b * so + i, tl.where(_key(x) >= cut, x, float("-inf")), mask=i < V)


def top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Signature and result of `sampling.top_k_top_p_reference` (scaled logits [B, V] fp32)."""
    B, V = scaled.shape
    out = torch.empty_like(scaled)
    if B == 0:
        return out
    assert scaled.stride(1) == 1, "vocabulary must be contiguous"
    _filter_kernel[(B,)](scaled, top_k, top_p, out, V, scaled.stride(0), out.stride(0),
                         BLOCK=min(triton.next_power_of_2(V), 1024))
    return out
