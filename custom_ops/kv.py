"""KV-cache write: the only way keys and values enter the cache."""

from __future__ import annotations

import torch

from .library import define


def kv_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       locations: torch.Tensor) -> None:
    """k_cache/v_cache [N, nkv, hd] (one layer, flattened locations); k/v [T, nkv, hd]; locations [T] int64.

    A negative location skips its token (a sliding layer's ring only keeps each sequence's last W).
    """
    keep = locations >= 0
    if k.device.type != "cpu":
        # No boolean indexing (a host sync, fatal under CUDA graphs): skipped rows rewrite what location 0
        # (slot 0 / page 0, the dummy) already holds.
        loc = locations.clamp(min=0)
        k_cache.index_copy_(0, loc, torch.where(keep[:, None, None], k, k_cache[loc]))
        v_cache.index_copy_(0, loc, torch.where(keep[:, None, None], v, v_cache[loc]))
        return
    loc = locations[keep]
    k_cache.index_copy_(0, loc, k[keep])
    v_cache.index_copy_(0, loc, v[keep])


kv_write = define(
    "kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor locations) -> ()",
    kv_write_reference, lambda k_cache, v_cache, k, v, locations: None)
