"""KV-cache write: the only way keys and values enter the cache."""

from __future__ import annotations

import torch

from .library import define, gpu_kernel


def kv_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       locations: torch.Tensor) -> None:
    """k_cache/v_cache [N, nkv, hd] (one layer, flattened locations); k/v [T, nkv, hd]; locations [T] int64.

    A negative location skips its token (a sliding layer's ring only keeps each sequence's last W).
    """
    keep = locations >= 0
    loc = locations[keep]
    k_cache.index_copy_(0, loc, k[keep])
    v_cache.index_copy_(0, loc, v[keep])


kv_write = define(
    "kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor locations) -> ()",
    fake=lambda k_cache, v_cache, k, v, locations: None, reference=kv_write_reference,
    cuda=gpu_kernel("kv", "kv_write"))
