"""Top-k / top-p filtering behind an op: the sort only runs for the rows that ask for it.

A full-vocabulary sort is expensive, and greedy or plain-temperature rows do not need it. Deciding
that is data-dependent, which a static graph cannot express without a branch; as an opaque op the
kernel simply looks (on the host, where looking is free). The CUDA kernel (`gpu/sampling.py`) cannot
look: it finds each row's cut-offs by bisection, with no sort at all, and copies rows that filter nothing.
"""

from __future__ import annotations

import torch

from .library import define, gpu_kernel


def filter_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top_k (0 = all), then outside the smallest prefix reaching top_p."""
    V = scaled.shape[-1]
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    rank = torch.arange(V, device=scaled.device)[None, :]
    ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The top token is always kept; top_p >= 1 keeps every token (the running sum may round past 1
    # before the tail, which must not drop it).
    kept = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (rank < k[:, None])
    threshold = ordered.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def top_k_top_p_reference(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows = ((top_k > 0) | (top_p < 1.0)).nonzero()[:, 0]
    out = scaled.clone()
    if rows.numel():
        out[rows] = filter_rows(scaled[rows], top_k[rows], top_p[rows])
    return out


top_k_top_p = define("top_k_top_p(Tensor scaled, Tensor top_k, Tensor top_p) -> Tensor",
                     fake=lambda scaled, top_k, top_p: torch.empty_like(scaled), reference=top_k_top_p_reference,
                     cuda=gpu_kernel("sampling", "top_k_top_p"))
