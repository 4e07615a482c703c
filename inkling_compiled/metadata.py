"""The per-step metadata: one `StepMetadata` object, and the graph-static buffers it is filled from.

The buffer is allocated once from the configured maxima and never grows: a step that does not fit
raises, naming the bound. `prepare_*` refills it in place, writing through numpy views of host
memory (no tensor storage is allocated per step), and points the single `StepMetadata` at the step's
fields in it; the layers only read it. Nothing here touches the pool's state tensors: prep reads the host
mirror of the block table, nothing else.
"""

from __future__ import annotations

import struct
import typing
from typing import Annotated, NamedTuple, Sequence

import msgspec
import numpy as np
import torch

from .config import InklingConfig
from .kv_layout import page_location, ring_location
from .static import mark_static


class PerRow(NamedTuple):
    """A field with one entry per batch row (plus `extra`)."""

    dtype: torch.dtype
    extra: int = 0


class PerToken(NamedTuple):
    """A field with one entry per token of the step."""

    dtype: torch.dtype


class PerCheckpoint(NamedTuple):
    """A field with one entry per prefix-cache checkpoint the step takes (extend steps only)."""

    dtype: torch.dtype


class StepMetadata(msgspec.Struct):
    """What one forward needs to know about its batch. One object, refilled in place every step.

    B rows (requests, padded to the bucket on the compiled path) and T tokens (T == B in decode,
    T == B * (draft_tokens + 1) in a speculative verify step, each row's tokens consecutive).
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
    drafted: Annotated[torch.Tensor, PerRow(torch.int64)]  # real drafts in a verify row (the rest stand in)
    # prefix-cache checkpoints an extend step takes on its way (see custom_ops/checkpoint.py); none otherwise
    checkpoint_rows: Annotated[torch.Tensor, PerCheckpoint(torch.int32)]  # the row whose state is saved
    checkpoint_ends: Annotated[torch.Tensor, PerCheckpoint(torch.int64)]  # packed index of the boundary's token
    checkpoint_boundaries: Annotated[torch.Tensor, PerCheckpoint(torch.int64)]  # the boundary's position
    checkpoint_indices: Annotated[torch.Tensor, PerCheckpoint(torch.int64)]  # the pool checkpoint written
    draft_tokens: int = 0  # K in a verify step (each row: its newest token, then K drafts); 0 otherwise


BUFFER_SPECS: dict[str, PerRow | PerToken | PerCheckpoint] = {
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
# Extend step shapes whose slices are kept (a compiled extend step binds a direct call to each; within
# `graphs.package.PackedForward.BOUND_LIMIT`).
EXTEND_SHAPES_KEPT = 32


def _mark_unbacked(view: torch.Tensor, shape_id: str) -> None:
    try:
        torch._dynamo.decorators.mark_unbacked(view, 0, shape_id=shape_id)
    except TypeError:  # a torch without shape ids (before 2.13): one symbol per slice
        torch._dynamo.decorators.mark_unbacked(view, 0)


def _mark_batch(view: torch.Tensor, spec: PerRow | PerToken, batch: range, tokens_per_row: int) -> None:
    """Gives a step's slice a symbolic leading dimension for the batch sizes in `batch`: rows (+ extra) for
    a per-row field, rows x tokens_per_row for a per-token one (the step checks that relation itself,
    `check_verify_shapes`)."""
    extra, per_row = (spec.extra, 1) if isinstance(spec, PerRow) else (0, tokens_per_row)
    if batch.start <= 1:
        # One unbacked symbol for every slice of the same length: inductor then knows they are equal,
        # fuses across them and checks it once per call.
        _mark_unbacked(view, f"rows+{extra}" if per_row == 1 else f"rows*{per_row}")
    elif per_row == 1:
        torch._dynamo.mark_dynamic(view, 0, min=batch.start + extra, max=batch.stop - 1 + extra)
    else:  # its size is a multiple of the rows', which Dynamo learns from the step: not a free dimension
        torch._dynamo.maybe_mark_dynamic(view, 0)


def _mark_extend(view: torch.Tensor, spec: PerRow | PerToken | PerCheckpoint) -> None:
    """An extend step's slice with a symbolic leading dimension: its rows (+ extra), its tokens or its
    checkpoints, unbacked (any size, one and zero included), so one graph serves every chunk."""
    _mark_unbacked(view, f"extend rows+{spec.extra}" if isinstance(spec, PerRow) else
                   "extend tokens" if isinstance(spec, PerToken) else "extend checkpoints")


def _slices(region: FieldRegion, rows: int, tokens: int, checkpoints: int) -> dict[str, torch.Tensor]:
    """A step's leading slice of each of the region's fields."""
    return {name: field[:_entries(spec, rows, tokens, checkpoints)]
            for (name, field), spec in zip(region.fields.items(), BUFFER_SPECS.values())}


def check_verify_shapes(md: StepMetadata) -> int:
    """Tells the compiler how a verify step's slices relate (each its own symbol when marked): B + extra
    entries per row, B x (K+1) per token, B the rows. Returns B. Checked at run time too."""
    rows = md.cache_indices.shape[0]
    for name, spec in BUFFER_SPECS.items():
        if isinstance(spec, PerCheckpoint):
            continue
        size = getattr(md, name).shape[0]
        torch._check(size == (rows + spec.extra if isinstance(spec, PerRow) else rows * (md.draft_tokens + 1)))
    return rows


_ALIGN = 16  # bytes: every field starts aligned for its dtype (and for vector loads)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}
_STRUCT = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.bool: "?"}  # native order, as numpy's
_STRUCT_CODES = {name: _STRUCT[spec.dtype] for name, spec in BUFFER_SPECS.items()}  # each field's `struct` code


def _entries(spec: PerRow | PerToken | PerCheckpoint, rows: int, tokens: int, checkpoints: int) -> int:
    """A field's length in a step of `rows` rows, `tokens` tokens and `checkpoints` checkpoints."""
    return rows + spec.extra if isinstance(spec, PerRow) else tokens if isinstance(spec, PerToken) else checkpoints


class FieldRegion:
    """Every metadata field, for up to `rows` rows, `tokens` tokens and `checkpoints` checkpoints, at a
    fixed offset in one byte buffer (per-token fields last, so a small step's fields end early): one
    host-to-device copy moves a step. On CPU the host side is the buffer itself. Elsewhere it is a host
    copy (pinned on CUDA), copied with one non-blocking copy; an event makes the next prep wait until that
    copy has read it."""

    def __init__(self, rows: int, tokens: int, device: torch.device, staged: bool | None = None,
                 checkpoints: int = 0):
        self.checkpoints = checkpoints
        lengths = {name: _entries(spec, rows, tokens, checkpoints) for name, spec in BUFFER_SPECS.items()}
        order = sorted(BUFFER_SPECS, key=lambda name: [PerRow, PerCheckpoint, PerToken].index(type(BUFFER_SPECS[name])))
        self.offsets, offset = {}, 0
        for name in order:
            self.offsets[name] = offset
            offset += -(-lengths[name] * BUFFER_SPECS[name].dtype.itemsize // _ALIGN) * _ALIGN
        self.last = order[-1]
        self.bytes = mark_static(torch.zeros(offset, dtype=torch.uint8, device=device))
        if staged is None:
            staged = device.type != "cpu"
        elif not staged and device.type != "cpu":
            raise ValueError(f"metadata on {device} needs a host copy to be written through (staged=True)")
        # (a CPU buffer may stage too: tests check the copy path that way)
        self.staging = torch.zeros(offset, dtype=torch.uint8, pin_memory=device.type == "cuda") if staged else self.bytes
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        host_bytes = self.staging.numpy()
        self.fields: dict[str, torch.Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        for name, n in lengths.items():
            dtype, start = BUFFER_SPECS[name].dtype, self.offsets[name]
            end = start + n * dtype.itemsize
            # A tensor of its own over a slice of the buffer's storage, not a view of the buffer: a view's
            # storage offset becomes a symbol in the compiled graph, and inductor has mishandled those.
            field = torch.empty(0, dtype=dtype, device=device).set_(self.bytes.untyped_storage()[start:end], 0, (n,))
            self.fields[name] = mark_static(field)
            self.host[name] = host_bytes[start:end].view(_NUMPY[dtype])
        self._bytes = host_bytes  # (an array, not a memoryview: the step's package pickles what it reaches)

    def writable(self) -> dict[str, np.ndarray]:
        """The host fields, once the previous copy has finished reading them."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def write(self, name: str, values: list) -> None:
        """A field's leading entries from a list, packed straight into the host bytes. A decode step's
        prep runs cold, after the kernels have swept the caches, and there one `struct` call a field costs
        about half of numpy's assignments and arithmetic on a few entries."""
        struct.pack_into(f"{len(values)}{_STRUCT_CODES[name]}", self._bytes, self.offsets[name], *values)

    def write_sampling(self, sampling: list[RowSampling], rows: int) -> None:
        """Each sampling field's first `rows` entries: the rows' own, then padding rows' (greedy)."""
        padded = list(sampling) + [GREEDY_PAD] * (rows - len(sampling))
        for name in RowSampling.__struct_fields__:
            self.write(name, [getattr(row, name) for row in padded])

    def used(self, tokens: int) -> int:
        """Bytes a step with `tokens` tokens uses (up to the last field's used part)."""
        return self.offsets[self.last] + tokens * BUFFER_SPECS[self.last].dtype.itemsize

    def publish(self, tokens: int) -> None:
        """One copy of the bytes a step with `tokens` tokens uses."""
        if self.staging is not self.bytes:
            used = self.used(tokens)
            self.bytes[:used].copy_(self.staging[:used], non_blocking=True)
            if self._copied is not None:  # on the stream the copy ran on: the device's, not the current one
                self._copied.record(torch.cuda.current_stream(self.bytes.device))


class StepBuffers:
    """The static buffers behind the one `StepMetadata`, and the prep that fills them.

    Decode steps (one token per row) fill a region sized for the largest batch, prefill steps one sized
    for the most tokens a step may take (`FieldRegion`); either way one copy moves a step's metadata.
    A decode step's fields are leading slices made once per batch size and kept, so a compiled graph
    sees the same tensors (and addresses) every time it replays its bucket; all of it is marked static."""

    def __init__(self, config: InklingConfig, block_table_host: torch.Tensor, *, page_size: int,
                 max_batch_size: int, max_tokens: int, device: torch.device | str = "cpu", staged: bool | None = None,
                 ring_size: int | None = None, draft_tokens: int = 0):
        self.page_size, self.window = page_size, config.sliding_window_size
        self.ring_size = ring_size or self.window
        self.max_batch_size, self.max_tokens = max_batch_size, max(max_tokens, max_batch_size)
        self.device = torch.device(device)
        self.decode_region = FieldRegion(max_batch_size, max_batch_size, self.device, staged)
        # An extend step's chunks cross at most one page boundary per page of tokens, plus one per row.
        self.prefill_region = FieldRegion(max_batch_size, self.max_tokens, self.device, staged,
                                          checkpoints=self.max_tokens // page_size + max_batch_size)
        self.draft_tokens = draft_tokens
        self.verify_region = FieldRegion(max_batch_size, max_batch_size * (draft_tokens + 1), self.device, staged) \
            if draft_tokens else None
        self.metadata = StepMetadata(is_decode=True, **self.decode_region.fields)
        # Per step kind ("decode", "verify"), set by its compiled step when one graph serves many batch
        # sizes: the slices of a batch size in this range get a symbolic leading dimension. A range from 1
        # marks it unbacked (Dynamo would otherwise specialise a size of one); from 2, dynamic with bounds.
        self.symbolic_batch: dict[str, range | None] = {"decode": None, "verify": None}
        # Set by a compiled extend step: every extend step's slices get symbolic rows and tokens.
        self.symbolic_extend = False
        # Per step kind, rows -> the fields of a step of that many rows, kept: a graph replays on them.
        self._kept_views: dict[str, dict[int, dict[str, torch.Tensor]]] = {"decode": {}, "verify": {}}
        # Extend steps' fields per (rows, tokens, checkpoints), least recently used first; and whether the
        # extend step last published is of a shape kept from an earlier step.
        self._kept_extend: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self.extend_shape_seen = False
        self._arange = np.arange(max(self.max_tokens, max_batch_size * (draft_tokens + 1)) + 1, dtype=np.int64)
        self._block_table = block_table_host.numpy()  # the pool's host mirror: shares its memory
        # A decode step's packed offsets and last-token indices are 0, 1, 2, ... whatever its rows: written once.
        decode = self.decode_region.host
        decode["query_start_loc"][:] = self._arange[:len(decode["query_start_loc"])]
        decode["last_token_index"][:] = self._arange[:len(decode["last_token_index"])]
        if self.verify_region is not None:  # and a verify step's: row i's tokens are i * (K+1) .. i * (K+1) + K
            verify, T_d = self.verify_region.host, draft_tokens + 1
            verify["query_start_loc"][:] = self._arange[:len(verify["query_start_loc"])] * T_d
            verify["last_token_index"][:] = self._arange[:len(verify["last_token_index"])] * T_d + T_d - 1
        self._h = self.decode_region.host  # the host fields of the step being prepared
        self.last_step: tuple[str, int, int, int] | None = None  # (kind, rows, tokens, checkpoints) last published
        self.published: dict[str, torch.Tensor] | None = None  # the fields of the step last published

    def _region(self, kind: str) -> FieldRegion:
        return {"decode": self.decode_region, "prefill": self.prefill_region, "verify": self.verify_region}[kind]

    def _host(self, kind: str) -> dict[str, np.ndarray]:
        self._h = self._region(kind).writable()
        return self._h

    def _check_bounds(self, rows: int, tokens: int) -> None:
        if rows > self.max_batch_size:
            raise ValueError(f"step has {rows} rows; the metadata buffers were sized for max_batch_size="
                             f"{self.max_batch_size}")
        if tokens > self.max_tokens:
            raise ValueError(f"step has {tokens} tokens; the metadata buffers were sized for max_tokens={self.max_tokens}")

    def _publish(self, kind: str, rows: int, tokens: int, checkpoints: int = 0) -> StepMetadata:
        """Copies the step's metadata to the device (if staged) and points the metadata at its fields."""
        region = self._region(kind)
        region.publish(tokens)
        self.last_step = (kind, rows, tokens, checkpoints)
        if kind == "prefill":
            return self._point_at(self._extend_views(region, rows, tokens, checkpoints), kind)
        kept = self._kept_views.get(kind)
        views = kept.get(rows) if kept is not None else None
        if views is None:
            views = _slices(region, rows, tokens, checkpoints)
            if kept is not None:  # kept: a graph replays its bucket on these very tensors
                kept[rows] = views
                batch = self.symbolic_batch[kind]
                for name, view in views.items():
                    mark_static(view)
                    if batch is not None and rows in batch and not isinstance(BUFFER_SPECS[name], PerCheckpoint):
                        _mark_batch(view, BUFFER_SPECS[name], batch, self.draft_tokens + 1 if kind == "verify" else 1)
        return self._point_at(views, kind)

    def _extend_views(self, region: FieldRegion, rows: int, tokens: int, checkpoints: int
                      ) -> dict[str, torch.Tensor]:
        """An extend step's slices, kept per shape for the shapes seen last (`EXTEND_SHAPES_KEPT`): a prompt's
        chunks of one length, or prompts of one length arriving one by one, are steps of one shape, and
        the compiled extend step calls its graph directly on the slices it has seen (as a decode bucket's;
        `Runner._run_compiled` binds a shape at its second step)."""
        key = (rows, tokens, checkpoints)
        views = self._kept_extend.pop(key, None)
        self.extend_shape_seen = views is not None
        if views is None:
            views = _slices(region, rows, tokens, checkpoints)
            if self.symbolic_extend:
                for name, view in views.items():
                    _mark_extend(view, BUFFER_SPECS[name])
            if len(self._kept_extend) >= EXTEND_SHAPES_KEPT:
                self._kept_extend.pop(next(iter(self._kept_extend)))  # the least recently used
        self._kept_extend[key] = views  # (last: the most recently used)
        return views

    def _point_at(self, views: dict[str, torch.Tensor], kind: str) -> StepMetadata:
        # What the metadata points at: for each step kind and shape, the same dict at every step
        self.published = views
        md = self.metadata
        md.is_decode = kind == "decode"
        md.draft_tokens = self.draft_tokens if kind == "verify" else 0
        for name, view in views.items():
            setattr(md, name, view)
        return md

    def mark_for_tracing(self, kind: str, batch: range | None) -> None:
        """From now on the slices of `kind` steps ("decode" or "verify") are marked for `batch` (see
        `symbolic_batch`): the slices kept so far are dropped, and the step last prepared, if of that
        kind, is published again on new, marked ones."""
        self.symbolic_batch[kind] = batch
        self._kept_views[kind].clear()
        if self.last_step is not None and self.last_step[0] == kind:
            self._publish(*self.last_step)

    def mark_extend_for_tracing(self) -> None:
        """From now on extend steps' slices are marked (see `symbolic_extend`); the step last prepared, if an
        extend step, is published again on marked ones."""
        self.symbolic_extend = True
        self._kept_extend.clear()
        if self.last_step is not None and self.last_step[0] == "prefill":
            self._publish(*self.last_step)

    def _fill_sampling(self, sampling: list[RowSampling], rows: int) -> None:
        h, n = self._h, len(sampling)
        for name in RowSampling.__struct_fields__:
            h[name][:n] = [getattr(s, name) for s in sampling]
            h[name][n:rows] = getattr(GREEDY_PAD, name)

    def _fill_kv_locations(self, tokens: int, slot: np.ndarray, pos: np.ndarray, ring_kept=None) -> None:
        """Both caches' write locations of each token; a sliding layer's ring skips (-1) the tokens
        outside `ring_kept` (those a longer prompt pushes out of the window before the step ends)."""
        h = self._h
        h["global_kv_loc"][:tokens] = page_location(self._block_table, slot, pos, self.page_size)
        ring = ring_location(slot, pos, self.ring_size)
        h["sliding_kv_loc"][:tokens] = ring if ring_kept is None else np.where(ring_kept, ring, -1)

    def prepare_decode(self, input_ids: list[int], slots: list[int], cached_lens: list[int],
                       sampling: list[RowSampling], pad_to: int | None = None) -> StepMetadata:
        """One new token per row at position cached_lens[i]. Rows past len(slots) (up to pad_to) are
        padding: slot 0, position 0, and their writes land in slot 0 / page 0. Computed on Python lists and
        packed a field at a time (`FieldRegion.write`); query_start_loc and last_token_index are fixed."""
        n, rows = len(slots), pad_to or len(slots)
        self._check_bounds(rows, rows)
        if not len(input_ids) == len(cached_lens) == len(sampling) == n <= rows:  # or a field spills into the next
            raise ValueError(f"a decode step takes a token, a position and sampling per slot, padded to at least its "
                             f"rows: {len(input_ids)} tokens, {n} slots, {len(cached_lens)} positions, "
                             f"{len(sampling)} sampling rows, padded to {rows}")
        self._host("decode")
        region, pad = self.decode_region, [0] * (rows - n)
        slot, pos = slots + pad, cached_lens + pad
        region.write("input_ids", input_ids + pad)
        region.write("cache_indices", slot)
        region.write("positions", pos)
        region.write("seq_lens", [p + 1 for p in pos])
        region.write("has_initial_state", [s > 0 for s in slot])
        table, page_size, ring_size = self._block_table, self.page_size, self.ring_size
        region.write("global_kv_loc", [page_location(table, s, p, page_size) for s, p in zip(slot, pos)])
        region.write("sliding_kv_loc", [ring_location(s, p, ring_size) for s, p in zip(slot, pos)])
        region.write_sampling(sampling, rows)
        return self._publish("decode", rows, rows)

    def prepare_padding(self, rows: int) -> StepMetadata:
        """A decode step of padding rows only: what warm-up and capture run (only the dummies are written)."""
        return self.prepare_decode([], [], [], [], pad_to=rows)

    def prepare_prefill(self, prompts: list[list[int]], slots: list[int], sampling: list[RowSampling]) -> StepMetadata:
        """Packed prompts that start from an empty state (positions 0..n-1 of each)."""
        return self.prepare_extend(prompts, [0] * len(prompts), slots, sampling)

    def prepare_extend(self, chunks: list[list[int]], starts: list[int], slots: list[int],
                       sampling: list[RowSampling], checkpoints: Sequence = ()) -> StepMetadata:
        """Packed chunks of prompts, each continuing its slot's state: chunk i holds the tokens at
        positions starts[i].. of its request, whose first starts[i] tokens are in the pool already (their
        conv windows in the slot, their keys in the caches). `checkpoints`: the prefix-cache checkpoints
        the step takes on its way (`step_plan.Checkpoint`s: row, packed_start, first, boundary, index)."""
        rows = len(slots)
        if len(checkpoints) > self.prefill_region.checkpoints:
            raise ValueError(f"step takes {len(checkpoints)} checkpoints; the metadata buffers were sized for "
                             f"{self.prefill_region.checkpoints}")
        lens = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=rows)
        first = np.asarray(starts, dtype=np.int64)
        tokens = int(lens.sum())
        self._check_bounds(rows, tokens)
        h = self._host("prefill")
        packed_start = np.cumsum(lens) - lens
        row_of = np.repeat(self._arange[:rows], lens)
        pos = self._arange[:tokens] - packed_start[row_of] + first[row_of]
        seq_lens = first + lens
        h["input_ids"][:tokens] = [t for c in chunks for t in c]
        h["cache_indices"][:rows] = slots
        h["query_start_loc"][:rows] = packed_start
        h["query_start_loc"][rows] = tokens
        h["has_initial_state"][:rows] = first > 0
        h["seq_lens"][:rows] = seq_lens
        h["last_token_index"][:rows] = packed_start + lens - 1
        h["positions"][:tokens] = pos
        # A sliding layer's ring keeps each sequence's last W positions once the chunk is written.
        self._fill_kv_locations(tokens, np.asarray(slots, dtype=np.int64)[row_of], pos,
                                ring_kept=pos >= seq_lens[row_of] - self.window)
        self._fill_sampling(sampling, rows)
        n = len(checkpoints)
        h["checkpoint_rows"][:n] = [c.row for c in checkpoints]
        h["checkpoint_ends"][:n] = [c.packed_start + c.boundary - c.first for c in checkpoints]
        h["checkpoint_boundaries"][:n] = [c.boundary for c in checkpoints]
        h["checkpoint_indices"][:n] = [c.index for c in checkpoints]
        return self._publish("prefill", rows, tokens, n)

    def prepare_extend_padding(self) -> StepMetadata:
        """An extend step of one padding row (two tokens on the dummy slot): what the compiled extend
        step's warm-up runs (only the dummies are written)."""
        return self.prepare_extend([[0, 0]], [0], [0], [GREEDY_PAD])

    def prepare_verify(self, tokens: list[list[int]], slots: list[int], cached_lens: list[int], limits: list[int],
                       drafted: list[int], sampling: list[RowSampling], pad_to: int | None = None) -> StepMetadata:
        """A speculative verify step: row i feeds tokens[i] (its newest token, then `draft_tokens` drafts) at
        positions cached_lens[i].., continuing its slot's state without changing it; the first drafted[i]
        drafts are real, the rest stand-ins. A token at or past
        limits[i] (beyond the row's pages: what it predicts could never be emitted) writes its keys to the
        dummy page, skips the ring and reads as if at position limits[i]-1, so nothing is read or written out
        of the row's bounds. Padded rows are slot 0 at positions 0..K, as in decode."""
        n, rows, T_d = len(slots), pad_to or len(slots), self.draft_tokens + 1
        if not self.draft_tokens:
            raise ValueError("these step buffers were made without draft tokens (draft_tokens=0): no verify steps")
        self._check_bounds(rows, rows)
        if not len(tokens) == len(cached_lens) == len(limits) == len(drafted) == len(sampling) == n <= rows \
                or any(len(row) != T_d for row in tokens):  # or a field spills into the next
            raise ValueError(f"a verify step takes {T_d} tokens, a position, a limit, a draft count and sampling per "
                             f"slot, padded to at least its rows: {len(tokens)} token rows, {n} slots, "
                             f"{len(cached_lens)} positions, {len(limits)} limits, {len(drafted)} counts, "
                             f"{len(sampling)} sampling rows, padded to {rows}")
        # Packed from Python lists a field at a time, as a decode step's are (`FieldRegion.write`): numpy's
        # calls on a few entries cost more than the entries; query_start_loc and last_token_index are fixed.
        self._host("verify")
        region, pad = self.verify_region, [0] * (rows - n)
        slot, first, limit = list(slots) + pad, list(cached_lens) + pad, list(limits) + [1] * (rows - n)
        region.write("input_ids", [t for row in tokens for t in row] + [0] * (len(pad) * T_d))
        region.write("cache_indices", slot)
        region.write("seq_lens", [p + 1 for p in first])
        region.write("drafted", list(drafted) + pad)
        region.write("has_initial_state", [s > 0 for s in slot])
        table, page_size, ring_size = self._block_table, self.page_size, self.ring_size
        dummy = page_location(table, 0, 0, page_size)
        positions, global_loc, sliding_loc = [], [], []
        for s, p0, end in zip(slot, first, limit):
            for p in range(p0, p0 + T_d):
                if p < end:
                    positions.append(p)
                    global_loc.append(page_location(table, s, p, page_size))
                    sliding_loc.append(ring_location(s, p, ring_size))
                else:  # past the row's pages: the dummy page, no ring entry, read as at end - 1
                    positions.append(end - 1)
                    global_loc.append(dummy)
                    sliding_loc.append(-1)
        region.write("positions", positions)
        region.write("global_kv_loc", global_loc)
        region.write("sliding_kv_loc", sliding_loc)
        region.write_sampling(sampling, rows)
        return self._publish("verify", rows, rows * T_d)

    def prepare_verify_padding(self, rows: int) -> StepMetadata:
        """A verify step of padding rows only (warm-up and capture)."""
        return self.prepare_verify([], [], [], [], [], [], pad_to=rows)
