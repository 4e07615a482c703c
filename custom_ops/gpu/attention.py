"""Decode attention, split over key blocks (flash-decoding): paged global layers and sliding rings.

One program per (row, KV head, split) reads only the keys of its split that the row has (its
`seq_lens` for pages; the filled ring entries for a ring), once for all the query heads of its group,
with an online softmax; a second kernel merges the splits. The number of splits is a function of
shapes only (the table's width, the batch and head counts), so a batch of one still spreads over the
device and the launch is the same at every replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 16  # keys per inner iteration
NEG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "no keys yet": exp(NEG - m) is 0, never NaN


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, tau_ptr, bt_ptr, idx_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
                  hd, E, page_size, window, keys_per_split, sq_row, sq_head, sk_row, sk_head, st_row, st_head,
                  sbt, nh, SPLITS,
                  RING: tl.constexpr, HAS_TAU: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                  HDP: tl.constexpr, BLOCK_N: tl.constexpr):
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = g * GROUP + tl.arange(0, GP)
    hm = tl.arange(0, GP) < GROUP
    dims = tl.arange(0, HDP)
    dm = dims < hd
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if RING:
        q_pos = tl.load(len_ptr + b)  # the row's position
        n_keys = tl.minimum(q_pos + 1, window)  # ring entries filled so far
    else:
        n_keys = tl.load(len_ptr + b).to(tl.int64)  # seq_len, the current token included
        q_pos = n_keys - 1
    q = tl.load(q_ptr + b * sq_row + heads[:, None] * sq_head + dims[None, :], mask=hm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    scale = 1.0
    if HAS_TAU:
        scale = tl.load(tau_ptr + b).to(tl.float32)
    lo = s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_keys)
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HDP], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < hi
        if RING:  # key j is position q_pos-n_keys+1+j, in ring entry position % ring size (page_size)
            k_pos = q_pos - n_keys + 1 + j
            loc = slot * page_size + k_pos % page_size
        else:
            page = tl.load(bt_ptr + slot * sbt + j // page_size, mask=jm, other=0).to(tl.int64)
            loc = page * page_size + j % page_size
            k_pos = j
        kv_at = loc[:, None] * sk_row + g * sk_head + dims[None, :]
        kv_mask = jm[:, None] & dm[None, :]
        k = tl.load(k_ptr + kv_at, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_at, mask=kv_mask, other=0.0).to(tl.float32)
        dist = q_pos - k_pos
        bias = tl.load(table_ptr + b * st_row + heads[:, None] * st_head + dist[None, :],
                       mask=hm[:, None] & jm[None, :] & (dist[None, :] < E), other=0.0).to(tl.float32)
        scores = (tl.sum(q[:, None, :] * k[None, :, :], axis=2) / hd + bias) * scale
        scores = tl.where(jm[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    part = (b * nh + heads) * SPLITS + s
    tl.store(m_ptr + part, m_i, mask=hm)
    tl.store(l_ptr + part, l_i, mask=hm)
    tl.store(acc_ptr + part[:, None] * HDP + dims[None, :], acc, mask=hm[:, None])


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, hd, so_row, so_head, nh, SPLITS, SP: tl.constexpr,
                  HDP: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SP)
    sm = s < SPLITS
    part = (b * nh + h) * SPLITS + s
    m = tl.load(m_ptr + part, mask=sm, other=NEG)
    l = tl.load(l_ptr + part, mask=sm, other=0.0)
    dims = tl.arange(0, HDP)
    acc = tl.load(acc_ptr + part[:, None] * HDP + dims[None, :], mask=sm[:, None], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + b * so_row + h * so_head + dims, out.to(out_ptr.dtype.element_ty), mask=dims < hd)


def _programs_wanted(device: torch.device) -> int:
    """Enough programs to keep every SM busy twice over."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: a few splits, so tests cover the merge


def _attend(q, k_cache, v_cache, table, tau, block_table, cache_indices, lens_or_pos, *, page_size: int,
            window: int, max_keys: int, ring: bool, rel_extent: int) -> torch.Tensor:
    B, nh, hd = q.shape
    nkv = k_cache.shape[1]
    out = torch.empty_like(q)
    if B == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and table.stride(2) == 1, "inner dims must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share a layout"
    assert table.shape[2] == rel_extent, "the bias table holds one entry per distance of the relative extent"
    blocks = triton.cdiv(max_keys, BLOCK_N)
    splits = max(1, min(blocks, triton.cdiv(_programs_wanted(q.device), B * nkv)))
    keys_per_split = triton.cdiv(blocks, splits) * BLOCK_N
    splits = triton.cdiv(max_keys, keys_per_split)
    HDP = triton.next_power_of_2(hd)
    acc = torch.empty(B, nh, splits, HDP, dtype=torch.float32, device=q.device)
    m = torch.empty(B, nh, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    group = nh // nkv
    _split_kernel[(B, nkv, splits)](
        q, k_cache, v_cache, table, tau if tau is not None else q, block_table, cache_indices, lens_or_pos, acc, m, l,
        hd, table.shape[2], page_size, window, keys_per_split, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), table.stride(0), table.stride(1), block_table.stride(0), nh, splits,
        RING=ring, HAS_TAU=tau is not None, GROUP=group, GP=triton.next_power_of_2(group), HDP=HDP, BLOCK_N=BLOCK_N)
    _merge_kernel[(B, nh)](acc, m, l, out, hd, out.stride(0), out.stride(1), nh, splits,
                           SP=triton.next_power_of_2(splits), HDP=HDP)
    return out


def paged_attention(q, k_cache, v_cache, table, tau, block_table, cache_indices, seq_lens, page_size: int,
                    rel_extent: int) -> torch.Tensor:
    """Signature and result of `attention.paged_attention_reference`; reads keys [0, seq_len) of each row."""
    return _attend(q, k_cache, v_cache, table, tau, block_table, cache_indices, seq_lens, page_size=page_size,
                   window=0, max_keys=block_table.shape[1] * page_size, ring=False, rel_extent=rel_extent)


def ring_attention(q, k_ring, v_ring, table, positions, cache_indices, window: int, rel_extent: int,
                   ring_size: int = 0) -> torch.Tensor:
    """Signature and result of `attention.attend_ring`; reads the min(position+1, window) newest positions."""
    return _attend(q, k_ring, v_ring, table, None, cache_indices, cache_indices, positions, page_size=ring_size or window,
                   window=window, max_keys=window, ring=True, rel_extent=rel_extent)
