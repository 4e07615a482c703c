"""The prefix cache's host tier (HiCache): evicted entries kept in host memory, loaded back layer by layer.

An entry evicted from the device keeps its place in the prefix tree with its data copied to host
tensors (pinned on CUDA): its KV page rows of every global layer and, if it had one, its checkpoint
(every conv window, every sliding ring). A request that resumes through such entries gets fresh device
pages (and a checkpoint) for them, and a `HostLoad` copies the data back on a background thread (on a
CUDA stream of its own on a GPU) one layer at a time, restoring the request's slot layer by layer as it goes. It is the pool's layer-transfer
counter while the request's first prefill chunk runs: the forward reads layer L only after
`wait_until(L)`, so loading overlaps the layers before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch

from ..streams import MODEL_STREAMS
from .pool import StatePool, each_layer


@dataclasses.dataclass
class HostCopy:
    kv: list[torch.Tensor] | None  # [k, v], each [global layers, page_size, nkv, hd]; None without a page
    conv: dict[str, torch.Tensor] | None  # pool stream -> [its layers, K-1, D]; None without a checkpoint
    rings: list[torch.Tensor] | None  # [k, v], each [sliding layers, ring_size, nkv, hd]

    @property
    def nbytes(self) -> int:
        tensors = [*(self.kv or []), *(self.conv or {}).values(), *(self.rings or [])]
        return sum(t.numel() * t.element_size() for t in tensors)


def _host(t: torch.Tensor) -> torch.Tensor:
    copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    copy.copy_(t)
    return copy


def host_nbytes(pool: StatePool, page: int | None, checkpoint: int | None) -> int:
    """What `copy_to_host` of this page and checkpoint would hold, without copying."""
    ps, R = pool.page_size, pool.ring_size
    size = 0
    if page is not None:
        size += sum(t[:ps].numel() * t.element_size() for t in each_layer(pool.global_kv))
    if checkpoint is not None:
        size += sum(t[:, 0].numel() * t.element_size() for t in pool.conv_checkpoints.values())
        size += sum(t[:, :R].numel() * t.element_size() for t in pool.ring_checkpoints)
    return size


def copy_to_host(pool: StatePool, page: int | None, checkpoint: int | None) -> HostCopy:
    ps, R = pool.page_size, pool.ring_size
    kv = ([_host(torch.stack([t[page * ps:(page + 1) * ps] for t in layers])) for layers in pool.global_kv]
          if page is not None else None)
    if checkpoint is None:
        return HostCopy(kv, None, None)
    conv = {name: _host(t[:, checkpoint]) for name, t in pool.conv_checkpoints.items()}
    rings = [_host(t[:, checkpoint * R:(checkpoint + 1) * R]) for t in pool.ring_checkpoints]
    return HostCopy(kv, conv, rings)


class HostLoad:
    """Copies host entries back into their new device pages and checkpoint, and the checkpoint into the
    resuming slot, one layer at a time on a thread; `wait_until(layer)` is the layer-transfer counter."""

    def __init__(self, pool: StatePool, pages: list[tuple[HostCopy, int]], checkpoint: tuple[HostCopy, int] | None,
                 slot: int):
        self.pool, self.pages, self.checkpoint, self.slot = pool, pages, checkpoint, slot
        self.done = [threading.Event() for _ in range(pool.config.num_hidden_layers)]
        self.error: BaseException | None = None
        device = pool.block_table.device
        # On CUDA the copies run on a stream of their own, so they overlap the forward's kernels.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # ...after what the stepping thread queued before (the slot's allocation clears its state).
        self.queued = torch.cuda.Event() if self.stream is not None else None
        if self.queued is not None:
            self.queued.record(torch.cuda.current_stream(device))
        self.thread = threading.Thread(target=self._run, daemon=True, name="inkling-host-load")

    def start(self) -> HostLoad:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                if self.queued is not None:
                    self.stream.wait_event(self.queued)
                for layer in range(len(self.done)):
                    self.copy_layer(layer)
                    if self.stream is not None:
                        self.stream.synchronize()  # the layer is in place before it is reported done
                    self.done[layer].set()
        except BaseException as e:  # surfaced by wait_until, on the stepping thread
            self.error = e
            for event in self.done:
                event.set()

    def copy_layer(self, layer: int) -> None:
        pool, ps, R = self.pool, self.pool.page_size, self.pool.ring_size
        sliding, index = pool.streams.kv_locate(layer)
        if not sliding:
            for host, page in self.pages:
                for device, saved in zip(pool.global_kv, host.kv):
                    device[index][page * ps:(page + 1) * ps].copy_(saved[index], non_blocking=True)
        if self.checkpoint is None:
            return
        host, checkpoint = self.checkpoint
        for stream in MODEL_STREAMS:
            name, i = pool.streams.locate(layer, stream)
            pool.conv_checkpoints[name][i, checkpoint].copy_(host.conv[name][i])
            pool.conv[name][i][self.slot].copy_(host.conv[name][i])
        if sliding:
            for ring, saved_ring, saved in zip(pool.sliding_kv, pool.ring_checkpoints, host.rings):
                saved_ring[index, checkpoint * R:(checkpoint + 1) * R].copy_(saved[index])
                ring[index][self.slot * R:(self.slot + 1) * R].copy_(saved[index])

    def wait_until(self, layer_id: int) -> None:
        self.done[layer_id].wait()
        if self.error is not None:
            raise RuntimeError(f"loading a cached prefix back from host memory failed: {self.error}") from self.error

    def join(self) -> None:
        self.thread.join()


class Loads:
    """The counter of a prefill step with several host loads: a layer is ready when it is in every one."""

    def __init__(self, loads: list[HostLoad]):
        self.loads = loads

    def wait_until(self, layer_id: int) -> None:
        for load in self.loads:
            load.wait_until(layer_id)
