"""Inkling attention scores over an explicit set of keys.

One function holds the whole score recipe (banded relative bias, log scaling, 1/head_dim, window,
fp32 softmax), so the full-sequence path, the cached decode path and the paged-attention op cannot
drift apart: the callers differ only in where the keys come from and which of them a query may see.
"""

from __future__ import annotations

import torch

from .config import InklingConfig, LayerGeometry
from .kv_layout import ring_location


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, *, q_pos: torch.Tensor,
           k_pos: torch.Tensor, key_mask: torch.Tensor, tau: torch.Tensor | None, window: int, rel_extent: int
           ) -> torch.Tensor:
    """Attention of G groups of queries over their own keys.

    q: [G, T, nh, hd] (q-normed); k, v: [G, S, nkv, hd]; table: [G, T, nh, E] = r @ rel_proj, the
    bias of each head for each backward distance; q_pos [G, T], k_pos [G, S] int64; key_mask
    [G, T, S] marks keys that exist and belong to the query's sequence (causality and the window,
    `window` > 0, are applied here); tau [G, T] fp32 log scale or None. Returns [G, T, nh, hd].
    """
    nh, hd, nkv = q.shape[2], q.shape[3], k.shape[2]
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [G, T, S]
    visible = key_mask & (dist >= 0)
    if window > 0:
        visible = visible & (dist < window)

    in_band = (dist >= 0) & (dist < rel_extent)
    gather_at = dist.clamp(0, rel_extent - 1)[:, :, None, :].expand(-1, -1, nh, -1)
    bias = table.gather(-1, gather_at).masked_fill(~in_band[:, :, None, :], 0.0)  # [G, T, nh, S]

    if tau is not None:
        tau = tau[:, :, None, None]
        q = (q.float() * tau).to(q.dtype)
        bias = (bias.float() * tau).to(bias.dtype)

    # Hidden keys get probability exactly 0, but 0 * NaN is NaN: callers hand in only values that are
    # this request's own or known finite (prefill attends one sequence per group; a slot's ring is
    # cleared when the slot is handed out; paged attention selects away what lies past a row's length).
    group = nh // nkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("gthd,gshd->gths", q, k) * (1.0 / hd) + bias
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("gths,gshd->gthd", probs, v)


def attend_packed(q, k, v, table, tau, query_spans: list[tuple[int, int]], key_spans: list[tuple[int, int]],
                  window: int, rel_extent: int) -> torch.Tensor:
    """Packed sequences, each attending over its own keys: q [T, nh, hd], table [T, nh, E], tau [T] or
    None; k, v [S, nkv, hd]. Sequence b's queries q[query_spans[b]] are the last tokens of its keys
    k[key_spans[b]], which sit at consecutive positions: query i of L over S keys sees up to key
    S - L + i. Each sequence is its own group, so no sequence's keys or values enter another's
    arithmetic (and memory is the sum of its queries times its keys, not T x S)."""
    outs = []
    for (q0, q1), (k0, k1) in zip(query_spans, key_spans):
        k_pos = torch.arange(k1 - k0, device=q.device)[None]
        key_mask = torch.ones(1, q1 - q0, k1 - k0, dtype=torch.bool, device=q.device)
        outs.append(attend(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], table[None, q0:q1],
                           q_pos=k_pos[:, k1 - k0 - (q1 - q0):], k_pos=k_pos, key_mask=key_mask,
                           tau=None if tau is None else tau[None, q0:q1], window=window, rel_extent=rel_extent)[0])
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def attend_from_scratch(config: InklingConfig, g: LayerGeometry, q, k, v, table, positions,
                        spans: list[tuple[int, int]]) -> torch.Tensor:
    """Packed sequences attending over their own new tokens only (nothing cached before them): q [T, nh,
    hd], k/v [T, nkv, hd], table [T, nh, E], positions [T]; `spans` are the (start, end) packed offsets."""
    tau = config.log_scale(positions) if g.log_scaling else None
    return attend_packed(q, k, v, table, tau, spans, spans, g.window or 0, g.rel_extent)


def attend_ring(q, k_ring, v_ring, table, positions, cache_indices, window: int, rel_extent: int,
                ring_size: int = 0):
    """Decode on a sliding layer: each row's slot keeps its recent keys in a ring of `ring_size` entries
    (0: the window), the current one included, already written; the row reads positions pos-W+1..pos.
    q [B, nh, hd], rings [slots*ring_size, nkv, hd], table [B, nh, E]."""
    pos = positions[:, None]
    k_pos = pos - (window - 1) + torch.arange(window, device=q.device)  # [B, W], oldest first
    loc = ring_location(cache_indices.long()[:, None], k_pos.clamp(min=0), ring_size or window)
    out = attend(q[:, None], k_ring[loc], v_ring[loc], table[:, None], q_pos=pos, k_pos=k_pos,
                 key_mask=(k_pos >= 0)[:, None, :], tau=None, window=window, rel_extent=rel_extent)
    return out[:, 0]
