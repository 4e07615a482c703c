"""One memory budget for the state pool, split between slots, prefix checkpoints and KV pages.

What one unit of each costs follows from the config and dtype alone: a slot is every conv window of
every layer and stream (fp32) plus every sliding layer's ring of W keys and values; a checkpoint is a
slot's state again; a page is `page_size` keys and values of every global layer. The slots come first
(`max_batch_size` of them and the dummy), then the checkpoints, then pages take the rest.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import InklingConfig
from ..errors import OptionError
from ..streams import StreamTable


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    slot: int  # bytes of one slot's conv windows and sliding rings (and its row of speculative draft windows)
    page: int  # bytes of one KV page across the global layers
    checkpoint: int  # bytes of one prefix-cache checkpoint (a slot's state)

    @classmethod
    def of(cls, config: InklingConfig, page_size: int, dtype: torch.dtype, draft_tokens: int = 0) -> UnitCosts:
        """With K-token speculation (draft_tokens=K) a slot's rings are K entries longer and its batch row
        keeps a conv window per verify token (K+1 of them)."""
        streams, K = StreamTable(config), config.conv_kernel_size
        conv = sum(len(layers) * (K - 1) * streams.widths[name] * 4 for name, layers in streams.layers.items())
        itemsize = torch.empty(0, dtype=dtype).element_size()
        ring_size = config.sliding_window_size + draft_tokens
        ring = 2 * len(streams.sliding_layers) * ring_size * config.swa_num_key_value_heads \
            * config.swa_head_dim * itemsize
        page = 2 * len(streams.global_layers) * page_size * config.num_key_value_heads * config.head_dim * itemsize
        draft_windows = conv * (draft_tokens + 1) if draft_tokens else 0
        return cls(slot=conv + ring + draft_windows, page=page, checkpoint=conv + ring)


def split_budget(costs: UnitCosts, budget: int, *, max_batch_size: int, checkpoints: int | None,
                 min_pages: int) -> tuple[int, int]:
    """(pages including the dummy, checkpoints) that `budget` bytes hold beside max_batch_size slots.
    Checkpoints (None: the default) are 4 per slot, but never more than a quarter of what the slots
    leave, and at least one; a budget too small for the slots, the checkpoints and `min_pages` pages
    is an OptionError that says what they need."""
    # Every tensor counts its unused index 0 too: the dummy slot and page, checkpoint row 0.
    left = budget - (max_batch_size + 1) * costs.slot
    if checkpoints is None:  # the prefix cache is on: at least one, which it needs to resume from anything
        checkpoints = max(1, min(4 * max_batch_size, left // 4 // max(costs.checkpoint, 1) - 1))
    left -= (checkpoints + 1) * costs.checkpoint if checkpoints else 0
    pages = left // costs.page if costs.page else min_pages + 1
    if left < 0 or pages - 1 < min_pages:
        need = (max_batch_size + 1) * costs.slot + (checkpoints + 1) * costs.checkpoint \
            + (min_pages + 1) * costs.page
        raise OptionError(f"state_memory_bytes={budget} holds too little: {max_batch_size} slots "
                          f"({costs.slot} B each), {checkpoints} checkpoints ({costs.checkpoint} B each) and "
                          f"{min_pages} KV page(s) ({costs.page} B each) need {need} B")
    return pages, checkpoints
