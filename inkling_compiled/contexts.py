"""Forward contexts: what the model asks about where its tokens sit.

The model is math over packed tokens; anything that depends on a token's sequence, history or cache
is one of three calls on the context it is handed:

    ctx.enter_layer(layer_id)                         before a layer touches any state (HiCache barrier)
    ctx.short_conv(x32, weight, layer_id, stream)     conv(x32) without residual, fp32
    ctx.attention(layer_id, geometry, q, k, v, r, rel_proj) -> [T, nh, hd]

`FullSequenceContext` runs sequences from scratch, with no state. `PoolContext` answers from the
state pool for the batch the step's `StepMetadata` describes; it resolves each pool slice per call
and keeps none.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from . import custom_ops  # noqa: F401  (registers torch.ops.inkling)
from .attention import attend_from_scratch
from .cache import StatePool
from .config import InklingConfig, LayerGeometry
from .kv_layout import page_location, ring_location
from .custom_ops.reference import packed_causal_conv
from .metadata import StepMetadata
from .nvtx import nvtx_range
from .step_plan import Checkpoint
from .streams import STREAM_NAMES


class FullSequenceContext:
    """Sequences that start from an empty state (no cache, packed varlen)."""

    def __init__(self, lengths: list[int], config: InklingConfig, device):
        ends = list(itertools.accumulate(lengths))
        self.spans = list(zip([0] + ends[:-1], ends))  # (start, end) of each sequence in the packed tokens
        lens = torch.tensor(lengths, dtype=torch.long, device=device)
        self.seq_start = torch.tensor([s for s, _ in self.spans], device=device).repeat_interleave(lens)  # [T]
        self.positions = torch.arange(ends[-1] if ends else 0, device=device) - self.seq_start  # [T]
        self.config = config

    def enter_layer(self, layer_id: int) -> None:
        """No state, nothing to wait for."""

    def short_conv(self, x32: torch.Tensor, weight: torch.Tensor, layer_id: int, stream: int) -> torch.Tensor:
        return packed_causal_conv(x32, weight, self.seq_start)

    def attention(self, layer_id: int, g: LayerGeometry, q, k, v, r, rel_proj) -> torch.Tensor:
        return attend_from_scratch(self.config, g, q, k, v, r @ rel_proj, self.positions, self.spans)


class PoolContext:
    """The batch described by `metadata`, over the state pool: convs continue each slot's window,
    attention writes K/V into the caches and reads what each row may see."""

    def __init__(self, pool: StatePool, config: InklingConfig, metadata: StepMetadata):
        self.pool, self.config, self.metadata = pool, config, metadata
        # The prefix-cache checkpoints the extend step being run takes (its plan's), only while it runs.
        self.checkpoints: list[Checkpoint] = []
        self._conv_range_names = [[f"layer {i} sconv {s}" for s in STREAM_NAMES] for i in range(config.num_hidden_layers)]

    @contextlib.contextmanager
    def taking_checkpoints(self, checkpoints: list[Checkpoint]):
        """For the extend forward run inside: each checkpoint's row state is saved at its boundary."""
        self.checkpoints = checkpoints
        try:
            yield
        finally:
            self.checkpoints = []

    # ---- pool reads: one slice each, resolved per call ---------------------------------------------

    def conv_state_metadata(self) -> StepMetadata:
        return self.metadata

    def sconv_state(self, layer_id: int, stream: int) -> torch.Tensor:
        """This layer's conv windows for one stream: `[slots, K-1, D]`, a view of the pool tensor."""
        name, index = self.pool.layer_index(layer_id, stream)
        return self.pool.conv[name][index]

    def sconv_intermediate_window(self, layer_id: int, stream: int) -> torch.Tensor:
        """Per-row, per-draft-token windows for speculative verification: `[rows, T_d, K-1, D]`."""
        name, index = self.pool.layer_index(layer_id, stream)
        return self.pool.intermediate_conv_window[name][index]

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        (k, v), index = self.pool.kv_index(layer_id)
        return k[index], v[index]

    # ---- the forward-context calls ------------------------------------------------------------------

    def enter_layer(self, layer_id: int) -> None:
        """Compiled steps of a pool built for HiCache wait here, once per layer, before any state read."""
        if torch.compiler.is_compiling() and self.pool.layer_transfer:
            torch.ops.inkling.wait_layer(self.pool.layer_state(layer_id), self.pool.barrier_handle, layer_id)

    def short_conv(self, x32: torch.Tensor, weight: torch.Tensor, layer_id: int, stream: int) -> torch.Tensor:
        md = self.conv_state_metadata()
        state = self.sconv_state(layer_id, stream)
        with nvtx_range(self._conv_range_names[layer_id][stream]):  # eager steps; kernels label replays
            if md.draft_tokens:  # verify: the slot's window is only read; each token's window is saved
                return torch.ops.inkling.sconv_verify(x32, state, weight, md.cache_indices,
                                                      self.sconv_intermediate_window(layer_id, stream), layer_id, stream)
            if md.is_decode:
                return torch.ops.inkling.sconv_decode(x32, state, weight, md.cache_indices, layer_id, stream)
            before = state.index_select(0, md.cache_indices.long()) if self.checkpoints else None
            y = torch.ops.inkling.sconv_extend(x32, state, weight, md.query_start_loc, md.has_initial_state,
                                               md.cache_indices, layer_id, stream)
            if self.checkpoints:
                self.checkpoint_conv(x32, before, layer_id, stream)
            return y

    def checkpoint_conv(self, x32: torch.Tensor, before: torch.Tensor, layer_id: int, stream: int) -> None:
        """Eager prefill only: each checkpoint's conv window of this (layer, stream), the K-1 inputs
        before its boundary, out of the row's window before the step (`before`) and its chunk."""
        K = self.config.conv_kernel_size
        name, index = self.pool.layer_index(layer_id, stream)
        for c in self.checkpoints:
            # the window before the chunk (positions first-K+1 .. first-1), then at most the K-1 chunk
            # inputs before the boundary: the last K-1 of those rows are the window at the boundary
            end = c.packed_start + c.boundary - c.first
            inputs = torch.cat([before[c.row], x32[max(c.packed_start, end - (K - 1)):end]])
            self.pool.conv_checkpoints[name][index, c.index] = inputs[inputs.shape[0] - (K - 1):]

    def attention(self, layer_id: int, g: LayerGeometry, q, k, v, r, rel_proj) -> torch.Tensor:
        md = self.metadata
        k_cache, v_cache = self.kv_cache(layer_id)
        table = r @ rel_proj
        if not md.is_decode and not md.draft_tokens:
            return self.prefill_attention(layer_id, g, q, k, v, table, k_cache, v_cache)
        slots, seq_lens = md.cache_indices, md.seq_lens
        if md.draft_tokens:
            # Verify: every token is a decode row of its own. All K+1 keys are written first, so each
            # token reads the keys up to its own position (the ring has room for K more than the window).
            slots = md.cache_indices[:, None].expand(-1, md.draft_tokens + 1).reshape(-1)
            seq_lens = (md.positions + 1).to(torch.int32)
        torch.ops.inkling.kv_write(k_cache, v_cache, k, v, md.sliding_kv_loc if g.sliding else md.global_kv_loc)
        if g.sliding:
            return torch.ops.inkling.ring_attention(q, k_cache, v_cache, table, md.positions, slots, g.window,
                                                    g.rel_extent, self.pool.ring_size)
        tau = self.config.log_scale(md.positions) if g.log_scaling else None
        return torch.ops.inkling.paged_attention(q, k_cache, v_cache, table, tau, self.pool.block_table,
                                                 slots, seq_lens, self.pool.page_size, g.rel_extent)

    def prefill_attention(self, layer_id: int, g: LayerGeometry, q, k, v, table, k_cache, v_cache) -> torch.Tensor:
        """Each row is a chunk of its prompt: it attends to the keys cached before it (every earlier position
        on a global layer, the last W-1 on a sliding one) and causally to its own, which are then written.
        One `cached_extend_attention` call serves every row and reads each row's history from the cache
        itself, so nothing here looks at the data (a compiled extend step traces this); its kernels' memory
        is linear in the chunk plus the history read. The prefix-cache checkpoints of a sliding layer's ring
        are taken first, eagerly, from the ring as it is before the chunk's keys go in."""
        md = self.metadata
        if self.checkpoints and g.sliding:
            self._checkpoint_rings(layer_id, g, k, v, k_cache, v_cache)
        tau = self.config.log_scale(md.positions) if g.log_scaling else None
        return torch.ops.inkling.cached_extend_attention(
            q, k, v, k_cache, v_cache, table, tau, md.query_start_loc, md.positions, md.cache_indices,
            md.sliding_kv_loc if g.sliding else md.global_kv_loc, self.pool.block_table, self.pool.page_size,
            self.pool.ring_size, g.window or 0, g.rel_extent)

    def _checkpoint_rings(self, layer_id: int, g: LayerGeometry, k, v, k_cache, v_cache) -> None:
        """Eager prefill only: the ring checkpoints of the rows that take one, out of each row's history (read
        before its chunk's keys are written) and its chunk's own keys."""
        md = self.metadata
        qsl = md.query_start_loc.tolist()
        for row in sorted({c.row for c in self.checkpoints}):
            start, end = qsl[row], qsl[row + 1]
            first, slot = int(md.positions[start]), int(md.cache_indices[row])
            hk, hv, hpos = self._cached_keys(g, k_cache, v_cache, slot, first)
            self._checkpoint_ring(layer_id, row, torch.cat([hk, k[start:end]]), torch.cat([hv, v[start:end]]),
                                  first - len(hpos))

    def _checkpoint_ring(self, layer_id: int, row: int, keys, values, first_key: int) -> None:
        """This row's checkpoints of a sliding layer's ring (laid out as a slot's ring, R entries): entry
        p % R holds position p, for the W positions before the boundary (zero elsewhere, as in a fresh ring). `keys`/`values` hold the
        consecutive positions from `first_key`, which reach back far enough for any boundary in the chunk."""
        W, R = self.config.sliding_window_size, self.pool.ring_size
        _, index = self.pool.streams.kv_locate(layer_id)
        for ring, source in zip(self.pool.ring_checkpoints, (keys, values)):
            for c in self.checkpoints:
                if c.row != row:
                    continue
                saved = ring[index, c.index * R:(c.index + 1) * R]
                saved.zero_()
                p = torch.arange(max(0, c.boundary - W), c.boundary, device=saved.device)
                saved[p % R] = source[p - first_key]

    def _cached_keys(self, g: LayerGeometry, k_cache, v_cache, slot: int, first: int):
        """(keys, values, positions) a chunk starting at position `first` reads from the cache."""
        device = k_cache.device
        if g.sliding:  # the ring holds the last W positions; a query at `first` sees W-1 of them
            pos = torch.arange(max(0, first - g.window + 1), first, device=device)
            loc = ring_location(slot, pos, self.pool.ring_size)
        else:
            pos = torch.arange(first, device=device)
            loc = page_location(self.pool.block_table, slot, pos, self.pool.page_size).long()
        return k_cache[loc], v_cache[loc], pos
