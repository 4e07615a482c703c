"""The drafter that runs Inkling's multi-token-prediction head (`model.MtpHead`) beside the engine.

The head's recipe (`docs inkling-mtp.md` §3, where the public implementations agree): depth m (1-based) at
position q takes `prev`, the target's final-normed hidden h_q for m = 1 or depth m-1's output at q, and
the token x_{q+m}; it fuses `input_proj(cat[hidden_norm(prev), embed_norm(E(x))])` (E = the trunk's
embedding with its own embed norm; hidden first unless `mtp_hidden_states_first` is false), runs one
full Inkling decoder layer (dense MLP; sliding where `mtp_local_layer_ids` says, else global), applies
`chain_norm` when the checkpoint has one, and predicts x_{q+m+1} with the trunk's lm_head(out / mup).
The next depth chains on that output. Each depth has its own conv windows and keys.

`MtpDrafter` keeps every depth's state exact: a depth takes in a position for good only once the token
it consumes there, x_{q+m}, is known for certain, so depth m lags the sequence by m positions. Its state
lives in a pool of its own, and drafting is one draft step over static buffers for a batch of rows
(`mtp_step.py`: compiled with the engine, one graph for every bucket). A request's first positions (its
prompt, after prefill) are taken in by extend forwards over the same pool, in chunks, once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from typing import Callable

import torch

from ..backend import StepBackend
from ..errors import OptionError
from ..graphs import Buckets, CompiledStep, InputsKeys
from ..metadata import GREEDY_PAD
from ..model import Linear, MtpHead
from ..nvtx import DRAFT_REPLAY, nvtx_range
from ..quantize import quantize_rows
from ..static import mark_static
from .drafter import Drafter
from .mtp_step import DraftInputs, DraftStep, clear_slot, draft_step, head_pool


def int8_head(model) -> MtpHead:
    """The head that drafts for `draft_quantization="int8"`: a copy of the loaded MTP head whose projections
    are int8 by the int8 scheme (`quantize.py`: one scale per output row), with an int8 copy of the trunk's
    lm_head that only the drafts read (`MtpHead.draft_lm_head`). A draft decides how many tokens a step
    yields, never which (the verify step reads the target's own weights), so this trades a little acceptance
    for a draft step that reads about a quarter of the bytes. The model stays as loaded (other engines may
    share it): the copy shares its norms and any weight that is int8 already (an int8 engine's head, whose
    drafts then read the trunk's int8 lm_head)."""
    head: MtpHead = model.model.mtp
    draft = copy.deepcopy(head, {id(p): p for p in head.parameters()})  # new modules, the same tensors
    for module in draft.modules():
        if isinstance(module, Linear) and module.weight_scale is None:
            _to_int8(module, module.weight)
    if model.lm_head.weight_scale is None:
        rows, hidden = model.lm_head.weight.shape
        with torch.device("meta"):
            draft.draft_lm_head = Linear(hidden, rows)
        _to_int8(draft.draft_lm_head, model.lm_head.weight)
    return draft


def _to_int8(linear: Linear, weight: torch.Tensor) -> None:
    """`linear` reads `weight` as int8 rows [out, in] (contiguous, as the int8 kernels take them) and scales."""
    q, scale = quantize_rows(weight.detach().contiguous())
    linear.weight = torch.nn.Parameter(q, requires_grad=False)
    linear.weight_scale = torch.nn.Parameter(scale, requires_grad=False)


@dataclasses.dataclass(eq=False)
class _Track:
    """What the drafter knows of one request: its slot, the first position its head history covers (past a
    prefix-cache hit, the cached tokens have no target hidden), per depth the first position not taken in
    yet, the target's hidden states at the positions depth 0 has not taken in (by position, and those of
    the last verify step as it handed them over: `recent`), and the drafts it last made (for the newest
    position `drafted_at`)."""

    slot: int
    start: int
    done: list[int]
    hidden: dict[int, torch.Tensor]
    # (the verify step's hidden states [rows, K+1, H], this request's row, the position of its first token,
    # the tokens it emitted): kept whole, so that the draft step after it copies every row in one op
    recent: tuple[torch.Tensor, int, int, int] | None = None
    drafted_at: int = -1
    drafts: list[int] | None = None

    def settle(self) -> None:
        """`recent`'s rows not taken in yet, moved into `hidden` by position (one view each)."""
        if self.recent is not None:
            block, row, first, n = self.recent
            for j in range(max(self.done[0] - first, 0), n):
                self.hidden[first + j] = block[row, j]
            self.recent = None


class MtpDrafter(Drafter):
    """Drafts with the checkpoint's MTP head: depth m proposes the m-th token ahead (greedy, so the draft
    is a point mass: rejection sampling stays exact). Needs the engine's hidden states."""

    needs_hidden = True
    extend_chunk = 256  # positions one extend forward of a depth takes in, over all its rows

    def __init__(self, model, num_tokens: int, draft_quantization: str = "none"):
        head: MtpHead | None = getattr(model.model, "mtp", None)
        if head is None:
            raise OptionError("speculative='mtp' needs the checkpoint's MTP head: load the model with "
                              "Engine.from_pretrained(..., speculative='mtp') from a checkpoint that has one")
        if num_tokens > len(head.layers):
            raise OptionError(f"num_speculative_tokens={num_tokens} exceeds the {len(head.layers)} MTP depth(s) "
                              "loaded: the MTP head drafts one token per depth")
        # `head`: what drafts, the loaded head or (from `attach` on) its int8 copy
        self.model, self.head, self.num_tokens, self.draft_quantization = model, head, num_tokens, draft_quantization
        self.depths = num_tokens
        self.tokens_per_row = 2 * num_tokens  # a draft step's row: up to K+1 certain tokens, K-1 drafts
        self.tracks: dict[object, _Track] = {}
        self.compiled: CompiledStep | None = None
        self.buckets = Buckets(None)  # eager until `compile` (any batch size, unpadded)
        # What stands for a bucket's inputs to the compiled draft step: every depth's kept metadata slices
        # and the kept input view are the same tensors at each of its draft steps.
        self.inputs_key = InputsKeys()
        self.pinned: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def attach(self, pool, max_model_len: int) -> None:
        if self.draft_quantization == "int8":
            self.head = int8_head(self.model)
        config, device, dtype = self.head.block_config, self.model.lm_head.weight.device, self.model.dtype
        T, S = self.tokens_per_row, pool.max_slots
        self.slot_of = pool.slot_of
        self.pool = head_pool(config, max_slots=S, max_model_len=max_model_len, page_size=pool.page_size,
                              tokens_per_row=T, dtype=dtype, device=device)
        self.capacity = self.pool.max_pages_per_seq * self.pool.page_size  # positions a slot's pages hold
        self.backends = [StepBackend(self.pool, config, max_batch_size=S, max_tokens=self.extend_chunk, device=device,
                                     draft_tokens=T - 1) for _ in range(self.depths)]
        self.carries = [self.pool.mark_slot_rows(mark_static(torch.zeros(S + 1, config.hidden_size, dtype=dtype,
                                                                          device=device)))
                        for _ in range(self.depths - 1)]
        self.inputs = DraftInputs(S, T, config.hidden_size, dtype, device)
        self.step = DraftStep(self.model, self.head, self.backends, self.carries)

    def compile(self, options: dict, pinned: Callable[[], contextlib.AbstractContextManager] | None = None
                ) -> CompiledStep:
        """The draft step compiled with the engine's step options (`Worker.step_options`: buckets, backend,
        mode, the decode step's package key): one graph for every bucket, as the verify step's, saved whole
        beside the decode step where that is (its key the decode step's, the depths and the head pool's
        shapes), so a later process loads it and traces nothing; replays run under `pinned` (the engine's
        torch state)."""
        key = options.get("package_key")
        if key is not None:
            pool = self.pool
            key = (*key, "mtp draft", [(n, str(p.dtype)) for n, p in self.head.named_parameters()], self.depths,
                   self.tokens_per_row, pool.page_size, pool.ring_size,
                   [tuple(t.shape[1:]) for t in (*pool.state_tensors(), *pool.draft_windows())])
        compiled = self.compiled = CompiledStep(self.step, self._prepare_padding, kind="MTP draft", **{
            **options, "guarded_sources": self.step.guarded_sources, "package_key": key})
        self.buckets = Buckets(compiled.buckets)
        self._mark(None if compiled.load_package() else compiled.symbolic_batch)
        compiled.on_unpackage = lambda: self._mark(compiled.symbolic_batch)
        self.pinned = pinned or contextlib.nullcontext
        return compiled

    def probe_step(self) -> tuple[DraftStep, Callable[[int], None]]:
        """A second draft step over the same model, backends and buffers, and its padding prep: what a
        tool traces with a backend of its own (`profile`'s census) while the compiled step stays as it is."""
        step = DraftStep(self.model, self.head, self.backends, self.carries)

        def prepare_padding(rows: int) -> None:
            self._prepare_padding(rows)
            step.prev = self.step.prev

        return step, prepare_padding

    def _mark(self, batch: range | None) -> None:
        """The draft step's slices marked for tracing over `batch` (None: unmarked, for a loaded package)."""
        for backend in self.backends:
            backend.buffers.mark_for_tracing("verify", batch)
        self.inputs.mark_for_tracing(batch)

    def _prepare_padding(self, rows: int) -> None:
        for backend in self.backends:
            backend.prepare_verify_padding(rows)
        self.step.prev = self.inputs.view(rows)

    def warm_up(self, progress=None, buckets=None) -> dict[int, float]:
        if self.compiled is None:
            return {}
        with self.pinned():
            return self.compiled.warmup(progress=progress, buckets=buckets)

    def release(self, req) -> None:
        self.tracks.pop(req, None)

    def state_tensors(self) -> list[torch.Tensor]:
        loaded = {id(p) for p in self.model.parameters()}
        own = [p for p in self.head.parameters() if id(p) not in loaded]  # an int8 head's own weights
        return [*self.pool.static_tensors(), *self.carries, self.inputs.buffer, *own]

    # ---- what the target did ----------------------------------------------------------------------

    @torch.inference_mode()
    def observe_prefill(self, reqs: list, lengths: list[int], hidden: torch.Tensor | None) -> None:
        for req, start, n in zip(reqs, itertools.accumulate([0] + lengths), lengths):
            track = self.tracks.get(req)
            if track is None:
                slot = self.slot_of[req.request_id]
                track = self.tracks[req] = _Track(slot, req.prefilled, [req.prefilled] * self.depths, {})
                clear_slot(self.pool, slot, req.prefilled)
            track.settle()
            rows = hidden[start:start + n].clone()  # its own copy: the packed step output can go
            for j in range(n):
                track.hidden[req.prefilled + j] = rows[j]
        # A prompt that took its first token: the head takes the prompt in now, as part of the prefill (a
        # draft head's prefill is prefill work), so the first decode step drafts at once.
        complete = [req for req in reqs if req.output and req.finish_reason is None]
        if complete:
            self._ready(complete)

    def observe_tokens(self, reqs: list, emitted: list[int], hidden: torch.Tensor | None) -> None:
        for i, (req, n) in enumerate(zip(reqs, emitted)):
            track = self.tracks.get(req)
            if track is None or req.finish_reason is not None:
                continue
            track.settle()  # (a row the last draft step did not take: its states by position)
            track.recent = (hidden, i, len(req.prompt) + len(req.output) - 1 - n, n)  # from its first input on

    # ---- drafting ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: list) -> list[list[int] | None]:
        """Each row's drafts. A row whose depths stand where a draft step continues them (the last step's
        emitted tokens are each depth's certain ones) drafts at once; the others first take in what they
        can for sure by extend forwards (`_take_in`), which leave them one certain position to draft from
        when their history is long enough, or else no drafts this step. Asking again before the target has
        moved returns the same drafts."""
        for piece in self.buckets.split(self._ready(reqs)):
            if piece:
                self._draft(piece)
        out = []
        for req in reqs:
            track = self.tracks.get(req)
            out.append(track.drafts if track is not None and track.drafted_at == len(req.prompt) + len(req.output) - 1
                       else None)
        return out

    def _ready(self, reqs: list) -> list:
        """The rows (track, known tokens, certain tokens n) of `reqs` that a draft step continues now, those
        behind first brought up by extend forwards; a row too short to draft from is marked drafted with
        no drafts for its newest position."""
        fresh = []
        for req in reqs:
            track = self.tracks.get(req)
            known = req.prompt + req.output
            if track is not None and track.drafted_at != len(known) - 1:
                fresh.append((req, track, known))
        ready, behind = [], []
        for req, track, known in fresh:
            P, K, done = len(known) - 1, self.depths, track.done
            n = P - done[0]
            if 1 <= n <= K + 1 and all(d == done[0] - i for i, d in enumerate(done)) and done[-1] >= track.start:
                ready.append((track, known, n))
                continue
            # A draft step needs depth i to stand at P-1-i (one certain position each) past the history's start.
            track.settle()
            leave_one = all(d <= P - 1 - i for i, d in enumerate(done)) and P - K >= track.start
            behind.append((track, known, [P - i - leave_one for i in range(K)]))
            if leave_one:
                ready.append((track, known, 1))
            else:
                track.drafted_at, track.drafts = P, None
        if behind:
            self._take_in(behind)
        return ready

    def _draft(self, rows: list) -> None:
        """One draft step over `rows` (track, known tokens, certain tokens n): every depth runs its row
        of T tokens, and the step itself commits each depth's windows after its n-th token and keeps its
        carry; each row's state then moves on by n."""
        T, B = self.tokens_per_row, len(rows)
        bucket = self.buckets.bucket_for(B) or B
        slots = [track.slot for track, _, _ in rows]
        counts = [n for _, _, n in rows]
        tokens = [known[len(known) - n:] + [0] * (T - n) for _, known, n in rows]  # the n emitted tokens
        with nvtx_range("prepare draft"):
            for i, backend in enumerate(self.backends):
                backend.prepare_verify(tokens, slots, [track.done[i] for track, _, _ in rows], [self.capacity] * B,
                                       counts, [GREEDY_PAD] * B, pad_to=bucket)
            prev = self.inputs.view(bucket)
            block = self._last_verify(rows)
            if block is not None:  # row r is the last verify's row r, from its first token: one copy for all
                self.inputs.rows_view(B, block.shape[1]).copy_(block if block.shape[0] == B else block[:B])
            else:
                by_row = self.inputs.rows_view(bucket, T)
                for r, (track, _, n) in enumerate(rows):  # each row's n certain positions, stacked in place
                    track.settle()
                    torch.stack([track.hidden[track.done[0] + j] for j in range(n)], out=by_row[r, :n])
            if self.step.prev is not prev:  # a bucket's kept view: the same at its every step (a module setattr costs)
                self.step.prev = prev
        with self.pinned():
            if self.compiled is not None:
                key = self.inputs_key(bucket, prev, *(backend.buffers.published for backend in self.backends))
                with nvtx_range(f"{DRAFT_REPLAY} {bucket} ({B} rows)"):  # `profile` labels its ops by this name
                    drafts, = self.compiled.run(bucket, inputs=key)
            else:
                with nvtx_range(f"draft {B} rows (eager)"):
                    drafts, = draft_step(self.model, self.head, self.backends, prev, self.carries)
        for (track, known, n), row in zip(rows, (drafts if B == bucket else drafts[:B]).tolist()):
            self._advance(track, [d + n for d in track.done])
            track.drafted_at, track.drafts = len(known) - 1, row

    @staticmethod
    def _last_verify(rows: list) -> torch.Tensor | None:
        """The last verify step's hidden states, where they are every row's certain inputs in place: row r
        of the draft step is that step's row r, its first token at the position its depth 0 stands (the
        extra tokens land on the draft rows' padding, which nothing reads as certain). Else None."""
        block = rows[0][0].recent[0] if rows[0][0].recent is not None else None
        for r, (track, _, n) in enumerate(rows):
            recent = track.recent
            if recent is None or recent[0] is not block or recent[1] != r or recent[2] != track.done[0] \
                    or recent[3] != n:
                return None
        return block

    def _advance(self, track: _Track, done: list[int]) -> None:
        track.done = done
        if track.recent is not None and track.recent[2] + track.recent[3] <= done[0]:
            track.recent = None  # taken in
        for q in [q for q in track.hidden if q < done[0]]:
            del track.hidden[q]

    def _take_in(self, behind: list) -> None:
        """Extend forwards over the head's pool: depth i of each row (track, known tokens, `ends`) takes in
        its positions done[i] .. ends[i]-1 for good, depth by depth, rows packed up to `extend_chunk`
        positions a call. Depth i's input there is depth i-1's output: of these forwards, or its carry."""
        # Per depth but the last, its outputs by position that the next depth may read: its carry (at the
        # position before the first it takes in now), then what it takes in.
        outputs = [{track: {track.done[i] - 1: self.carries[i][track.slot].clone()} for track, _, _ in behind}
                   for i in range(self.depths - 1)]
        for i, backend in enumerate(self.backends):
            work = []
            for track, known, ends in behind:
                lo, hi = track.done[i], ends[i]
                if hi <= lo:
                    continue
                if i == 0:
                    prev = [track.hidden[q] for q in range(lo, hi)]
                else:
                    prev = [outputs[i - 1][track][q] for q in range(lo, hi)]
                work.append([track, lo, hi, prev, known[lo + i + 1:hi + i + 1]])
            taken: dict[_Track, dict[int, torch.Tensor]] = {}
            while work:
                budget, call = self.extend_chunk, []
                for item in work:
                    track, lo, hi = item[:3]
                    take = min(hi - lo, budget)
                    if take <= 0:
                        break
                    call.append((track, lo, take, item))
                    budget -= take
                md = backend.prepare_extend([item[4][:take] for _, _, take, item in call], [lo for _, lo, _, _ in call],
                                            [track.slot for track, *_ in call], [GREEDY_PAD] * len(call))
                prev = torch.stack([h for _, _, take, item in call for h in item[3][:take]])
                out = self.head.depth(i, prev, self.model.model.embed_tokens(md.input_ids), backend.context)
                for (track, lo, take, item), rows in zip(call, out.split([take for _, _, take, _ in call])):
                    taken.setdefault(track, {}).update({lo + j: rows[j] for j in range(take)})
                    item[1], item[3], item[4] = lo + take, item[3][take:], item[4][take:]
                work = [item for item in work if item[1] < item[2]]
            for track, known, ends in behind:
                if track in taken:
                    if i + 1 < self.depths:
                        self.carries[i][track.slot] = taken[track][ends[i] - 1]
                        outputs[i][track].update(taken[track])
                    track.done[i] = ends[i]
        for track, _, _ in behind:
            self._advance(track, track.done)
