"""The scheduler: which requests run, what each forward does, and what its sampled tokens mean.

Requests wait (`waiting`), then hold a slot while their prompt goes into the pool in chunks
(`prefilling`), then decode (`running`). Each engine step first advances every running request (one
decode plan per bucket-sized batch, or a verify plan where the drafter guessed), then prefills up to
`prefill_chunk_tokens` prompt tokens in one extend plan (`idle_prefill_tokens` when no request is running:
no decoder's pace is at stake then, and longer chunks reach a first token sooner): the next chunks of prompts already being
prefilled, then the first chunks of waiting requests admitted first come, first served (a free slot and
the pages for their whole budget, from the cache manager). A request whose prompt is complete takes
its first token from that forward and decodes from the next step on. A step with prompt work may instead
be mixed (`can_mix`): the running requests' tokens lead the extend plan, one row each, and their decode
rides in the prefill's forward rather than a decode forward of its own.

It knows nothing of tensors: it reads `Sampled` host values and writes `StepPlan`s.
"""

from __future__ import annotations

import itertools
from collections import deque

from .cache.manager import CacheManager
from .graphs.capture import Buckets
from .requests import Request
from .step_plan import Checkpoint, Sampled, StepKind, StepPlan

COUNTERS = ("decode_steps", "verify_steps", "row_steps", "decode_tokens", "spec_proposed", "spec_accepted")


class Scheduler:
    def __init__(self, cache: CacheManager, buckets: Buckets, *, max_batch_size: int, prefill_chunk_tokens: int,
                 idle_prefill_tokens: int | None = None, draft_tokens: int = 0, vocab_size: int, logits_vocab_size: int,
                 drafter_needs_hidden: bool = False):
        self.cache, self.buckets = cache, buckets
        self.max_batch_size, self.prefill_chunk_tokens = max_batch_size, prefill_chunk_tokens
        self.idle_prefill_tokens = idle_prefill_tokens or prefill_chunk_tokens
        self.draft_tokens = draft_tokens
        self.vocab_size, self.logits_vocab_size = vocab_size, logits_vocab_size
        self.drafter_needs_hidden = drafter_needs_hidden
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted (slot and pages held), prompt partly in the pool
        self.running: list[Request] = []  # prompt in the pool: decoding
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.counters = dict.fromkeys(COUNTERS, 0)
        # per draft depth (the d-th token of a row's drafts): drafts proposed there, and accepted (with all before it)
        self.depth_proposed, self.depth_accepted = [0] * draft_tokens, [0] * draft_tokens

    # ---- arrivals and departures -----------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def holds(self, req: Request) -> bool:
        """Whether the request holds a slot (it is prefilling or decoding)."""
        return req in self.running or req in self.prefilling

    def finish(self, req: Request) -> None:
        """A finished request leaves its queue; a slot and pages it held go back at once."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.holds(req):
            (self.running if req in self.running else self.prefilling).remove(req)
            self.cache.release(req)
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- plans ------------------------------------------------------------------------------------

    def decode_plans(self, batch: list[Request], drafts: list[list[int] | None] | None) -> list[StepPlan]:
        """The running requests' forward: decode plans, or verify plans when the drafter guessed for any
        row (or needs the hidden states only verify steps return), one per bucket-sized piece of the batch
        (each at most the largest bucket). Drafts are clipped to K tokens, end before any token past the
        logits (it could never be the target's), and are padded with stand-ins."""
        K = self.draft_tokens
        if drafts is not None:
            full = []
            for req, draft in zip(batch, drafts):
                draft = [int(t) for t in (draft or [])[:K]]
                if any(not 0 <= t < self.vocab_size for t in draft):
                    raise ValueError(f"the drafter proposed a token outside the vocabulary for request "
                                     f"{req.request_id!r}")
                draft = list(itertools.takewhile(lambda t: t < self.logits_vocab_size, draft))
                req.drafted = len(draft)
                full.append(draft + [req.output[-1]] * (K - len(draft)))  # stand-ins, never accepted
            if any(r.drafted for r in batch) or self.drafter_needs_hidden:
                draft_of = dict(zip(batch, full))
                return [self._plan(StepKind.VERIFY, piece, [[r.output[-1], *draft_of[r]] for r in piece],
                                   [r.cached_len for r in piece], limits=[r.budget for r in piece],
                                   drafted=[r.drafted for r in piece])
                        for piece in self.buckets.split(batch)]
        return [self._plan(StepKind.DECODE, piece, [[r.output[-1]] for r in piece], [r.cached_len for r in piece])
                for piece in self.buckets.split(batch)]

    def extend_plans(self, decoding: list[Request] = ()) -> list[StepPlan]:
        plan = self.extend_plan(decoding)
        return [plan] if plan is not None else []

    def can_mix(self, running: list[Request]) -> bool:
        """Whether this step may be mixed: requests decode, none speculates, and prompt work waits (the step
        buffers hold a token per slot beside the prompt budget, so the running rows always fit)."""
        return bool(running) and not self.draft_tokens and bool(self.prefilling or self.waiting)

    def extend_plan(self, decoding: list[Request] = ()) -> StepPlan | None:
        """The prompt tokens to prefill now, within the step's budget (the idle one when nothing is
        running); None if there are none. Prompts already being prefilled continue, then waiting requests
        are admitted while a slot and the pages for their whole budget are free (a prefix-cache hit starts
        past its cached tokens). `decoding`: running requests whose decode leads the plan, their newest
        token each at its position (a mixed step), unless the plan resumes a prefix from host memory; they
        decode on their own where the plan has no rows of theirs (`decoding` 0)."""
        chunks, budget = [], self.prefill_chunk_tokens if self.running else self.idle_prefill_tokens
        for req in self.prefilling:
            if budget == 0:
                break
            n = min(len(req.prompt) - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        while budget and self.waiting and len(self.running) + len(self.prefilling) < self.max_batch_size:
            req = self.waiting[0]
            if not self.cache.admit(req):
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            self.prefilling.append(req)
            n = min(len(req.prompt) - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        if not chunks:
            return None
        if self.cache.loading:  # a copy back from host memory that fails fails the forward: decoders stay out
            decoding = ()
        d = len(decoding)  # rows before the prompts' (their tokens too: one each)
        reqs = [r for r, _ in chunks]
        planned = self.cache.plan_checkpoints(chunks)
        starts = list(itertools.accumulate([d] + [n for _, n in chunks]))
        checkpoints = [Checkpoint(d + row, starts[row], req.prefilled, pages * self.cache.page_size, index)
                       for row, ((req, _), points) in enumerate(zip(chunks, planned)) for pages, index in points.items()]
        scoring = {}
        if any(r.wants_prompt_logprobs for r in reqs):
            scoring = dict(prompt_logprobs=[-1] * d + [r.params.prompt_logprobs if r.wants_prompt_logprobs else -1
                                                       for r in reqs],
                           next_tokens=[-1] * d + [r.prompt[r.prefilled + n] if r.prefilled + n < len(r.prompt) else -1
                                                   for r, n in chunks])
        return self._plan(StepKind.EXTEND, [*decoding, *reqs],
                          [[r.output[-1]] for r in decoding] + [r.prompt[r.prefilled:r.prefilled + n] for r, n in chunks],
                          [r.cached_len for r in decoding] + [r.prefilled for r in reqs],
                          sampled=[True] * d + [r.prefilled + n == len(r.prompt) for r, n in chunks],
                          checkpoints=checkpoints, decoding=d, **scoring)

    def _plan(self, kind: StepKind, reqs: list[Request], tokens: list[list[int]], starts: list[int], *,
              sampled: list[bool] | None = None, **fields) -> StepPlan:
        takes = reqs if sampled is None else [r for r, s in zip(reqs, sampled) if s]
        return StepPlan(kind=kind, request_ids=[r.request_id for r in reqs], slots=self.cache.slots_of(reqs),
                        tokens=tokens, starts=starts, sampling=[r.sampling_row() for r in reqs],
                        bucket=self.buckets.bucket_for(len(reqs)) if kind is not StepKind.EXTEND else None,
                        sampled=sampled or [], journal=self.cache.take_journal(),
                        top_logprobs=max((r.params.top_logprobs for r in takes), default=0), **fields)

    def requests_of(self, plan: StepPlan) -> list[Request]:
        return [self.requests[rid] for rid in plan.request_ids]

    # ---- what a forward's tokens do ------------------------------------------------------------------

    def record(self, plan: StepPlan, reqs: list[Request], out: Sampled) -> list[int]:
        """Appends each row's tokens (a verify row: its accepted drafts and the target's own token after
        them), finishing a request at a stop token or its length; the tokens each row emitted."""
        if plan.kind is StepKind.EXTEND:
            d = plan.decoding
            if out.prompt is not None:
                for req, chosen, ids, vals in zip(reqs[d:], out.prompt.logprobs[d:], out.prompt.top_ids[d:],
                                                  out.prompt.top_logprobs[d:]):
                    if req.wants_prompt_logprobs:
                        req.append_prompt_scores(chosen, ids, vals)
            for req, takes, tokens, chosen, ids, vals in zip(reqs, plan.sampled, out.tokens, out.logprobs, out.top_ids,
                                                             out.top_logprobs):
                if takes:
                    req.append(tokens[0], chosen[0], ids[0], vals[0])
            if d:  # the decoding rows' tokens count as a decode step's
                self.counters["row_steps"] += d
                self.counters["decode_tokens"] += d
            return [int(s) for s in plan.sampled]
        emitted = []
        for i, req in enumerate(reqs):
            n = 0
            for j in range(out.accepted[i] + 1 if plan.kind is StepKind.VERIFY else 1):
                req.append(out.tokens[i][j], out.logprobs[i][j], out.top_ids[i][j], out.top_logprobs[i][j])
                n += 1
                if req.finish_reason is not None:
                    break
            emitted.append(n)
            if plan.kind is StepKind.VERIFY:
                taken = min(out.accepted[i], req.drafted, n)  # drafts accepted and emitted (a stop may come first)
                req.spec_proposed += req.drafted
                req.spec_accepted += taken
                for d in range(req.drafted):
                    self.depth_proposed[d] += 1
                    self.depth_accepted[d] += d < taken
                self.counters["spec_proposed"] += req.drafted
                self.counters["spec_accepted"] += taken
        c = self.counters
        c["row_steps"] += len(reqs)
        c["decode_tokens"] += sum(emitted)
        return emitted

    def count_step(self, kind: StepKind) -> None:
        """One decode (or verify) step of the running requests, however many plans it took."""
        self.counters["verify_steps" if kind is StepKind.VERIFY else "decode_steps"] += 1

    def finish_extend(self, plan: StepPlan, reqs: list[Request]) -> None:
        """After an extend forward, failed or not: the prefilled pages enter the prefix cache; the rows
        that did not fail advance, and those whose prompt is complete decode from the next step on."""
        d = plan.decoding  # rows that decoded: nothing of a prompt to commit
        chunks = [(req, len(t)) for req, t in zip(reqs[d:], plan.tokens[d:])]
        planned: list[dict[int, int]] = [{} for _ in chunks]
        for c in plan.checkpoints:
            planned[c.row - d][c.boundary // self.cache.page_size] = c.index
        self.cache.commit_prefill(chunks, planned)
        for (req, n), complete in zip(chunks, plan.sampled[d:]):
            if req.finish_reason is None:
                req.prefilled += n
                if complete:
                    self.prefilling.remove(req)
                    self.running.append(req)

    # ---- what the engine reports ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "prefilling": len(self.prefilling), "running": len(self.running)}
