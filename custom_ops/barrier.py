"""The HiCache layer-transfer barrier as an op, so the compiled step waits per layer without a break.

The op declares that it mutates the layer's state slices: that keeps it in the graph (a pure op with
no outputs is deleted as dead code) and orders it before every read of those slices. Its kernel asks
the counter registered under the pool's handle to wait for the layer. It is tagged cudagraph_unsafe,
so under CUDA graphs inductor runs it between graph partitions, on the host, at every replay.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from .library import define

class LayerTransferCounter(Protocol):
    """HiCache-style host->device loading: `wait_until(layer_id)` returns once that layer's state is in place."""

    def wait_until(self, layer_id: int) -> None: ...


_counters: dict[int, LayerTransferCounter | None] = {}
_handles = itertools.count(1)


def new_handle() -> int:
    """A stable id a pool keeps for life; the graph bakes it in, the counter behind it may change."""
    handle = next(_handles)
    _counters[handle] = None
    return handle


def set_counter(handle: int, counter: LayerTransferCounter | None) -> None:
    _counters[handle] = counter


def wait_layer_kernel(states: list[torch.Tensor], handle: int, layer_id: int) -> None:
    counter = _counters.get(handle)
    if counter is not None:
        counter.wait_until(layer_id)


# The tag arrived in later torch releases; without it the op still orders and waits, unpartitioned.
_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
# A host-side wait: the same kernel serves every device.
wait_layer = define("wait_layer(Tensor(a!)[] states, int handle, int layer_id) -> ()",
                    fake=lambda states, handle, layer_id: None, reference=wait_layer_kernel, cuda=wait_layer_kernel,
                    tags=_UNSAFE)
