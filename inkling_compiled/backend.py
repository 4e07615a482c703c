"""The step backend: the two things a step needs beside the model, side by side.

`buffers` (`metadata.StepBuffers`) are the graph-static buffers a step is prepared in, and `context`
(`contexts.PoolContext`) is what the model's layers call into over the pool. Both share the one
`StepMetadata`. This class only wires them; each half lives in its own module.
"""

from __future__ import annotations

import torch

from .cache import StatePool
from .config import InklingConfig
from .contexts import PoolContext
from .metadata import StepBuffers


class StepBackend:
    def __init__(self, pool: StatePool, config: InklingConfig, *, max_batch_size: int, max_tokens: int,
                 device: torch.device | str = "cpu", draft_tokens: int = 0):
        self.pool = pool
        self.buffers = StepBuffers(config, pool.block_table_host, page_size=pool.page_size,
                                   max_batch_size=max_batch_size, max_tokens=max_tokens, device=device,
                                   ring_size=pool.ring_size, draft_tokens=draft_tokens)
        self.metadata = self.buffers.metadata
        self.context = PoolContext(pool, config, self.metadata)
        self.prepare_decode = self.buffers.prepare_decode
        self.prepare_prefill = self.buffers.prepare_prefill
        self.prepare_extend = self.buffers.prepare_extend
        self.prepare_padding = self.buffers.prepare_padding
        self.prepare_verify = self.buffers.prepare_verify
        self.prepare_verify_padding = self.buffers.prepare_verify_padding
