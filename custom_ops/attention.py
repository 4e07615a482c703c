"""Attention ops. Decode: over a paged KV cache (global layers) and over each slot's ring (sliding
layers). Prefill: packed chunks, each over its sequence's keys (`extend_attention`).

Opaque ops so that the compiled step keeps one static shape while the kernel reads only the keys its
rows need. The paged reference looks at `seq_lens` on the host to read just the pages the longest row
covers; the CUDA kernel (`gpu/attention.py`) cannot look, so each of its programs reads only the keys
its row has, split over key blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

from inkling_compiled.attention import attend, attend_packed, attend_ring
from inkling_compiled.kv_layout import page_location, pages_for

from .library import define, gpu_kernel


def _attend_pages(q, k_cache, v_cache, table, tau, block_table, cache_indices, seq_lens, page_size: int,
                  rel_extent: int, pages: int) -> torch.Tensor:
    """Each row's query over the first `pages` pages of its block-table row, keys past seq_len masked.

    What lies past a row's length (another request's old keys on a reused page, the dummy page behind
    unused table entries) is selected away from the values, not just given probability 0: 0 * NaN is NaN."""
    B = q.shape[0]
    k_pos = torch.arange(pages * page_size, device=q.device).expand(B, -1)  # [B, pages*page_size]
    loc = page_location(block_table, cache_indices.long()[:, None], k_pos, page_size).long()
    lens = seq_lens.long()
    own = k_pos < lens[:, None]  # [B, keys]
    v = v_cache[loc].masked_fill(~own[:, :, None, None], 0.0)
    out = attend(q[:, None], k_cache[loc], v, table[:, None], q_pos=(lens - 1)[:, None], k_pos=k_pos,
                 key_mask=own[:, None, :], tau=None if tau is None else tau[:, None], window=0,
                 rel_extent=rel_extent)
    return out[:, 0]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                              tau: Optional[torch.Tensor], block_table: torch.Tensor, cache_indices: torch.Tensor,
                              seq_lens: torch.Tensor, page_size: int, rel_extent: int) -> torch.Tensor:
    """q [B, nh, hd], table [B, nh, E], tau [B] or None; caches [pages*page_size, nkv, hd];
    block_table [slots, max_pages] int32 indexed by cache_indices [B]; seq_lens [B] keys per row,
    the current token included (it sits at position seq_len-1). Returns [B, nh, hd]."""
    pages = max(1, pages_for(int(seq_lens.max()), page_size))
    return _attend_pages(q, k_cache, v_cache, table, tau, block_table, cache_indices, seq_lens, page_size,
                         rel_extent, pages)


paged_attention = define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor? tau, Tensor block_table, "
    "Tensor cache_indices, Tensor seq_lens, int page_size, int rel_extent) -> Tensor",
    fake=lambda q, *args: torch.empty_like(q), reference=paged_attention_reference,
    cuda=gpu_kernel("attention", "paged_attention"))


def extend_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                               tau: Optional[torch.Tensor], query_start_loc: torch.Tensor,
                               key_start_loc: torch.Tensor, window: int, rel_extent: int) -> torch.Tensor:
    """Packed prefill chunks: q [T, nh, hd], table [T, nh, E], tau [T] fp32 or None; k, v [S, nkv, hd].
    Sequence b's keys are k[key_start_loc[b]:key_start_loc[b+1]], at consecutive positions (the history a
    chunk reads from the cache, then the chunk's own), and its queries q[query_start_loc[b]:...+1] are
    its last tokens: query i of L sees the keys up to its own, S - L + i (the last `window` of them when
    `window` > 0). Each sequence is attended alone, so no other sequence's keys enter its arithmetic.
    Returns [T, nh, hd]."""
    qsl, ksl = query_start_loc.tolist(), key_start_loc.tolist()
    return attend_packed(q, k, v, table, tau, list(zip(qsl[:-1], qsl[1:])), list(zip(ksl[:-1], ksl[1:])), window,
                         rel_extent)


extend_attention = define(
    "extend_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor? tau, Tensor query_start_loc, "
    "Tensor key_start_loc, int window, int rel_extent) -> Tensor",
    fake=lambda q, *args: torch.empty_like(q), reference=extend_attention_reference,
    cuda=gpu_kernel("extend", "extend_attention"))


ring_attention = define(
    "ring_attention(Tensor q, Tensor k_ring, Tensor v_ring, Tensor table, Tensor positions, Tensor cache_indices, "
    "int window, int rel_extent, int ring_size=0) -> Tensor",
    fake=lambda q, *args: torch.empty_like(q), reference=attend_ring,
    cuda=gpu_kernel("attention", "ring_attention"))
