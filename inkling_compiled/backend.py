"""The step backend: graph-static metadata buffers, the one per-step `StepMetadata`, and the forward
context the model's convs and attention call into.

Buffers are allocated once from the configured maxima and never grow: a step that does not fit
raises, naming the bound. `prepare_*` refills them in place and points the single `StepMetadata`
at slices of them; the layers only read it. The backend reaches the pool through `sconv_state`,
`sconv_intermediate_window` and `kv_cache` alone, each a single slice of a pool tensor, resolved
per call and never stored.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from . import custom_ops  # noqa: F401  (registers torch.ops.inkling)
from .attention import attend
from .cache import StatePool
from .config import InklingConfig, LayerGeometry
from .model import STREAM_NAMES, attend_from_scratch
from .nvtx import nvtx_range


class StepMetadata(msgspec.Struct):
    """What one forward needs to know about its batch. One object, refilled in place every step.

    B rows (requests, padded to the bucket on the compiled path) and T tokens (T == B in decode).
    """

    is_decode: bool
    input_ids: torch.Tensor  # [T] int64 the tokens this step feeds in
    cache_indices: torch.Tensor  # [B] int32 conv slot of each row (0 = dummy)
    query_start_loc: torch.Tensor  # [B+1] int32 packed token offsets
    has_initial_state: torch.Tensor  # [B] bool: the slot's conv window is this row's history
    seq_lens: torch.Tensor  # [B] int32 tokens in the cache once this step is written
    positions: torch.Tensor  # [T] int64 position of each token in its sequence
    token_seq_start: torch.Tensor  # [T] int64 packed index of the first token of each token's row
    global_kv_loc: torch.Tensor  # [T] int64 page location of each token in global layers' caches
    sliding_kv_loc: torch.Tensor  # [T] int64 ring location in sliding layers' caches (-1 = not kept)
    last_token_index: torch.Tensor  # [B] int64 packed index of each row's last token
    # per-row sampling parameters
    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64 (32-bit values)
    sample_counter: torch.Tensor  # [B] int64 index of the token being generated


_ROW_FIELDS = {  # name -> (dtype, extra length)
    "cache_indices": (torch.int32, 0), "query_start_loc": (torch.int32, 1), "has_initial_state": (torch.bool, 0),
    "seq_lens": (torch.int32, 0), "last_token_index": (torch.int64, 0), "temperature": (torch.float32, 0),
    "top_k": (torch.int64, 0), "top_p": (torch.float32, 0), "seed": (torch.int64, 0),
    "sample_counter": (torch.int64, 0),
}
_TOKEN_FIELDS = {"input_ids": torch.int64, "positions": torch.int64, "token_seq_start": torch.int64, "global_kv_loc": torch.int64,
                 "sliding_kv_loc": torch.int64}


class RowSampling(msgspec.Struct, frozen=True):
    """Host-side sampling inputs of one row."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    counter: int


GREEDY_PAD = RowSampling(0.0, 0, 1.0, 0, 0)


class StepBackend:
    def __init__(self, pool: StatePool, config: InklingConfig, *, max_batch_size: int, max_tokens: int,
                 device: torch.device | str = "cpu"):
        self.pool, self.config = pool, config
        self.max_batch_size, self.max_tokens = max_batch_size, max(max_tokens, max_batch_size)
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}
        for name, (dtype, extra) in _ROW_FIELDS.items():
            self.buffers[name] = torch.zeros(max_batch_size + extra, dtype=dtype, device=self.device)
        for name, dtype in _TOKEN_FIELDS.items():
            self.buffers[name] = torch.zeros(self.max_tokens, dtype=dtype, device=self.device)
        self.metadata = StepMetadata(is_decode=True, **self.buffers)
        # Leading slices of the buffers, made once per length: a compiled step then sees the very same
        # tensor objects (and addresses) every time it replays its bucket.
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        # Prep writes through numpy views of host memory: no tensor is allocated per step. On CPU the
        # host memory is the buffers themselves; elsewhere a host copy is staged, then copied over.
        self._staging = self.buffers if self.device.type == "cpu" else {
            name: torch.zeros_like(t, device="cpu") for name, t in self.buffers.items()}
        self._host = {name: t.numpy() for name, t in self._staging.items()}
        self._arange = np.arange(self.max_tokens + 1, dtype=np.int64)
        self._block_table = pool.block_table_host.numpy()
        self._conv_range_names = [[f"layer {i} sconv {s}" for s in STREAM_NAMES] for i in range(config.num_hidden_layers)]

    # ---- filling the metadata -------------------------------------------------------------------

    def _check_bounds(self, rows: int, tokens: int) -> None:
        if rows > self.max_batch_size:
            raise ValueError(f"step has {rows} rows; the metadata buffers were sized for max_batch_size="
                             f"{self.max_batch_size}")
        if tokens > self.max_tokens:
            raise ValueError(f"step has {tokens} tokens; the metadata buffers were sized for max_tokens={self.max_tokens}")

    def _publish(self, is_decode: bool, rows: int, tokens: int) -> StepMetadata:
        """Points the metadata at the filled leading slices (copying them to the device if staged)."""
        md = self.metadata
        md.is_decode = is_decode
        for name, buf in self.buffers.items():
            n = rows + _ROW_FIELDS[name][1] if name in _ROW_FIELDS else tokens
            view = self._views.get((name, n))
            if view is None:
                view = self._views[(name, n)] = buf[:n]
            if self._staging is not self.buffers:
                view.copy_(self._staging[name][:n], non_blocking=True)
            setattr(md, name, view)
        return md

    def _fill_sampling(self, sampling: list[RowSampling], rows: int) -> None:
        h, n = self._host, len(sampling)
        for name, attr, pad in (("temperature", "temperature", 0.0), ("top_k", "top_k", 0), ("top_p", "top_p", 1.0),
                                ("seed", "seed", 0), ("sample_counter", "counter", 0)):
            h[name][:n] = [getattr(s, attr) for s in sampling]
            h[name][n:rows] = pad

    def prepare_decode(self, input_ids: list[int], slots: list[int], cached_lens: list[int],
                       sampling: list[RowSampling], pad_to: int | None = None) -> StepMetadata:
        """One new token per row at position cached_lens[i]. Rows past len(slots) (up to pad_to) are
        padding: slot 0, position 0, and their writes land in slot 0 / page 0."""
        n, rows = len(slots), pad_to or len(slots)
        self._check_bounds(rows, rows)
        h, ps, W = self._host, self.pool.page_size, self.config.sliding_window_size
        for name, values in (("input_ids", input_ids), ("cache_indices", slots), ("positions", cached_lens)):
            h[name][:n] = values
            h[name][n:rows] = 0
        slot, pos = h["cache_indices"][:rows], h["positions"][:rows]
        np.add(pos, 1, out=h["seq_lens"][:rows], casting="unsafe")
        h["query_start_loc"][:rows + 1] = self._arange[:rows + 1]
        np.greater(slot, 0, out=h["has_initial_state"][:rows])
        h["last_token_index"][:rows] = self._arange[:rows]
        h["token_seq_start"][:rows] = self._arange[:rows]
        h["global_kv_loc"][:rows] = self._block_table[slot, pos // ps] * ps + pos % ps
        h["sliding_kv_loc"][:rows] = slot * W + pos % W
        self._fill_sampling(sampling, rows)
        return self._publish(True, rows, rows)

    def prepare_prefill(self, prompts: list[list[int]], slots: list[int], sampling: list[RowSampling]) -> StepMetadata:
        """Packed prompts that start from an empty state (positions 0..n-1 of each)."""
        rows = len(slots)
        lens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=rows)
        tokens = int(lens.sum())
        self._check_bounds(rows, tokens)
        h, ps, W = self._host, self.pool.page_size, self.config.sliding_window_size
        starts = np.cumsum(lens) - lens
        row_of = np.repeat(self._arange[:rows], lens)
        pos = self._arange[:tokens] - starts[row_of]
        slot = np.asarray(slots, dtype=np.int64)[row_of]
        h["input_ids"][:tokens] = [t for p in prompts for t in p]
        h["cache_indices"][:rows] = slots
        h["query_start_loc"][:rows] = starts
        h["query_start_loc"][rows] = tokens
        h["has_initial_state"][:rows] = False
        h["seq_lens"][:rows] = lens
        h["last_token_index"][:rows] = starts + lens - 1
        h["positions"][:tokens] = pos
        h["token_seq_start"][:tokens] = starts[row_of]
        h["global_kv_loc"][:tokens] = self._block_table[slot, pos // ps] * ps + pos % ps
        h["sliding_kv_loc"][:tokens] = np.where(pos >= lens[row_of] - W, slot * W + pos % W, -1)
        self._fill_sampling(sampling, rows)
        return self._publish(False, rows, tokens)

    # ---- pure reads -------------------------------------------------------------------------------

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

    # ---- forward context --------------------------------------------------------------------------

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
            return attend_from_scratch(self.config, g, q, k, v, table, md.positions, md.token_seq_start)
        tau = self.config.log_scale(md.positions) if g.log_scaling else None
        if g.sliding:
            return self._ring_attention(g, q, k_cache, v_cache, table)
        return torch.ops.inkling.paged_attention(q, k_cache, v_cache, table, tau, self.pool.block_table,
                                                 md.cache_indices, md.seq_lens, self.pool.page_size, g.rel_extent)

    def _ring_attention(self, g: LayerGeometry, q, k_cache, v_cache, table) -> torch.Tensor:
        """Decode on a sliding layer: the slot's ring holds the last W keys, the current one included."""
        md, W = self.metadata, g.window
        j = torch.arange(W, device=q.device)
        pos = md.positions[:, None]
        loc = md.cache_indices.long()[:, None] * W + j  # [B, W]
        k_pos = pos - torch.remainder(pos - j, W)  # newest position stored in ring entry j
        out = attend(q[:, None], k_cache[loc], v_cache[loc], table[:, None], q_pos=pos, k_pos=k_pos,
                     key_mask=(k_pos >= 0)[:, None, :], tau=None, window=W, rel_extent=g.rel_extent)
        return out[:, 0]
