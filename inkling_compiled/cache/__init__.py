"""State that outlives a step: the conv-state pool, the KV caches and the request->slot/page maps."""

from .allocator import IndexAllocator
from .pool import LayerTransferCounter, StatePool

__all__ = ["StatePool", "IndexAllocator", "LayerTransferCounter"]
