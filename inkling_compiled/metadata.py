"""The per-step metadata: one `StepMetadata` object, and the graph-static buffers it is filled from.

Buffers are allocated once from the configured maxima and never grow: a step that does not fit
raises, naming the bound. `prepare_*` refills them in place, writing through numpy views of host
memory (no tensor is allocated per step), and points the single `StepMetadata` at leading slices of
them; the layers only read it. Nothing here touches the pool's state tensors: prep reads the host
mirror of the block table, nothing else.
"""

from __future__ import annotations

import typing
from typing import Annotated, NamedTuple

import msgspec
import numpy as np
import torch

from .config import InklingConfig
from .kv_layout import page_location, ring_location


class PerRow(NamedTuple):
    """A field with one entry per batch row (plus `extra`)."""

    dtype: torch.dtype
    extra: int = 0


class PerToken(NamedTuple):
    """A field with one entry per token of the step."""

    dtype: torch.dtype


class StepMetadata(msgspec.Struct):
    """What one forward needs to know about its batch. One object, refilled in place every step.

    B rows (requests, padded to the bucket on the compiled path) and T tokens (T == B in decode).
    Each tensor field says how its buffer is sized; the buffers are made from these annotations.
    """

    is_decode: bool
    input_ids: Annotated[torch.Tensor, PerToken(torch.int64)]  # the tokens this step feeds in
    cache_indices: Annotated[torch.Tensor, PerRow(torch.int32)]  # conv slot of each row (0 = dummy)
    query_start_loc: Annotated[torch.Tensor, PerRow(torch.int32, 1)]  # [B+1] packed token offsets
    has_initial_state: Annotated[torch.Tensor, PerRow(torch.bool)]  # the slot's conv window is this row's history
    seq_lens: Annotated[torch.Tensor, PerRow(torch.int32)]  # tokens in the cache once this step is written
    positions: Annotated[torch.Tensor, PerToken(torch.int64)]  # position of each token in its sequence
    global_kv_loc: Annotated[torch.Tensor, PerToken(torch.int64)]  # page location in global layers' caches
    sliding_kv_loc: Annotated[torch.Tensor, PerToken(torch.int64)]  # ring location in sliding layers (-1 = not kept)
    last_token_index: Annotated[torch.Tensor, PerRow(torch.int64)]  # packed index of each row's last token
    # per-row sampling parameters (the fields of RowSampling)
    temperature: Annotated[torch.Tensor, PerRow(torch.float32)]
    top_k: Annotated[torch.Tensor, PerRow(torch.int64)]
    top_p: Annotated[torch.Tensor, PerRow(torch.float32)]
    seed: Annotated[torch.Tensor, PerRow(torch.int64)]  # 32-bit key mixed from the request's 64-bit seed
    sample_counter: Annotated[torch.Tensor, PerRow(torch.int64)]  # index of the token being generated


BUFFER_SPECS: dict[str, PerRow | PerToken] = {
    name: hint.__metadata__[0]
    for name, hint in typing.get_type_hints(StepMetadata, include_extras=True).items()
    if hasattr(hint, "__metadata__")}


class RowSampling(msgspec.Struct, frozen=True):
    """Host-side sampling inputs of one row; field names are the metadata fields they fill."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    sample_counter: int


GREEDY_PAD = RowSampling(0.0, 0, 1.0, 0, 0)  # what padded rows sample with


def _mark_unbacked(view: torch.Tensor, shape_id: str) -> None:
    try:
        torch._dynamo.decorators.mark_unbacked(view, 0, shape_id=shape_id)
    except TypeError:  # a torch without shape ids (before 2.13): one symbol per slice
        torch._dynamo.decorators.mark_unbacked(view, 0)


class StepBuffers:
    """The static buffers behind the one `StepMetadata`, and the prep that fills them."""

    def __init__(self, config: InklingConfig, block_table_host: torch.Tensor, *, page_size: int,
                 max_batch_size: int, max_tokens: int, device: torch.device | str = "cpu"):
        self.page_size, self.window = page_size, config.sliding_window_size
        self.max_batch_size, self.max_tokens = max_batch_size, max(max_tokens, max_batch_size)
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros((max_batch_size + spec.extra) if isinstance(spec, PerRow) else self.max_tokens,
                              dtype=spec.dtype, device=self.device)
            for name, spec in BUFFER_SPECS.items()}
        self.metadata = StepMetadata(is_decode=True, **self.tensors)
        # Leading slices of the buffers, made once per length: a compiled step then sees the very same
        # tensor objects (and addresses) every time it replays its bucket.
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        # Set by a compiled decoder that serves many batch sizes with one graph: the slices of a batch
        # size in this range get a symbolic leading dimension. A range from 1 marks it unbacked (Dynamo
        # would otherwise specialise a size of one); from 2, dynamic with bounds.
        self.symbolic_batch: range | None = None
        # On CPU the host memory is the buffers themselves; elsewhere a host copy is staged, then copied over.
        self._staging = self.tensors if self.device.type == "cpu" else {
            name: torch.zeros_like(t, device="cpu") for name, t in self.tensors.items()}
        self._host = {name: t.numpy() for name, t in self._staging.items()}
        self._arange = np.arange(self.max_tokens + 1, dtype=np.int64)
        self._block_table = block_table_host.numpy()  # the pool's host mirror: shares its memory

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
        for name, buf in self.tensors.items():
            spec = BUFFER_SPECS[name]
            n = rows + spec.extra if isinstance(spec, PerRow) else tokens
            view = self._views.get((name, n))
            if view is None:
                view = self._views[(name, n)] = buf[:n]
                extra = spec.extra if isinstance(spec, PerRow) else 0
                self._mark_symbolic(view, n - extra, extra)
            if self._staging is not self.tensors:
                view.copy_(self._staging[name][:n], non_blocking=True)
            setattr(md, name, view)
        return md

    def _mark_symbolic(self, view: torch.Tensor, rows: int, extra: int) -> None:
        batch = self.symbolic_batch
        if batch is None or rows not in batch:
            return
        if batch.start <= 1:
            # One unbacked symbol for every slice of the batch's length (and one for B+1): inductor then
            # knows they are equal, fuses across them and checks it once per call.
            _mark_unbacked(view, f"rows+{extra}")
        else:
            torch._dynamo.mark_dynamic(view, 0, min=batch.start + extra, max=batch.stop - 1 + extra)

    def _fill_sampling(self, sampling: list[RowSampling], rows: int) -> None:
        h, n = self._host, len(sampling)
        for name in RowSampling.__struct_fields__:
            h[name][:n] = [getattr(s, name) for s in sampling]
            h[name][n:rows] = getattr(GREEDY_PAD, name)

    def _fill_kv_locations(self, tokens: int, slot: np.ndarray, pos: np.ndarray, ring_kept=None) -> None:
        """Both caches' write locations of each token; a sliding layer's ring skips (-1) the tokens
        outside `ring_kept` (those a longer prompt pushes out of the window before the step ends)."""
        h = self._host
        h["global_kv_loc"][:tokens] = page_location(self._block_table, slot, pos, self.page_size)
        ring = ring_location(slot, pos, self.window)
        h["sliding_kv_loc"][:tokens] = ring if ring_kept is None else np.where(ring_kept, ring, -1)

    def prepare_decode(self, input_ids: list[int], slots: list[int], cached_lens: list[int],
                       sampling: list[RowSampling], pad_to: int | None = None) -> StepMetadata:
        """One new token per row at position cached_lens[i]. Rows past len(slots) (up to pad_to) are
        padding: slot 0, position 0, and their writes land in slot 0 / page 0."""
        n, rows = len(slots), pad_to or len(slots)
        self._check_bounds(rows, rows)
        h = self._host
        for name, values in (("input_ids", input_ids), ("cache_indices", slots), ("positions", cached_lens)):
            h[name][:n] = values
            h[name][n:rows] = 0
        slot, pos = h["cache_indices"][:rows], h["positions"][:rows]
        np.add(pos, 1, out=h["seq_lens"][:rows], casting="unsafe")
        h["query_start_loc"][:rows + 1] = self._arange[:rows + 1]
        np.greater(slot, 0, out=h["has_initial_state"][:rows])
        h["last_token_index"][:rows] = self._arange[:rows]
        self._fill_kv_locations(rows, slot, pos)
        self._fill_sampling(sampling, rows)
        return self._publish(True, rows, rows)

    def prepare_padding(self, rows: int) -> StepMetadata:
        """A decode step of padding rows only: what warm-up and capture run (only the dummies are written)."""
        return self.prepare_decode([], [], [], [], pad_to=rows)

    def prepare_prefill(self, prompts: list[list[int]], slots: list[int], sampling: list[RowSampling]) -> StepMetadata:
        """Packed prompts that start from an empty state (positions 0..n-1 of each)."""
        rows = len(slots)
        lens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=rows)
        tokens = int(lens.sum())
        self._check_bounds(rows, tokens)
        h = self._host
        starts = np.cumsum(lens) - lens
        row_of = np.repeat(self._arange[:rows], lens)
        pos = self._arange[:tokens] - starts[row_of]
        h["input_ids"][:tokens] = [t for p in prompts for t in p]
        h["cache_indices"][:rows] = slots
        h["query_start_loc"][:rows] = starts
        h["query_start_loc"][rows] = tokens
        h["has_initial_state"][:rows] = False
        h["seq_lens"][:rows] = lens
        h["last_token_index"][:rows] = starts + lens - 1
        h["positions"][:tokens] = pos
        self._fill_kv_locations(tokens, np.asarray(slots, dtype=np.int64)[row_of], pos,
                                ring_kept=pos >= lens[row_of] - self.window)
        self._fill_sampling(sampling, rows)
        return self._publish(False, rows, tokens)
