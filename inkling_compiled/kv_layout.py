"""Where a token's keys and values sit in the KV caches: the formulas every writer and reader shares.

Global layers keep K/V in pages of `page_size` rows, found through the slot's row of the block table;
sliding layers keep a ring of the last `window` keys per slot, entry `pos % window`. The functions take
numpy arrays (metadata prep) and torch tensors (kernels) alike.
"""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """KV pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def page_location(block_table, slot, pos, page_size: int):
    """Row of position `pos` of the request in `slot` in a global layer's paged cache."""
    return block_table[slot, pos // page_size] * page_size + pos % page_size


def ring_location(slot, pos, window: int):
    """Row of position `pos` of the request in `slot` in a sliding layer's ring."""
    return slot * window + pos % window
