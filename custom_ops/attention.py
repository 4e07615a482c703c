"""Attention ops. Decode: over a paged KV cache (global layers) and over each slot's ring (sliding
layers). Prefill: packed chunks, each over its sequence's keys (`extend_attention`), or over its cached
history and its own keys, which it then writes (`cached_extend_attention`, what a compiled extend step
calls: the history's length is the cache's business, not the graph's).

Opaque ops so that the compiled step keeps one static shape while the kernel reads only the keys its
rows need. The paged reference looks at `seq_lens` on the host to read just the pages the longest row
covers; the CUDA kernel (`gpu/attention.py`) cannot look, so each of its programs reads only the keys
its row has, split over key blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

from inkling_compiled.attention import attend, attend_packed, attend_ring
from inkling_compiled.kv_layout import page_location, pages_for, ring_location

from .kv import kv_write_reference
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


def chunk_keys(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               query_start_loc: torch.Tensor, positions: torch.Tensor, cache_indices: torch.Tensor,
               block_table: torch.Tensor, page_size: int, ring_size: int, window: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values, key_start_loc) as `extend_attention` takes them: each row's history as the cache
    holds it before the chunk is written (every earlier position of a global layer, the last window-1 of
    a sliding layer's ring when `window` > 0), then the chunk's own keys. Chunks that all start their
    prompts (the common case) have no history: their keys are the chunk's, and nothing is gathered."""
    qs = query_start_loc.long()
    T, rows = k.shape[0], qs.shape[0] - 1
    lens = qs[1:] - qs[:-1]
    firsts = torch.where(lens > 0, positions[qs[:-1].clamp(max=max(T - 1, 0))], 0) if T else lens
    if not firsts.any():
        return k, v, qs
    history = firsts.clamp(max=window - 1) if window > 0 else firsts
    per_row = history + lens
    key_start_loc = torch.zeros(rows + 1, dtype=torch.long, device=k.device)
    torch.cumsum(per_row, 0, out=key_start_loc[1:])
    row = torch.repeat_interleave(torch.arange(rows, device=k.device), per_row)  # [S]: each key's row
    offset = torch.arange(row.shape[0], device=k.device) - key_start_loc[row]
    cached = offset < history[row]
    pos = firsts[row] - history[row] + offset  # each key's position in its sequence
    slot = cache_indices.long()[row]
    loc = ring_location(slot, pos, ring_size) if window > 0 else page_location(block_table, slot, pos, page_size).long()
    at_cache = torch.where(cached, loc, 0)
    at_chunk = torch.where(cached, 0, qs[:-1][row] + offset - history[row]).clamp(max=T - 1)  # T > 0 here
    keep = cached[:, None, None]
    return (torch.where(keep, k_cache[at_cache], k[at_chunk]), torch.where(keep, v_cache[at_cache], v[at_chunk]),
            key_start_loc)


def cached_extend_attention_reference(q, k, v, k_cache, v_cache, table, tau, query_start_loc, positions,
                                      cache_indices, kv_locations, block_table, page_size: int, ring_size: int,
                                      window: int, rel_extent: int) -> torch.Tensor:
    """Packed prefill chunks over the caches: q [T, nh, hd], k/v [T, nkv, hd] the chunks' own keys,
    table [T, nh, E], tau [T] or None; positions [T] each token's position in its sequence, whose first
    positions[query_start_loc[b]] tokens are cached (a global layer's pages through `block_table`, or a
    sliding layer's ring of `ring_size` entries per slot when `window` > 0). Each row's history is read
    before its chunk's keys are written (at `kv_locations`, as `kv_write` does: a ring may reuse an entry
    the chunk's first queries still read); then it attends as `extend_attention` does."""
    keys, values, key_start_loc = chunk_keys(k, v, k_cache, v_cache, query_start_loc, positions, cache_indices,
                                             block_table, page_size, ring_size, window)
    kv_write_reference(k_cache, v_cache, k, v, kv_locations)
    return extend_attention_reference(q, keys, values, table, tau, query_start_loc, key_start_loc, window,
                                      rel_extent)


cached_extend_attention = define(
    "cached_extend_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor table, "
    "Tensor? tau, Tensor query_start_loc, Tensor positions, Tensor cache_indices, Tensor kv_locations, "
    "Tensor block_table, int page_size, int ring_size, int window, int rel_extent) -> Tensor",
    fake=lambda q, *args: torch.empty_like(q), reference=cached_extend_attention_reference,
    cuda=gpu_kernel("extend", "cached_extend_attention"))


ring_attention = define(
    "ring_attention(Tensor q, Tensor k_ring, Tensor v_ring, Tensor table, Tensor positions, Tensor cache_indices, "
    "int window, int rel_extent, int ring_size=0) -> Tensor",
    fake=lambda q, *args: torch.empty_like(q), reference=attend_ring,
    cuda=gpu_kernel("attention", "ring_attention"))
