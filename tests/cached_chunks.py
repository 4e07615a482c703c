"""Prefill chunks over a KV cache as the pool lays it out, for the tests of `cached_extend_attention`:
each row's history written into the pages (through a shuffled block table) or a slot's ring, every other
cache entry NaN, and the same sequences as plain packed keys for `extend_attention`'s reference."""

from __future__ import annotations

import itertools

import torch

from inkling_compiled.kv_layout import page_location, pages_for, ring_location


def cached_chunk_case(g: torch.Generator, chunks: list[int], histories: list[int], nkv: int, group: int, hd: int,
                      *, window: int, ring_size: int = 0, page_size: int = 4, extent: int = 20,
                      dtype=torch.float32, device="cpu") -> dict:
    """The op's arguments (`args`, rel_extent last), the packed arguments of `extend_attention` over the
    same sequences (`packed`), and where the chunks' keys go (`locations`, -1 for keys a ring drops)."""
    rows, nh, T = len(chunks), nkv * group, sum(chunks)
    slots = [3, 1, 5, 2, 4][:rows]
    ring_size = ring_size or window

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    history_k = [randn(h, nkv, hd) for h in histories]
    history_v = [randn(h, nkv, hd) for h in histories]
    k, v, q = randn(T, nkv, hd), randn(T, nkv, hd), randn(T, nh, hd)
    table = randn(T, nh, extent) * 2
    tau = (torch.rand(T, generator=g) + 0.5) if window == 0 else None
    starts = [0, *itertools.accumulate(chunks)]
    positions = torch.cat([torch.arange(h, h + c) for h, c in zip(histories, chunks)])
    max_pages = pages_for(max(h + c for h, c in zip(histories, chunks)), page_size)
    pages = torch.randperm(6 * max_pages, generator=g)[:6 * max_pages].view(6, max_pages).int()  # 6 slots
    if window:
        rows_in_cache = 6 * ring_size
    else:
        rows_in_cache = 6 * max_pages * page_size
    k_cache = torch.full((rows_in_cache, nkv, hd), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for slot, hk, hv in zip(slots, history_k, history_v):
        h = hk.shape[0]
        kept = torch.arange(max(0, h - (window - 1)) if window else 0, h)  # a ring: the window's last W-1
        loc = ring_location(slot, kept, ring_size) if window else page_location(pages, slot, kept, page_size).long()
        k_cache[loc], v_cache[loc] = hk[kept], hv[kept]
    row_of = torch.repeat_interleave(torch.arange(rows), torch.tensor(chunks))
    slot_of = torch.tensor(slots)[row_of]
    if window:
        seq_lens = torch.tensor([h + c for h, c in zip(histories, chunks)])[row_of]
        locations = torch.where(positions >= seq_lens - window, ring_location(slot_of, positions, ring_size), -1)
    else:
        locations = page_location(pages, slot_of, positions, page_size).long()
    qsl = torch.tensor(starts, dtype=torch.int32)
    to = dict(device=device)
    args = [q.to(**to), k.to(**to), v.to(**to), k_cache.to(**to), v_cache.to(**to), table.to(**to),
            None if tau is None else tau.to(**to), qsl.to(**to), positions.to(**to),
            torch.tensor(slots, dtype=torch.int32, device=device), locations.to(**to), pages.to(**to), page_size,
            ring_size, window, extent]
    keys = torch.cat([x for hk, s, e in zip(history_k, starts, starts[1:]) for x in (hk, k[s:e])])
    values = torch.cat([x for hv, s, e in zip(history_v, starts, starts[1:]) for x in (hv, v[s:e])])
    ksl = torch.tensor([0, *itertools.accumulate(h + c for h, c in zip(histories, chunks))])
    packed = [q, keys, values, table, tau, qsl.long(), ksl, window, extent]
    return {"args": args, "packed": packed, "locations": locations, "k": k, "v": v}
