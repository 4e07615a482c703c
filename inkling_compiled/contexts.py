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

import itertools

import torch

from . import custom_ops  # noqa: F401  (registers torch.ops.inkling)
from .attention import attend_from_scratch
from .cache import StatePool
from .cache.pool import BLOCK_TABLE_MIN_WIDTH, each_layer
from .config import InklingConfig, LayerGeometry
from .custom_ops.reference import packed_causal_conv
from .metadata import StepMetadata
from .nvtx import nvtx_range
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
        self._conv_range_names = [[f"layer {i} sconv {s}" for s in STREAM_NAMES] for i in range(config.num_hidden_layers)]

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
            # The prefix-cache checkpoints the step takes: the window at each boundary, before the slot's
            # changes (the layer's transfer was awaited for `state`; this lookup does not wait again).
            name, index = self.pool.streams.locate(layer_id, stream)
            torch.ops.inkling.sconv_checkpoint(x32, state, self.pool.conv_checkpoints[name], index, md.cache_indices,
                                               md.has_initial_state, md.query_start_loc, md.checkpoint_rows,
                                               md.checkpoint_ends, md.checkpoint_indices)
            return torch.ops.inkling.sconv_extend(x32, state, weight, md.query_start_loc, md.has_initial_state,
                                                  md.cache_indices, layer_id, stream)

    def commit_conv_windows(self, steps: torch.Tensor) -> None:
        """After a verify-kind forward: each row's slot takes, in every (stream, layer), the window saved after
        its token `steps[row]` (a negative step leaves the slot alone). The slots are this step's own
        metadata, read inside the step, so no later prep can have refilled them; a padding row commits to
        the dummy slot. The verify step commits its accepted drafts so, the MTP draft step its certain tokens."""
        pool = self.pool
        torch.ops.inkling.commit_conv_windows(each_layer(pool.conv.values()), pool.draft_windows(),
                                              self.metadata.cache_indices, steps)

    def block_table(self) -> torch.Tensor:
        """The pool's block table, with what the compiler may assume of its width. The width is a size
        symbol (one graph for every max_model_len), so without this the compiler cannot tell whether the
        table's row stride (its width) is 0 or 1: torch 2.11's inductor asks both of every input before
        it captures a CUDA graph, and fails the compile. The pool never makes it narrower."""
        table = self.pool.block_table
        torch._check(table.shape[1] >= BLOCK_TABLE_MIN_WIDTH)
        return table

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
        return torch.ops.inkling.paged_attention(q, k_cache, v_cache, table, tau, self.block_table(),
                                                 slots, seq_lens, self.pool.page_size, g.rel_extent)

    def prefill_attention(self, layer_id: int, g: LayerGeometry, q, k, v, table, k_cache, v_cache) -> torch.Tensor:
        """Each row is a chunk of its prompt: it attends to the keys cached before it (every earlier position
        on a global layer, the last W-1 on a sliding one) and causally to its own, which are then written.
        One `cached_extend_attention` call serves every row and reads each row's history from the cache
        itself, so nothing here looks at the data (a compiled extend step traces this); its kernels' memory
        is linear in the chunk plus the history read. A sliding layer's ring is checkpointed first, as it
        stands at each of the step's prefix-cache boundaries, before the chunk's keys go in."""
        md = self.metadata
        if g.sliding:
            _, index = self.pool.streams.kv_locate(layer_id)
            k_saved, v_saved = self.pool.ring_checkpoints
            torch.ops.inkling.ring_checkpoint(k, v, k_cache, v_cache, k_saved, v_saved, index, md.query_start_loc,
                                              md.positions, md.cache_indices, md.checkpoint_rows,
                                              md.checkpoint_boundaries, md.checkpoint_indices, self.pool.ring_size,
                                              g.window)
        tau = self.config.log_scale(md.positions) if g.log_scaling else None
        return torch.ops.inkling.cached_extend_attention(
            q, k, v, k_cache, v_cache, table, tau, md.query_start_loc, md.positions, md.cache_indices,
            md.sliding_kv_loc if g.sliding else md.global_kv_loc, self.block_table(), self.pool.page_size,
            self.pool.ring_size, g.window or 0, g.rel_extent)
