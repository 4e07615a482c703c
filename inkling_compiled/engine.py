"""The serving engine: the public API over a scheduler, a worker and a cache manager.

`add_request` queues a request with the `Scheduler`, which decides each forward as a `StepPlan`; the
`Worker` executes the plan (model, pool, compiled steps); the `CacheManager` (cache/) hands out slots,
pages and prefix-cache entries. The engine owns what is left: the lock (every public method takes it,
so threads may add, abort and step concurrently), `generate()`'s ownership of its outputs, failure
containment and close.

Failure is contained: if anything raises inside a forward, the requests of that forward are finished
with `finish_reason="error"` (their state may be half-written) and freed, and the engine goes on
serving. Under tensor parallelism a forward that raised may have left the ranks out of step, so every
rank is stopped instead.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import random
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from .cache.manager import CacheManager
from .checks import option_bool, option_int
from .compile_beside import StepBeside
from .config import InklingConfig
from .custom_ops.library import build_in_background
from .errors import InklingError, OptionError, RequestError
from .loading import load_model, resolve_device
from .model import InklingForCausalLM
from .nvtx import nvtx_range
from .parallel import launch
from .parallel.ranks import ParallelError, Ranks
from .progress import StageLog
from .requests import Request, RequestOutput, prompt_ids, prompt_list
from .sampling import SamplingParams
from .scheduler import Scheduler
from .spec import MAX_SPECULATIVE_TOKENS, check_drafter_options, make_drafter
from .step_plan import StepKind, StepPlan
from .tokenizer import TextTokenizer
from .worker import Worker, memory_summary

log = logging.getLogger("inkling_compiled")

__all__ = ["Engine", "RequestOutput"]


def _request_id(request_id) -> str:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise RequestError(f"a request id must be a str or an int, got {type(request_id).__name__}")
    return str(request_id)


class Engine:
    def __init__(self, model: InklingForCausalLM, *, tokenizer: TextTokenizer | None = None, device="cpu",
                 compile: bool = True, max_batch_size: int = 32, max_model_len: int = 2048,
                 prefill_chunk_tokens: int | None = None, idle_prefill_tokens: int | None = None, page_size: int = 16, num_pages: int | None = None,
                 seed: int = 0, buckets: tuple[int, ...] | None = None, compile_backend: str = "inductor",
                 compile_mode: str | None = None, compile_cache_dir: str | Path | None = None,
                 cpp_wrapper: bool | None = None, graph_per_bucket: bool = False,
                 specialize_batch_one: bool = False, compile_package: bool = True, compile_extend: bool = True,
                 layer_transfer: bool = False, warmup: bool = True,
                 progress: bool = True, prefix_cache: bool = True, prefix_checkpoints: int | None = None,
                 state_memory_bytes: int | None = None, host_cache_bytes: int = 0, speculative=None,
                 num_speculative_tokens: int = 2, draft_quantization: str | None = None, mixed_steps: bool = True,
                 max_prefill_tokens=None, ranks: Ranks | None = None):
        config: InklingConfig = model.config
        self.model, self.config, self.tokenizer = model, config, tokenizer
        if max_prefill_tokens is not None:
            raise OptionError("max_prefill_tokens was replaced by prefill_chunk_tokens: the prompt tokens one step "
                              "prefills (a longer prompt is prefilled over several steps)")
        for name, flag in (("warmup", warmup), ("progress", progress), ("mixed_steps", mixed_steps)):
            option_bool(name, flag)
        self.mixed_steps = mixed_steps
        self.device = resolve_device(device)
        # Tensor parallelism (`from_pretrained(..., tensor_parallel_size=N)`): this engine is rank 0's.
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        if self.ranks is not None:
            launch.check_options(dict(speculative=speculative, host_cache_bytes=host_cache_bytes,
                                      cpp_wrapper=cpp_wrapper))
        self._closed: str | None = None  # why the engine no longer steps (closed, or a rank failed)
        option_int("seed", seed, 0)
        host_cache_bytes = option_int("host_cache_bytes", host_cache_bytes, 0)
        # Speculative decoding: K drafts per request and step, checked by one verify forward.
        option_int("num_speculative_tokens", num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        self.num_speculative_tokens = num_speculative_tokens if speculative is not None else 0
        # (checked before any allocation: an MTP drafter's int8 head is made when it attaches to the pool)
        self.drafter = make_drafter(speculative, self.num_speculative_tokens, model, draft_quantization)
        self.speculative = speculative if speculative is None or isinstance(speculative, str) \
            else type(speculative).__name__
        needs_hidden = self.drafter is not None and self.drafter.needs_hidden
        self.worker = Worker(model, device=self.device, compile=compile, max_batch_size=max_batch_size,
                             max_model_len=max_model_len, prefill_chunk_tokens=prefill_chunk_tokens,
                             idle_prefill_tokens=idle_prefill_tokens,
                             page_size=page_size, num_pages=num_pages, buckets=buckets,
                             compile_backend=compile_backend, compile_mode=compile_mode,
                             compile_cache_dir=compile_cache_dir, cpp_wrapper=cpp_wrapper,
                             graph_per_bucket=graph_per_bucket, specialize_batch_one=specialize_batch_one,
                             compile_package=compile_package, compile_extend=compile_extend,
                             layer_transfer=layer_transfer,
                             prefix_cache=prefix_cache, prefix_checkpoints=prefix_checkpoints,
                             state_memory_bytes=state_memory_bytes, draft_tokens=self.num_speculative_tokens,
                             with_hidden=needs_hidden, tensor_parallel=self.ranks is not None)
        self.max_batch_size, self.max_model_len = self.worker.max_batch_size, self.worker.max_model_len
        # Shared prompt prefixes: full KV pages and the state at their boundaries (see cache/prefix.py).
        self.cache = CacheManager(self.worker.pool, prefix_cache=prefix_cache,
                                  host_cache_bytes=host_cache_bytes)
        self.scheduler = Scheduler(self.cache, self.worker.buckets, max_batch_size=self.max_batch_size,
                                   prefill_chunk_tokens=self.worker.prefill_chunk_tokens,
                                   idle_prefill_tokens=self.worker.idle_prefill_tokens,
                                   draft_tokens=self.num_speculative_tokens, vocab_size=config.vocab_size,
                                   logits_vocab_size=config.logits_vocab_size, drafter_needs_hidden=needs_hidden)
        if self.drafter is not None:
            self.drafter.attach(self.worker.pool, self.max_model_len)
            if self.worker.step_options is not None and hasattr(self.drafter, "compile"):
                self.drafter.compile(self.worker.step_options, pinned=self.worker.torch_state.pinned)
        self._lock = threading.RLock()
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._finished: list[Request] = []  # finished outside a forward (aborted, interrupted): output pending
        self._known: set[str] = set()  # ids of requests whose final output has not been returned yet
        self._owners: dict[str, dict[str, RequestOutput]] = {}  # request id -> the generate() call awaiting it
        self._undelivered: dict[str, RequestOutput] = {}  # outputs generate() stepped past, for step() to return
        self._progress = progress
        StageLog(progress).finish(self.memory_summary())
        if compile and warmup:
            self.warm_up()
        if self.ranks is not None and self.ranks.rank == 0:  # from now on every plan goes to every rank
            self.worker.lead(self.ranks)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype=None, compile: bool = True,
                        max_batch_size: int = 32, check_finite: bool = True, quantization: str | None = None,
                        **kwargs) -> "Engine":
        """Loads a checkpoint folder. compile=True (default) runs decode steps through the compiled
        graph (every bucket warmed up here); compile=False is the eager reference path. check_finite
        refuses a checkpoint with NaN or inf weights. quantization='int8' stores every projection,
        expert and the lm_head as int8 with a scale per output row (`quantize.py`); an int8 checkpoint
        loads as int8 without it."""
        build_in_background()  # the C++ kernels (first time only) build while the weights load and compile
        check_drafter_options(kwargs.get("speculative"), kwargs.get("draft_quantization"))  # before any loading
        # The MTP head is loaded only for MTP drafting, one depth per speculative token.
        mtp_depths = 0
        if kwargs.get("speculative") == "mtp":
            mtp_depths = option_int("num_speculative_tokens", kwargs.get("num_speculative_tokens", 2), 1,
                                    MAX_SPECULATIVE_TOKENS)
        parallel = option_bool("parallel_compile", kwargs.pop("parallel_compile", True))
        world = option_int("tensor_parallel_size", kwargs.pop("tensor_parallel_size", 1))
        timeout = kwargs.pop("tensor_parallel_timeout", 300.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise OptionError(f"tensor_parallel_timeout must be a positive number of seconds, got {timeout!r}")
        if world > 1:
            options = dict(compile=compile, max_batch_size=max_batch_size, **kwargs)
            unknown = sorted(set(options) - set(inspect.signature(cls.__init__).parameters) - {"self", "model", "ranks"})
            if unknown:  # before any rank starts (each would build an engine and fail alike)
                raise TypeError(f"Engine.from_pretrained() got unexpected keyword argument(s) "
                                f"{', '.join(map(repr, unknown))}")
            return launch.start(cls, path, world, timeout, device, dtype, check_finite, options, quantization)
        warmup = option_bool("warmup", kwargs.pop("warmup", True))
        model, _ = load_model(path, device=device, dtype=dtype, check_finite=check_finite, mtp_depths=mtp_depths,
                              quantization=quantization)
        engine = cls(model, tokenizer=TextTokenizer.from_checkpoint(path), device=device, compile=compile,
                     max_batch_size=max_batch_size, warmup=False, **kwargs)
        if compile and warmup:
            beside = None
            if parallel:  # built after the weights, so that the child reads the kernel choices made for them
                beside = StepBeside.for_checkpoint(path, device=device, dtype=dtype, check_finite=check_finite,
                                                     quantization=quantization,
                                                     options=dict(max_batch_size=max_batch_size, **kwargs))
            engine.warm_up(beside=beside)
        return engine

    def warm_up(self, buckets: Sequence[int] | None = None, beside: StepBeside | None = None) -> dict[int, float]:
        """Compiles (or loads from the cache) the decode graphs of `buckets` (default: all) now, rather
        than on their first use; seconds per bucket. Engines built with warmup=True (the default) have
        done this for every bucket; a bucket never warmed up compiles on first use. `beside`: how to
        compile the decode step in a second process meanwhile (`compile_beside.py`)."""
        decoder = self.worker.decoder
        if decoder is None:
            return {}
        stages = StageLog(self._progress)
        t0 = time.perf_counter()
        with self._lock:
            if self.worker.ranks is not None:
                self._check_open()
            try:
                seconds = self.worker.warm_up(buckets, progress=stages, beside=beside)
                if self.drafter is not None and hasattr(self.drafter, "warm_up"):
                    draft = self.drafter.warm_up(progress=stages, buckets=buckets)
                    seconds = {b: s + draft.get(b, 0.0) for b, s in seconds.items()}
            except BaseException as e:
                if self.worker.ranks is not None and not isinstance(e, OptionError):  # the ranks are inside warm-up
                    self._raise_stopped([], e)
                raise
        verifier = self.worker.verifier
        verify_note = f" and {len(verifier.graphs())} verify graph(s)" if verifier is not None else ""
        drafting = getattr(self.drafter, "compiled", None)
        verify_note += f", {len(drafting.graphs())} MTP draft graph(s)" if drafting is not None else ""
        extender = self.worker.extender
        extend_note = "; 1 extend graph for every chunk" if extender is not None and extender.graphs() else ""
        source = (" (the decode step compiled in a second process beside the others)"
                  if self.worker.decoder_compiled_beside else
                  " (loaded from its compile package: nothing compiled)" if decoder.loaded else "")
        buckets = ", ".join(map(str, sorted(decoder.graph_of)))
        stages.finish(f"decode step ready: {len(decoder.graphs())} graph(s){verify_note} for buckets {buckets}"
                      f"{extend_note} in {time.perf_counter() - t0:.1f} s{source}")
        return seconds

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | int | None = None) -> str:
        """Queues a request; returns its id (a str: an int id is kept as its decimal string)."""
        rid = None if request_id is None else _request_id(request_id)
        params = params if params is not None else SamplingParams()
        ids, budget = self._checked(prompt, params)
        with self._lock:
            self._check_open()
            return self._queue(ids, params, budget, rid)

    def _checked(self, prompt, params: SamplingParams) -> tuple[list[int], int]:
        """The prompt's token ids and the request's token budget, or a RequestError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")
        ids = prompt_ids(prompt, self.tokenizer)
        if not ids:
            raise RequestError("empty prompt: at least one token is needed")
        bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad[1]} at position {bad[0]} is out of range [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt of {len(ids)} tokens is too long: max_model_len={self.max_model_len} "
                               "leaves no room to generate")
        budget = min(len(ids) + params.max_new_tokens, self.max_model_len)
        self.cache.check_fits(budget)
        return ids, budget

    def _queue(self, ids: list[int], params: SamplingParams, budget: int, request_id: str | None) -> str:
        if request_id is None:
            request_id = next(r for r in (str(i) for i in self._ids) if r not in self._known)
        if request_id in self._known:
            raise RequestError(f"request id {request_id!r} is already in use")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos and self.config.eos_token_id is not None:
            stop.add(self.config.eos_token_id)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        self.scheduler.add(Request(request_id, ids, params, seed, frozenset(stop), budget))
        self._known.add(request_id)
        return request_id

    def abort(self, request_id: str | int) -> None:
        """Finishes a waiting or running request with finish_reason="abort"; its slot and pages are freed
        at once, and the next step() returns its final output."""
        rid = _request_id(request_id)
        with self._lock:
            req = self.scheduler.get(rid)
            if req is None:
                raise RequestError(f"no unfinished request with id {rid!r}")
            self._release(req)
            req.finish_reason = "abort"
            self._finished.append(req)

    def _release(self, req: Request) -> None:
        self.scheduler.finish(req)
        if self.drafter is not None:
            self.drafter.release(req)

    def attach_layer_transfer_counter(self, counter) -> None:
        """Attach a HiCache-style counter (`wait_until(layer_id)`): every step then waits for a layer's
        transfer before touching its state. Compiled engines built with layer_transfer=True wait at each
        layer inside the graph (the rest of the step overlaps the transfer); others wait for every layer
        before the replay starts."""
        if counter is not None and not callable(getattr(counter, "wait_until", None)):
            raise OptionError(f"a layer-transfer counter needs a wait_until(layer_id) method; "
                              f"{type(counter).__name__} has none")
        with self._lock:
            self.cache.attach_layer_transfer_counter(counter)

    def memory_report(self) -> dict[str, int]:
        """Bytes of each part of what the engine holds, and how many units of each the pool has."""
        drafter = sum(t.numel() * t.element_size() for t in self.drafter.state_tensors()) if self.drafter else 0
        return self.worker.memory_report(drafter)

    def memory_summary(self) -> str:
        """`memory_report()` as one line (what start-up prints)."""
        return memory_summary(self.memory_report())

    def clear_prefix_cache(self) -> int:
        """Drops every prefix-cache entry no running request resumed from (their pages and checkpoints
        go back to the pool); how many were dropped."""
        with self._lock:
            return self.cache.clear()

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._finished or self._undelivered)

    def stats(self) -> dict:
        """Counters since start: decode and verify steps, tokens they yielded, and with speculative decoding
        the drafts proposed and accepted (acceptance rate; by depth, the share of d-th drafts accepted with
        every draft before them) and the mean tokens a request gains per step."""
        with self._lock:
            c = dict(self.scheduler.counters)
            by_depth = [a / p if p else None for a, p in zip(self.scheduler.depth_accepted, self.scheduler.depth_proposed)]
            cache = self.cache.stats()
        return {"speculative": self.speculative, "num_speculative_tokens": self.num_speculative_tokens,
                "draft_quantization": self.drafter.draft_quantization if self.drafter else "none", **c,
                "acceptance_rate": c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else None,
                "acceptance_by_depth": by_depth, "depth_proposed": list(self.scheduler.depth_proposed),
                "depth_accepted": list(self.scheduler.depth_accepted),
                "mean_tokens_per_step": c["decode_tokens"] / c["row_steps"] if c["row_steps"] else None, **cache}

    def snapshot(self) -> dict[str, int]:
        """Where the requests and the pool stand now: requests waiting, prefilling and running; free slots
        and pages; pages and free checkpoints of the prefix cache (what /metrics shows)."""
        with self._lock:
            return {**self.scheduler.snapshot(), **self.cache.usage()}

    # ---- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: each running request decodes (one token, or with speculative decoding its
        accepted drafts and one more), and up to `prefill_chunk_tokens` prompt tokens are prefilled
        (`idle_prefill_tokens` when no request is decoding).
        Returns the outputs of the requests that advanced or finished (and of any that `generate` stepped
        past for this caller), each carrying what is new since the last; outputs of requests a `generate`
        call is waiting for go to that call instead."""
        with self._lock:
            self._check_open()
            latest = dict(self._undelivered)
            for out in self._step():  # the newest output of a request says it all
                previous = latest.get(out.request_id)
                latest[out.request_id] = out if previous is None else out.absorb(previous)
            self._undelivered.clear()
            self._known.difference_update(rid for rid, o in latest.items() if o.finished)
            return list(latest.values())

    def _step(self) -> list[RequestOutput]:
        """One step; finished outputs a generate() call owns are handed to it, the rest returned."""
        with nvtx_range("step"):
            advanced = self._advance()
        unowned = []
        for req in advanced:
            owner = self._owners.get(req.request_id)
            if owner is None:
                unowned.append(req.output_since_reported(self.tokenizer))
            elif req.finish_reason is not None:  # a generate() call takes only the final output
                owner[req.request_id] = req.output_since_reported(self.tokenizer)
                del self._owners[req.request_id]
                self._known.discard(req.request_id)
        return unowned

    def _advance(self) -> list[Request]:
        """The requests this step advanced or finished, each once."""
        stepped: list[Request] = []
        s = self.scheduler
        try:
            running = list(s.running)
            # A mixed step: the running requests decode inside the prefill's forward, which spares a forward
            # whenever a prompt arrives (or continues) while others decode.
            extended = self._forward(None, lambda: s.extend_plans(running), stepped) \
                if self.mixed_steps and s.can_mix(running) else []
            if extended and extended[0].decoding:
                return self._advanced(stepped)
            if running:
                self._forward(running, lambda: s.decode_plans(
                    running, self.drafter.propose(running) if self.drafter is not None else None), stepped)
            if not extended:  # after the decode, so the slots it freed are reused at once
                self._forward(None, s.extend_plans, stepped)
        except BaseException:  # an interrupt: what finished in this step is delivered with the next one
            self._finished += [r for r in stepped if r.finish_reason is not None]
            raise
        return self._advanced(stepped)

    def _advanced(self, stepped: list[Request]) -> list[Request]:
        advanced, self._finished = self._finished + stepped, []
        return list(dict.fromkeys(advanced))

    def _forward(self, batch: list[Request] | None, plans_of, stepped: list[Request]) -> list[StepPlan]:
        """One forward of the running requests (`batch`: a plan per bucket-sized piece) or of the prompts
        being prefilled (one extend plan, mixed or not); the plans it ran. Contained: if drafting, a forward
        or recording its tokens raises, the requests fail (their pool state may be half-written) and are
        freed, and the engine carries on. An interrupt (KeyboardInterrupt, SystemExit) fails them the same
        way, then propagates."""
        plans, reqs, error = [], list(batch or []), None
        try:
            plans = plans_of()
        except BaseException as e:
            if batch is None:  # admission itself failed, not a request: loads it started still finish
                self.cache.finish_loads()
                raise
            error = e
            _fail(reqs, e)
        extend = bool(plans) and plans[0].kind is StepKind.EXTEND
        if plans:
            rows = [self.scheduler.requests_of(plan) for plan in plans]
            reqs = [r for plan_rows in rows for r in plan_rows]
            with self.cache.host_loads() if extend else contextlib.nullcontext():
                try:
                    results = [self._execute(plan, plan_rows) for plan, plan_rows in zip(plans, rows)]
                    for plan, plan_rows, (sampled, hidden) in zip(plans, rows, results):
                        emitted = self.scheduler.record(plan, plan_rows, sampled) if sampled is not None else []
                        if self.drafter is not None and extend:
                            self.drafter.observe_prefill(plan_rows, [len(t) for t in plan.tokens], hidden)
                        elif self.drafter is not None:
                            self.drafter.observe_tokens(plan_rows, emitted, hidden)
                    if not extend or plans[0].decoding:
                        self.scheduler.count_step(StepKind.DECODE if extend else plans[0].kind)
                except BaseException as e:
                    if self._closed is not None:  # a tensor-parallel engine stopped every rank
                        raise
                    error = e
                    _fail(reqs, e)  # before the commit below: a failed request's pages are not cached
                if extend:  # prefilled pages enter the prefix cache before any slot goes back
                    self.scheduler.finish_extend(plans[0], reqs)
        if error is not None:
            if self.ranks is not None and self.ranks.dead():
                self._raise_stopped(reqs, error)
            if isinstance(error, Exception):
                log.exception("a step failed; failing its %d request(s)", len(reqs), exc_info=error)
            stepped.extend(reqs)
        elif extend:  # rows that end their prompt took a token
            stepped.extend(r for r, takes in zip(reqs, plans[0].sampled) if takes)
        else:
            stepped.extend(reqs)
        for req in reqs:  # finished: slot and pages go back before anything else runs
            if req.finish_reason is not None and self.scheduler.get(req.request_id) is req:
                self._release(req)
        if error is not None and not isinstance(error, Exception):
            raise error
        return plans

    def _execute(self, plan: StepPlan, reqs: list[Request]):
        try:
            return self.worker.execute(plan)
        except BaseException as e:
            if self.worker.ranks is not None:  # the plan went out: the ranks' collectives may be out of step
                self._raise_stopped(reqs, e)
            raise

    def _raise_stopped(self, reqs: list[Request], error: BaseException) -> None:
        """A tensor-parallel engine failed where its ranks were working together (a forward, a warm-up, a
        report): every rank is stopped and the engine's requests fail. The caller gets a ParallelError that
        says which rank went and how, or an interrupt as itself."""
        cause, text = self.ranks.dead(), str(error).lower()
        if cause is None and ("timed out" in text or "timeout" in text):
            cause = (f"a rank did not answer within tensor_parallel_timeout={self.ranks.timeout:g} s "
                     f"({type(error).__name__}: {error})")
        cause = cause or f"{type(error).__name__}: {error}"
        self.ranks.close(graceful=False)
        self._closed = f"tensor-parallel engine failed, every rank was stopped: {cause}"
        s = self.scheduler
        for req in [*reqs, *s.running, *s.prefilling, *s.waiting]:
            if req.finish_reason is None:
                req.fail(self._closed)
        s.waiting.clear()
        s.running.clear()
        s.prefilling.clear()
        s.requests.clear()
        if not isinstance(error, Exception):
            raise error
        raise ParallelError(self._closed) from error

    def _check_open(self) -> None:
        if self._closed is not None:
            raise (ParallelError if self.ranks is not None else InklingError)(self._closed)

    def close(self) -> None:
        """Stops the engine: with tensor parallelism the other ranks exit (and the process group goes, so
        another engine can start); later calls raise. Engines are also context managers."""
        with self._lock:
            if self._closed is None:
                self._closed = "the engine is closed"
            s = self.scheduler
            for req in [*s.running, *s.prefilling, *s.waiting]:
                self._release(req)
            self._finished.clear()
            self._undelivered.clear()
            if self.ranks is not None:
                self.ranks.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rank_report(self) -> dict:
        """This rank's share: its rank, parameters held (count and bytes, and each one's shape), and the
        census of every graph its compile backend recorded (a `graphs.GraphRecorder` backend)."""
        return self.worker.rank_report(self.ranks.rank if self.ranks is not None else 0)

    def parallel_report(self) -> list[dict]:
        """`rank_report()` of every rank, rank 0 first (one entry without tensor parallelism)."""
        with self._lock:
            if self.worker.ranks is None:
                return [self.rank_report()]
            self._check_open()
            try:
                return self.worker.reports()
            except BaseException as e:
                self._raise_stopped([], e)

    # ---- offline --------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion (continuous batching underneath); outputs in prompt order.

        Every prompt is checked before any is queued. Other requests in the engine advance too; their
        outputs are kept for the next `step()` call, not dropped."""
        prompts = prompt_list(prompts)
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"{len(per_prompt)} sampling parameter sets for {len(prompts)} prompts")
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            p = p if p is not None else SamplingParams()
            try:
                checked.append((*self._checked(prompt, p), p))
            except RequestError as e:
                raise RequestError(f"prompt {i}: {e}") from None
        final: dict[str, RequestOutput] = {}
        with self._lock:
            self._check_open()
            rids = [self._queue(ids, p, budget, None) for ids, budget, p in checked]
            self._owners.update((rid, final) for rid in rids)
        try:
            while True:
                with self._lock:  # another thread's step() may finish ours: `final` is filled under the lock
                    if len(final) == len(rids):
                        break
                    for out in self._step():
                        earlier = self._undelivered.get(out.request_id)
                        self._undelivered[out.request_id] = out if earlier is None else out.absorb(earlier)
        except BaseException:  # interrupted: the requests become ordinary ones that step() delivers
            with self._lock:
                for rid in rids:
                    self._owners.pop(rid, None)
                    if rid in final:
                        self._undelivered[rid] = final[rid]
                        self._known.add(rid)
            raise
        return [final[r] for r in rids]


def _fail(reqs: list[Request], error: BaseException) -> None:
    for req in reqs:
        req.fail(f"{type(error).__name__}: {error}")
