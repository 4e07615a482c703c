"""Decode attention over a paged KV cache (global layers).

An opaque op so that the compiled step keeps one static shape while the kernel reads only the pages
the batch's longest sequence needs (on CPU; a GPU kernel must not sync, so it reads the table's width).
"""

from __future__ import annotations

from typing import Optional

import torch

from inkling_compiled.attention import attend

from .library import define


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    tau: Optional[torch.Tensor], block_table: torch.Tensor, cache_indices: torch.Tensor,
                    seq_lens: torch.Tensor, page_size: int, rel_extent: int) -> torch.Tensor:
    """q [B, nh, hd], table [B, nh, E], tau [B] or None; caches [pages*page_size, nkv, hd];
    block_table [slots, max_pages] int32 indexed by cache_indices [B]; seq_lens [B] keys per row,
    the current token included (it sits at position seq_len-1). Returns [B, nh, hd]."""
    B = q.shape[0]
    if q.device.type == "cpu":
        pages = max(1, -(-int(seq_lens.max()) // page_size))
    else:
        pages = block_table.shape[1]
    rows = block_table.index_select(0, cache_indices.long())[:, :pages].long()  # [B, pages]
    loc = (rows[:, :, None] * page_size + torch.arange(page_size, device=q.device)).reshape(B, -1)
    k_pos = torch.arange(loc.shape[1], device=q.device).expand(B, -1)
    lens = seq_lens.long()
    out = attend(q[:, None], k_cache[loc], v_cache[loc], table[:, None], q_pos=(lens - 1)[:, None], k_pos=k_pos,
                 key_mask=(k_pos < lens[:, None])[:, None, :], tau=None if tau is None else tau[:, None],
                 window=0, rel_extent=rel_extent)
    return out[:, 0]


paged_attention = define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor? tau, Tensor block_table, "
    "Tensor cache_indices, Tensor seq_lens, int page_size, int rel_extent) -> Tensor",
    paged_attention_reference, lambda q, *args: torch.empty_like(q))
