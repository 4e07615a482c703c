"""KV-cache write: the only way keys and values enter the cache."""

from __future__ import annotations

import torch


@torch.library.custom_op("inkling::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             locations: torch.Tensor) -> None:
    """k_cache/v_cache [N, nkv, hd] (one layer, flattened locations); k/v [T, nkv, hd]; locations [T] int64.

    A negative location skips its token (a sliding layer's ring only keeps each sequence's last W).
    """
    keep = locations >= 0
    loc = locations[keep]
    k_cache.index_copy_(0, loc, k[keep])
    v_cache.index_copy_(0, loc, v[keep])


@kv_write.register_fake
def _(k_cache, v_cache, k, v, locations):
    return None
