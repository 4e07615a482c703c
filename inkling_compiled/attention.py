"""Inkling attention scores over an explicit set of keys.

One function holds the whole score recipe (banded relative bias, log scaling, 1/head_dim, window,
fp32 softmax), so the full-sequence path and the cached serving path cannot drift apart: the
callers differ only in where the keys come from and which of them a query may see.
"""

from __future__ import annotations

import torch

from .config import InklingConfig, LayerGeometry


def attend_dense(config: InklingConfig, g: LayerGeometry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 r: torch.Tensor, rel_proj: torch.Tensor, *, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 key_mask: torch.Tensor) -> torch.Tensor:
    """q: [T, nh, hd] (q-normed), k/v: [S, nkv, hd], r: [T, nh, d_rel], positions int64.

    key_mask [T, S] says which keys belong to each query's sequence; causality and the sliding
    window are applied here from the positions. Returns [T, nh, hd].
    """
    dist = q_pos[:, None] - k_pos[None, :]  # [T, S]
    visible = key_mask & (dist >= 0)
    if g.window is not None:
        visible = visible & (dist < g.window)

    table = r @ rel_proj  # [T, nh, E]: bias of each head for each backward distance
    in_band = (dist >= 0) & (dist < g.rel_extent)
    gather_at = dist.clamp(0, g.rel_extent - 1)[:, None, :].expand(-1, g.num_heads, -1)
    bias = table.gather(-1, gather_at).masked_fill(~in_band[:, None, :], 0.0)  # [T, nh, S]

    if g.log_scaling:
        tau = config.log_scale(q_pos)[:, None, None]
        q = (q.float() * tau).to(q.dtype)
        bias = (bias.float() * tau).to(bias.dtype)

    group = g.num_heads // g.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->ths", q, k) * (1.0 / g.head_dim) + bias
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("ths,shd->thd", probs, v)
