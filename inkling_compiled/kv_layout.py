"""Where a token's keys and values sit in the KV caches: the formulas every writer and reader shares.

Global layers keep K/V in pages of `page_size` rows, found through the slot's row of the block table;
sliding layers keep a ring of `ring_size` entries per slot, position `pos` at entry `pos % ring_size`. The
ring is the window W, or W + K with K-token speculative verification: a verify step writes the keys of
positions p..p+K before any of its queries reads, and the query at p still needs p-W+1 onwards. The functions take
numpy arrays (metadata prep) and torch tensors (kernels) alike.
"""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """KV pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def page_location(block_table, slot, pos, page_size: int):
    """Row of position `pos` of the request in `slot` in a global layer's paged cache."""
    return block_table[slot, pos // page_size] * page_size + pos % page_size


def ring_location(slot, pos, ring_size: int):
    """Row of position `pos` of the request in `slot` in a sliding layer's ring."""
    return slot * ring_size + pos % ring_size
