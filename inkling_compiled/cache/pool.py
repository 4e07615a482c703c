"""The state pool: tensors allocated once, never moved, and the maps that say who owns what.

Every state tensor a step reads belongs to one layer: conv state, per pool stream, is a list with one
`[S+1, K-1, D_s]` fp32 tensor per layer of the stream (k/v widths differ between sliding and global
layers, so each has its own stream). Keys and values of global layers live in pages (`[k, v]`, each a
list of `[pages*page_size, nkv, hd]` per layer, page 0 the dummy) addressed through a per-slot block
table; sliding layers keep a ring of their recent keys per slot (`[(S+1)*R, nkv, hd]` per layer, R =
`ring_size`: the window W, plus K with K-token speculative verification). Slot 0 and page 0 are never
handed to a request.

One allocation per layer, not a stacked `[L, ...]` tensor, so that a compiled step never slices a layer
out of a pool tensor: the sizes set by `max_batch_size`, `num_pages` and `max_model_len` stay symbolic in
the graph (`mark_sizes_dynamic`), so one compiled graph, and inductor's cache of it, serves every pool
size. (A layer slice of a stacked tensor has a storage offset that grows with those sizes, and inductor
2.13 drops a symbolic storage offset of a graph-internal view: every layer would read layer 0's state.)

The pool stores: it hands out slots and pages, clears a slot's conv state on allocation, copies prefix
checkpoints in and answers `layer_index`; everything per step lives in the step backend, and who gets
what is the cache manager's to decide (`cache/manager.py`). It also holds the HiCache layer-transfer
counter and the barrier's handle, because every read of a layer's state is where the wait must happen. Which layers each conv stream
holds is `streams.StreamTable`'s to say.
"""

from __future__ import annotations

import torch

from ..config import InklingConfig
from ..custom_ops import barrier
from ..kv_layout import pages_for
from ..static import mark_static
from ..streams import MODEL_STREAMS, StreamTable
from .allocator import IndexAllocator

LayerTransferCounter = barrier.LayerTransferCounter
BLOCK_TABLE_MIN_WIDTH = 2


def each_layer(*groups) -> list[torch.Tensor]:
    """The tensors of groups of per-layer lists, one per layer (`each_layer(pool.conv.values())`: every
    conv stream's; `each_layer(pool.global_kv)`: every global layer's k, then v)."""
    return [t for group in groups for layers in group for t in layers]


def _mark_size(t: torch.Tensor, dim: int, shape_id: str) -> None:
    # Unbacked, since only those take a shape id; Dynamo never specialises them (a size of 1 included).
    try:
        torch._dynamo.decorators.mark_unbacked(t, dim, shape_id=shape_id)
    except TypeError:  # a torch without shape ids: one symbol per tensor
        torch._dynamo.decorators.mark_unbacked(t, dim)


class StatePool:
    def __init__(self, config: InklingConfig, *, max_slots: int, num_pages: int, page_size: int,
                 max_pages_per_seq: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 spec_draft_tokens: int = 0, layer_transfer: bool = False, checkpoints: int = 0):
        self.config = config
        self.max_slots, self.page_size, self.num_pages = max_slots, page_size, num_pages
        self.max_pages_per_seq = max_pages_per_seq
        K, S = config.conv_kernel_size, max_slots
        self.streams = streams = StreamTable(config)
        self.sliding_layers, self.global_layers = streams.sliding_layers, streams.global_layers
        def per_layer(count: int, *shape: int, dtype=torch.float32) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]

        self.conv = {name: per_layer(len(layers), S + 1, K - 1, streams.widths[name])
                     for name, layers in streams.layers.items()}
        # Speculative verification keeps the window after each draft token per batch row, not per slot.
        self.intermediate_conv_window = {
            name: per_layer(len(layers), S + 1, spec_draft_tokens, K - 1, streams.widths[name])
            for name, layers in streams.layers.items()}

        # A verify step writes K+1 keys before it reads: the ring keeps K more than the window.
        self.ring_size = R = config.sliding_window_size + max(spec_draft_tokens - 1, 0)
        g_kv = (config.num_key_value_heads, config.head_dim)
        s_kv = (config.swa_num_key_value_heads, config.swa_head_dim)
        self.global_kv = [per_layer(len(self.global_layers), num_pages * page_size, *g_kv, dtype=dtype)
                          for _ in range(2)] if self.global_layers else []
        self.sliding_kv = [per_layer(len(self.sliding_layers), (S + 1) * R, *s_kv, dtype=dtype)
                           for _ in range(2)] if self.sliding_layers else []
        # Prefix-cache checkpoints: a slot's whole per-request state at a page boundary (every conv
        # window, every sliding ring), kept so that a request starting with that prefix resumes from it.
        # Index 0 is unused (the allocator hands out 1..checkpoints).
        C = checkpoints
        rows = C + 1 if C else 0
        # Stacked `[L, ...]`: the extend step's checkpoint ops write a layer of one, the host tier copies them.
        self.conv_checkpoints = {name: torch.zeros(len(ts), rows, *ts[0].shape[1:], dtype=torch.float32, device=device)
                                 for name, ts in self.conv.items()}
        self.ring_checkpoints = [torch.zeros(len(ts), rows * R, *ts[0].shape[1:], dtype=dtype, device=device)
                                 for ts in self.sliding_kv]
        # Never narrower than BLOCK_TABLE_MIN_WIDTH columns (a step says so to the compiler, see
        # PoolContext.block_table); a column past max_pages_per_seq is never handed out.
        width = max(max_pages_per_seq, BLOCK_TABLE_MIN_WIDTH)
        self.block_table = torch.zeros(S + 1, width, dtype=torch.int32, device=device)
        self.block_table_host = torch.zeros(S + 1, width, dtype=torch.int32)  # mirror for prep

        # Static for Dynamo and CUDA graphs: a compiled step reads and writes them in place, at every replay.
        for t in self.static_tensors():
            mark_static(t)
        self.mark_sizes_dynamic()

        self.slots = IndexAllocator(S, "slot")
        self.pages = IndexAllocator(num_pages - 1, "page")
        self.page_refs = [0] * num_pages  # requests and prefix-cache entries holding each page
        self.checkpoints = IndexAllocator(C, "checkpoint")
        self.slot_of: dict[str, int] = {}
        self.pages_of: dict[str, list[int]] = {}
        # HiCache: whether compiled steps carry a per-layer barrier, and the handle its op waits on.
        self.layer_transfer = layer_transfer
        self.barrier_handle = barrier.new_handle()
        self.layer_transfer_counter: LayerTransferCounter | None = None

    # The writes outside a step that the other ranks of a tensor-parallel engine replay on their shards
    # (the cache manager journals them into each step plan).
    EFFECTS = ("reset_slot", "clear_block_row", "restore_checkpoint")

    def mark_sizes_dynamic(self) -> None:
        """The pool's sizes (slots, cache rows, block-table width, prefix checkpoints) become symbols in a
        compiled step, so that its graph, and inductor's cache of it, fits any `max_batch_size`,
        `num_pages`, `max_model_len` and `prefix_checkpoints`. Per-layer widths, the window and the ring's
        length per slot stay static.
        Tensors of one kind share one symbol (`shape_id`): the compiled step takes each symbol's value
        as an argument at every call, one per symbol, not one per tensor."""
        slots = each_layer(self.conv.values(), self.intermediate_conv_window.values()) + [self.block_table]
        for name, tensors in (("pool slots", slots), ("pool ring rows", each_layer(self.sliding_kv)),
                              ("pool page rows", each_layer(self.global_kv))):
            for t in tensors:
                _mark_size(t, 0, name)
        _mark_size(self.block_table, 1, "pool pages per slot")
        for t in self.conv_checkpoints.values():  # [layers, checkpoints, K-1, D]: an extend step writes them
            _mark_size(t, 1, "pool checkpoints")
        for t in self.ring_checkpoints:  # [layers, checkpoints x ring, ...]
            _mark_size(t, 1, "pool checkpoint ring rows")

    @staticmethod
    def mark_slot_rows(t: torch.Tensor) -> torch.Tensor:
        """A tensor kept beside the pool with one row per slot (the dummy's included) takes the pool's slot
        symbol, so a compiled step that reads it still fits every `max_batch_size`."""
        _mark_size(t, 0, "pool slots")
        return t

    # ---- ownership ------------------------------------------------------------------------------

    def pages_needed(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size) if self.global_layers else 0

    def can_admit(self, num_tokens: int, shared_pages: int = 0) -> bool:
        return self.slots.num_free > 0 and self.pages.num_free >= self.pages_needed(num_tokens) - shared_pages

    def allocate(self, request_id: str, num_tokens: int, shared_pages: list[int] = ()) -> int:
        """Reserves a slot and the pages for `num_tokens` tokens, the first of them `shared_pages` (a cached
        prefix's, read-only: the request writes only past them); clears the slot's conv state and its
        sliding-window rings, so nothing of the slot's previous request can be read."""
        if request_id in self.slot_of:
            raise KeyError(f"request {request_id!r} already holds slot {self.slot_of[request_id]}")
        need = self.pages_needed(num_tokens)
        if need > self.max_pages_per_seq:
            raise ValueError(f"{num_tokens} tokens need {need} pages; the block table holds {self.max_pages_per_seq}")
        shared = list(shared_pages)
        if not self.can_admit(num_tokens, len(shared)):
            raise RuntimeError(f"pool exhausted: {self.slots.num_free} slots and {self.pages.num_free} pages free, "
                               f"request needs 1 slot and {need - len(shared)} pages")
        (slot,) = self.slots.allocate(1)
        pages = shared + self.pages.allocate(need - len(shared))
        for page in pages:
            self.page_refs[page] += 1
        self.slot_of[request_id], self.pages_of[request_id] = slot, pages
        self.reset_slot(slot, pages)
        return slot

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id)
        for page in self.pages_of.pop(request_id):
            self.release_page(page)
        self.clear_block_row(slot)
        self.slots.free([slot])

    def reset_slot(self, slot: int, pages: list[int]) -> None:
        """The slot's block table row lists `pages`; its conv windows and rings are cleared."""
        row = self.block_table_host[slot]
        row.zero_()
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table[slot].copy_(row)
        R = self.ring_size
        torch._foreach_zero_([t[slot] for t in each_layer(self.conv.values())] +
                             [t[slot * R:(slot + 1) * R] for t in each_layer(self.sliding_kv)])

    def clear_block_row(self, slot: int) -> None:
        self.block_table[slot].zero_()
        self.block_table_host[slot].zero_()

    def retain_page(self, page: int) -> None:
        self.page_refs[page] += 1

    def release_page(self, page: int) -> None:
        """Drops one holder of the page; the last one returns it to the free list."""
        self.page_refs[page] -= 1
        if self.page_refs[page] == 0:
            self.pages.free([page])

    # ---- prefix-cache checkpoints ---------------------------------------------------------------

    def restore_checkpoint(self, slot: int, checkpoint: int) -> None:
        """The slot's conv windows and sliding rings become the checkpoint's (a copy: the slot's state is
        its own to change, the checkpoint stays for the next hit)."""
        for name, layers in self.conv.items():
            for i, t in enumerate(layers):
                t[slot] = self.conv_checkpoints[name][i, checkpoint]
        R = self.ring_size
        for rings, saved in zip(self.sliding_kv, self.ring_checkpoints):
            for i, ring in enumerate(rings):
                ring[slot * R:(slot + 1) * R] = saved[i, checkpoint * R:(checkpoint + 1) * R]

    # ---- layer lookup ---------------------------------------------------------------------------

    def register_layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        """Attach (or detach, with None) the counter every access to a layer's state waits on."""
        self.layer_transfer_counter = counter
        barrier.set_counter(self.barrier_handle, counter)

    def _wait_for(self, layer_id: int) -> None:
        # Inside a compiled step the wait is the `inkling::wait_layer` op the backend places at the
        # layer's entry; checking is_compiling() first keeps Dynamo from guarding on the counter.
        if not torch.compiler.is_compiling() and self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)

    def wait_for_all_layers(self) -> None:
        """Returns once every layer's transfer is done (a step whose graph has no per-layer barrier)."""
        if self.layer_transfer_counter is not None:
            for layer in range(self.config.num_hidden_layers):
                self.layer_transfer_counter.wait_until(layer)

    def layer_index(self, layer_id: int, stream: int) -> tuple[str, int]:
        """Waits for the layer's transfer (if a counter is attached); (pool stream, index in it)."""
        self._wait_for(layer_id)
        return self.streams.locate(layer_id, stream)

    def layer_state(self, layer_id: int) -> list[torch.Tensor]:
        """Every state slice of one layer (4 conv streams, then k and v caches), without waiting:
        what a HiCache transfer writes and what the layer's barrier declares it guards."""
        convs = [self.conv[name][i] for name, i in (self.streams.locate(layer_id, s) for s in MODEL_STREAMS)]
        sliding, index = self.streams.kv_locate(layer_id)
        return convs + [t[index] for t in (self.sliding_kv if sliding else self.global_kv)]

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors decode steps write, one per layer: every conv stream's and every K/V cache's
        (what a copy must never touch)."""
        return each_layer(self.conv.values(), self.global_kv, self.sliding_kv)

    def draft_windows(self) -> list[torch.Tensor]:
        """Every (stream, layer)'s per-draft-token windows of speculative verification, one per layer."""
        return each_layer(self.intermediate_conv_window.values())

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step may read or write: the state tensors, the draft windows, the block table."""
        return [*self.state_tensors(), *self.draft_windows(), self.block_table]

    def kv_index(self, layer_id: int) -> tuple[list[list[torch.Tensor]], int]:
        """Waits like `layer_index`; ([k, v] per-layer lists of the layer's kind, the layer's index in them)."""
        self._wait_for(layer_id)
        sliding, index = self.streams.kv_locate(layer_id)
        return (self.sliding_kv if sliding else self.global_kv), index
