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
            if md.is_decode:
                return torch.ops.inkling.sconv_decode(x32, state, weight, md.cache_indices, layer_id, stream)
            return torch.ops.inkling.sconv_extend(x32, state, weight, md.query_start_loc, md.has_initial_state,
                                                  md.cache_indices, layer_id, stream)

    def attention(self, layer_id: int, g: LayerGeometry, q, k, v, r, rel_proj) -> torch.Tensor:
        md = self.metadata
        k_cache, v_cache = self.kv_cache(layer_id)
        torch.ops.inkling.kv_write(k_cache, v_cache, k, v, md.sliding_kv_loc if g.sliding else md.global_kv_loc)
        table = r @ rel_proj
        if not md.is_decode:
            return self.prefill_attention(g, q, k, v, table)
        if g.sliding:
            return torch.ops.inkling.ring_attention(q, k_cache, v_cache, table, md.positions, md.cache_indices, g.window,
                                                    g.rel_extent)
        tau = self.config.log_scale(md.positions) if g.log_scaling else None
        return torch.ops.inkling.paged_attention(q, k_cache, v_cache, table, tau, self.pool.block_table,
                                                 md.cache_indices, md.seq_lens, self.pool.page_size, g.rel_extent)

    def prefill_attention(self, g: LayerGeometry, q, k, v, table) -> torch.Tensor:
        """Eager prefill only (never traced: the host-sync scan knows it as such): the packed spans are
        read on the host."""
        md = self.metadata
        qsl = md.query_start_loc.tolist()
        return attend_from_scratch(self.config, g, q, k, v, table, md.positions, list(zip(qsl[:-1], qsl[1:])))
