"""The MTP head's state and its draft step: every depth run over static buffers, compiled like the target's.

The head keeps its state as the target keeps its own: in a `StatePool`, built for the head's block config
(one layer per depth), with the same slot ids as the target's pool. Pages are not shared or allocated:
slot s owns the pages `1 + s * P ..` of its row (P pages per slot, for `max_model_len` and a draft step's
reach), written into the block table once. Depth i's forwards go through a `StepBackend` of its own over
that pool, so a depth reads and writes its keys, rings and conv windows with the engine's own ops.

A draft step (`draft_step`) runs every depth of a batch of rows in one function. Each row continues its
depths from where they stand: depth i (0-based) has taken in every position before `P - n - i` for sure
(P the position of the row's newest token, n the tokens the row emitted last), and now runs positions
`P - n - i ..` as a verify row of T = 2K tokens:

- tokens j < n are certain: depth i at position q reads x_{q+i+1}, which is the row's j-th emitted token
  (the same n tokens for every depth); the window after token n-1 is committed to the slot afterwards,
  as a verify step commits its accepted windows;
- tokens n .. n+i-1 read the drafts of the depths before (speculative: their keys are overwritten before
  anything reads them as certain, and their windows are never committed);
- the rest is padding.

Depth i's input at its row's first token is depth i-1's output at its last certain position of the step
before (`carry`), then depth i-1's outputs of this step shifted by one: a fixed-shape op whatever n is.
Depth i's draft is lm_head (or the head's int8 copy of it) at position P-1 (row token n+i-1), its argmax the
(i+1)-th draft.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from ..backend import StepBackend
from ..cache import StatePool
from ..cache.pool import each_layer
from ..graphs.capture import INSTANCE_SOURCE
from ..kv_layout import pages_for
from ..metadata import PerToken, _mark_batch, check_verify_shapes
from ..static import mark_static


def head_pool(block_config, *, max_slots: int, max_model_len: int, page_size: int, tokens_per_row: int, dtype,
              device) -> StatePool:
    """The head's pool: a verify-sized intermediate window per row (T tokens), rings of W + T - 1 (a draft
    step writes T keys before its queries read, and the step after still reads W back from its first),
    and every slot's pages fixed in the block table."""
    per_slot = pages_for(max_model_len + tokens_per_row, page_size)
    pool = StatePool(block_config, max_slots=max_slots, num_pages=(max_slots + 1) * per_slot + 1,
                     page_size=page_size, max_pages_per_seq=per_slot, dtype=dtype, device=device,
                     spec_draft_tokens=tokens_per_row)
    table = 1 + torch.arange((max_slots + 1) * per_slot, dtype=torch.int32).view(max_slots + 1, per_slot)
    pool.block_table_host[:, :per_slot].copy_(table)  # a column past per_slot (a table's least width) stays 0
    pool.block_table[:, :per_slot].copy_(table)
    return pool


def clear_slot(pool: StatePool, slot: int, start: int) -> None:
    """A new request's history in `slot`: empty conv windows and rings, and zero keys before `start` (past a
    prefix-cache hit the head has no state for the cached tokens; zero keys are what it then reads there,
    the same whatever the slot held before)."""
    for t in each_layer(pool.conv.values()):
        t[slot].zero_()
    R = pool.ring_size
    for t in each_layer(pool.sliding_kv):
        t[slot * R:(slot + 1) * R].zero_()
    if start:
        rows = pool.block_table_host[slot, :pages_for(start, pool.page_size)].long()
        index = (rows[:, None] * pool.page_size + torch.arange(pool.page_size)).reshape(-1)[:start]
        for t in each_layer(pool.global_kv):
            t[index.to(t.device)] = 0


def draft_step(model, head, backends: list[StepBackend], prev: torch.Tensor, carries: list[torch.Tensor]
               ) -> tuple[torch.Tensor]:
    """Every depth of `head` (the loaded MTP head or the drafter's int8 copy of it) over the rows the
    backends' verify metadata describe (see the module docstring). prev [B*T, H]: depth 0's input, the
    target's hidden states at the rows' certain positions. Returns (drafts [B, K],). Before it returns,
    the step moves each row's state on by its n certain tokens, as a verify step commits inside itself:
    per depth but the last, its output at the row's last certain position becomes the slot's carry (once
    every depth has read the old one), and each depth's conv windows after token n-1 are committed (a
    padding row, n = 0, commits nothing; its carry goes to the dummy slot)."""
    md = backends[0].metadata
    B = check_verify_shapes(md)
    T = md.draft_tokens + 1
    n = md.drafted  # the row's certain tokens: what it emitted last step
    rows = torch.arange(B, device=n.device)
    tokens = md.input_ids.view(B, T)
    x = prev
    drafts, carried = [], []
    for i in range(len(backends)):
        check_verify_shapes(backends[i].metadata)
        out = head.depth(i, x, model.model.embed_tokens(tokens.reshape(-1)), backends[i].context).view(B, T, -1)
        draft = head.logits(model, out[rows, (n + i - 1).clamp(min=0)]).argmax(-1)
        drafts.append(draft)
        if i + 1 < len(backends):
            carried.append(out[rows, (n - 1).clamp(min=0)])
            tokens = tokens.scatter(1, (n + i)[:, None], draft[:, None])
            first = carries[i][md.cache_indices.long()]
            x = torch.cat([first[:, None], out[:, :T - 1]], dim=1).reshape(B * T, -1)
    for carry, kept in zip(carries, carried):
        carry.index_copy_(0, md.cache_indices.long(), kept)
    backends[0].context.commit_conv_windows(n - 1)  # every depth's layer of the head pool, the slots alike
    return (torch.stack(drafts, dim=1),)  # a tuple, as every compiled step's outputs (a bound replay needs one)


_STEPS = itertools.count()


class DraftStep(nn.Module):
    """The draft step as a module for the compiler (as `runner.DecodeStep`): the model, the head that
    drafts, its backends and the input buffers are reached through `self`, so they are static; `prev` is
    the kept view of the input buffer for the batch size being replayed, set by the drafter before each
    call."""

    def __init__(self, model, head, backends: list[StepBackend], carries: list[torch.Tensor]):
        super().__init__()
        self.model, self.head, self.backends, self.carries = model, head, backends, carries
        self.prev: torch.Tensor | None = None
        self.instance = next(_STEPS)

    @property
    def guarded_sources(self) -> tuple[str, ...]:
        """What Dynamo's guards watch: each depth's metadata, the input view and the instance number."""
        return (*(f"self.backends[{i}].metadata" for i in range(len(self.backends))), "self.prev", INSTANCE_SOURCE)

    def forward(self) -> tuple[torch.Tensor]:
        if self.instance < 0:  # never true: the comparison makes Dynamo guard on the instance number
            raise AssertionError(self.instance)
        return draft_step(self.model, self.head, self.backends, self.prev, self.carries)


class DraftInputs:
    """Depth 0's input buffer [max_rows * T, H] and its kept views: one tensor per batch size, made once, so
    a compiled step sees the same tensor every replay of a bucket (marked with the metadata's per-token
    symbol when one graph serves many sizes)."""

    def __init__(self, max_rows: int, tokens_per_row: int, hidden: int, dtype, device):
        self.T = tokens_per_row
        self.buffer = mark_static(torch.zeros(max_rows * tokens_per_row, hidden, dtype=dtype, device=device))
        self.views: dict[int, torch.Tensor] = {}
        self.row_views: dict[tuple[int, int], torch.Tensor] = {}  # the host's views to fill rows through
        self.symbolic: range | None = None

    def view(self, rows: int) -> torch.Tensor:
        view = self.views.get(rows)
        if view is None:
            view = self.views[rows] = mark_static(self.buffer[:rows * self.T].view(rows * self.T, -1))
            if self.symbolic is not None and rows in self.symbolic:
                _mark_batch(view, PerToken(view.dtype), self.symbolic, self.T)
        return view

    def rows_view(self, rows: int, tokens: int) -> torch.Tensor:
        """[rows, tokens, H]: the first `tokens` positions of each of the first `rows` rows, a view kept per
        shape (what the host writes through, never a graph's input: a host op after a replay runs cold)."""
        view = self.row_views.get((rows, tokens))
        if view is None:
            view = self.row_views[rows, tokens] = self.buffer[:rows * self.T].view(rows, self.T, -1)[:, :tokens]
        return view

    def mark_for_tracing(self, batch: range | None) -> None:
        self.symbolic = batch
        self.views.clear()
