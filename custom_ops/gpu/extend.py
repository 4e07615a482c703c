"""Prefill attention over packed chunks (`extend_attention`, and `cached_extend_attention`, whose keys
come from the caches and the chunk), flash-style.

A program owns one block of one sequence's consecutive queries and one KV head. Its rows are those
queries times the query heads sharing the KV head, so each key block is read once for all of them
and both products are `tl.dot`s. Keys are read from the first one the block's first query can see
(its window's start on a sliding layer) to the last query's own; a sequence's keys are the only ones
a program reads, so nothing of another sequence enters its arithmetic.

Which (sequence, query block) a program owns comes from a prefix sum of the sequences' block counts
inside the kernel: the grid is `cdiv(T, BLOCK_M) + B` programs (each sequence adds at most one
partial block), a function of shapes only, and the programs past the last block return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 32  # rows of a program: queries x the query heads of one KV head
BLOCK_N = 32  # keys per inner iteration
NEG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "no keys yet": exp(NEG - m) is 0, never NaN


@triton.jit
def _extend_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, tau_ptr, qsl_ptr, ksl_ptr, out_ptr,
                             kc_ptr, vc_ptr, pos_ptr, slot_ptr, bt_ptr,
                             B, hd, E, window, sq_tok, sq_head, sk_tok, sk_head, st_tok, st_head, so_tok, so_head,
                             s_tau, skc_tok, skc_head, s_bt, page_size, ring_size,
                             HAS_TAU: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BP: tl.constexpr, HDP: tl.constexpr, BLOCK_N: tl.constexpr, HISTORY: tl.constexpr):
    p, g = tl.program_id(0), tl.program_id(1)
    # This program's sequence: the first whose cumulative block count passes p.
    seqs = tl.arange(0, BP)
    q_lo = tl.load(qsl_ptr + seqs, mask=seqs < B, other=0)
    q_hi = tl.load(qsl_ptr + seqs + 1, mask=seqs < B, other=0)
    blocks = (q_hi - q_lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, axis=0)
    b = tl.sum((ends <= p).to(tl.int32), axis=0)
    if b >= B:
        return
    mine = seqs == b
    block = p - tl.sum(tl.where(mine, ends - blocks, 0), axis=0)
    q0, n_q = tl.sum(tl.where(mine, q_lo, 0), axis=0), tl.sum(tl.where(mine, q_hi - q_lo, 0), axis=0)
    if HISTORY:  # the sequence's keys: its cached history (positions first-hist..first-1), then the chunk's
        first_pos = tl.load(pos_ptr + q0).to(tl.int64)
        hist = tl.where(window > 0, tl.minimum(first_pos, window - 1), first_pos)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        k0 = q0 - hist  # key index j of the chunk's part is the packed token k0 + j
        n_k = hist + n_q
    else:
        k0 = tl.load(ksl_ptr + b)
        n_k = tl.load(ksl_ptr + b + 1) - k0

    # Rows: query (block*BLOCK_M + r // GP) of the sequence, head g*GROUP + r % GP.
    r = tl.arange(0, BLOCK_M * GP)
    qi = block * BLOCK_M + r // GP
    head = g * GROUP + r % GP
    live = (qi < n_q) & (r % GP < GROUP)
    tok = (q0 + qi).to(tl.int64)
    pos = n_k - n_q + qi  # the query's key index: it sees keys [pos-window+1, pos] (all up to pos if window is 0)
    dims = tl.arange(0, HDP)
    dm = dims < hd
    q = tl.load(q_ptr + tok[:, None] * sq_tok + head[:, None] * sq_head + dims[None, :],
                mask=live[:, None] & dm[None, :], other=0.0).to(tl.float32)
    scale = tl.full([BLOCK_M * GP], 1.0, tl.float32)
    if HAS_TAU:
        scale = tl.load(tau_ptr + tok * s_tau, mask=live, other=1.0).to(tl.float32)

    first = n_k - n_q + block * BLOCK_M  # the block's first query
    last = tl.minimum(first + BLOCK_M, n_k) - 1
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
    m_i = tl.full([BLOCK_M * GP], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, HDP], tl.float32)
    for start in range(lo, last + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j <= last
        own = jm
        if HISTORY:
            old = jm & (j < hist)
            own = jm & (j >= hist)
            kpos = first_pos - hist + j
            if window > 0:  # the slot's ring
                loc = slot * ring_size + kpos % ring_size
            else:  # the slot's pages
                page = tl.load(bt_ptr + slot * s_bt + kpos // page_size, mask=old, other=0).to(tl.int64)
                loc = page * page_size + kpos % page_size
            loc = tl.where(old, loc, 0)
        at = tl.where(own, k0 + j, 0).to(tl.int64)
        kt = tl.load(k_ptr + at[None, :] * sk_tok + g * sk_head + dims[:, None], mask=dm[:, None] & own[None, :],
                     other=0.0).to(tl.float32)  # [HDP, BLOCK_N]
        v = tl.load(v_ptr + at[:, None] * sk_tok + g * sk_head + dims[None, :], mask=own[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        if HISTORY:
            kt += tl.load(kc_ptr + loc[None, :] * skc_tok + g * skc_head + dims[:, None],
                          mask=dm[:, None] & old[None, :], other=0.0).to(tl.float32)
            v += tl.load(vc_ptr + loc[:, None] * skc_tok + g * skc_head + dims[None, :],
                         mask=old[:, None] & dm[None, :], other=0.0).to(tl.float32)
        dist = pos[:, None] - j[None, :]
        seen = live[:, None] & jm[None, :] & (dist >= 0) & ((dist < window) | (window == 0))
        bias = tl.load(table_ptr + tok[:, None] * st_tok + head[:, None] * st_head + dist,
                       mask=seen & (dist < E), other=0.0).to(tl.float32)
        scores = (tl.dot(q, kt, input_precision="ieee") / hd + bias) * scale[:, None]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        prob = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * so_tok + head[:, None] * so_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None] & dm[None, :])


def _launch(q, k, v, table, tau, query_start_loc, key_start_loc, window: int, rel_extent: int,
            cache=None) -> torch.Tensor:
    """The kernel over packed keys (`key_start_loc`), or over each row's cached history then its chunk's
    keys (`cache`: k_cache, v_cache, positions, cache_indices, block_table, page_size, ring_size)."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    B = query_start_loc.shape[0] - 1
    out = torch.empty_like(q)
    if T == 0 or B <= 0:
        return out
    assert q.stride(2) == 1 and k.stride(2) == 1 and table.stride(2) == 1, "inner dims must be contiguous"
    assert k.stride() == v.stride(), "k and v must share a layout"
    assert table.shape[2] == rel_extent, "the bias table holds one entry per distance of the relative extent"
    assert query_start_loc.stride(0) == 1, "start locations must be contiguous"
    if cache is None:
        assert key_start_loc.stride(0) == 1, "start locations must be contiguous"
        k_cache = v_cache = positions = slots = block_table = k
        cache_strides, page_size, ring_size = (0, 0, 0), 1, 1
    else:
        k_cache, v_cache, positions, slots, block_table, page_size, ring_size = cache
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1, "the caches must share a layout"
        cache_strides = (k_cache.stride(0), k_cache.stride(1), block_table.stride(0))
        key_start_loc = query_start_loc  # not read
    group = nh // nkv
    gp = triton.next_power_of_2(group)
    block_m = max(1, ROWS // gp)
    grid = (triton.cdiv(T, block_m) + B, nkv)
    _extend_attention_kernel[grid](
        q, k, v, table, tau if tau is not None else q, query_start_loc, key_start_loc, out,
        k_cache, v_cache, positions, slots, block_table,
        B, hd, rel_extent, window, q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0),
        table.stride(1), out.stride(0), out.stride(1), tau.stride(0) if tau is not None else 0,
        *cache_strides, page_size, ring_size,
        HAS_TAU=tau is not None, GROUP=group, GP=gp, BLOCK_M=block_m, BP=triton.next_power_of_2(B),
        HDP=max(16, triton.next_power_of_2(hd)), BLOCK_N=BLOCK_N, HISTORY=cache is not None)
    return out


def extend_attention(q, k, v, table, tau, query_start_loc, key_start_loc, window: int, rel_extent: int) -> torch.Tensor:
    """Signature and result of `attention.extend_attention_reference`."""
    return _launch(q, k, v, table, tau, query_start_loc, key_start_loc, window, rel_extent)


def cached_extend_attention(q, k, v, k_cache, v_cache, table, tau, query_start_loc, positions, cache_indices,
                            kv_locations, block_table, page_size: int, ring_size: int, window: int,
                            rel_extent: int) -> torch.Tensor:
    """Signature and result of `attention.cached_extend_attention_reference`: the history is read in the
    kernel, through the block table or the ring, before the chunk's keys are written after it (in stream
    order); nothing depends on the data's values on the host."""
    out = _launch(q, k, v, table, tau, query_start_loc, None, window, rel_extent,
                  cache=(k_cache, v_cache, positions, cache_indices, block_table, page_size, ring_size))
    torch.ops.inkling.kv_write.default(k_cache, v_cache, k, v, kv_locations)
    return out
