"""The serving engine: requests in, tokens out, continuous batching over the state pool.

Each `step()` decodes every running request as one batched forward, then prefills up to
`prefill_chunk_tokens` prompt tokens as one packed varlen forward: first the next chunks of prompts
already being prefilled, then the first chunks of waiting requests that fit (a free slot and the pages
for their whole budget). A request whose prompt is complete takes its first token from that forward
and decodes from the next step on. Requests finish (eos, stop token, length) or are aborted at any
step; their slot and pages go back to the pool at once.

Failure is contained: if anything raises inside a step's forward, the requests of that forward are
finished with `finish_reason="error"` (their state may be half-written) and freed, and the engine
goes on serving. Every public method takes one lock, so threads may add, abort and step concurrently.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import random
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import torch

from .backend import StepBackend
from .cache import StatePool
from .cache.pool import each_layer
from .cache.budget import UnitCosts, split_budget
from .cache.host_tier import HostLoad, Loads
from .cache.prefix import Hit, PrefixCache
from .checks import option_bool, option_int
from .config import InklingConfig
from .custom_ops.library import build_in_background
from .errors import InklingError, OptionError, RequestError
from . import custom_ops, graphs, torch_state
from .graphs import CompiledDecoder, choose_buckets, package
from .kv_layout import pages_for
from .loading import load_model, resolve_device
from .model import InklingForCausalLM
from .nvtx import nvtx_range
from .parallel import runtime as parallel
from .parallel.group import check_divisible
from .progress import StageLog
from .requests import Request, RequestOutput, prompt_ids, prompt_list
from .runner import CompiledRunner, DecodeStep, EagerRunner, StepOutput, VerifyOutput, VerifyStep
from .sampling import SamplingParams
from .speculative import MAX_SPECULATIVE_TOKENS, make_drafter
from .tokenizer import TextTokenizer
from .torch_state import PinnedTorchState

log = logging.getLogger("inkling_compiled")

__all__ = ["Engine", "RequestOutput"]


def _request_id(request_id) -> str:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise RequestError(f"a request id must be a str or an int, got {type(request_id).__name__}")
    return str(request_id)


class Engine:
    def __init__(self, model: InklingForCausalLM, *, tokenizer: TextTokenizer | None = None, device="cpu",
                 compile: bool = True, max_batch_size: int = 32, max_model_len: int = 2048,
                 prefill_chunk_tokens: int = 256, page_size: int = 16, num_pages: int | None = None,
                 seed: int = 0, buckets: tuple[int, ...] | None = None, compile_backend: str = "inductor",
                 compile_mode: str | None = None, compile_cache_dir: str | Path | None = None,
                 cpp_wrapper: bool | None = None, graph_per_bucket: bool = False,
                 specialize_batch_one: bool = False, compile_package: bool = True, layer_transfer: bool = False,
                 warmup: bool = True,
                 progress: bool = True, prefix_cache: bool = True, prefix_checkpoints: int | None = None,
                 state_memory_bytes: int | None = None, host_cache_bytes: int = 0, speculative=None,
                 num_speculative_tokens: int = 2, max_prefill_tokens=None, ranks: parallel.Ranks | None = None):
        config: InklingConfig = model.config
        self.model, self.config, self.tokenizer = model, config, tokenizer
        if max_prefill_tokens is not None:
            raise OptionError("max_prefill_tokens was replaced by prefill_chunk_tokens: the prompt tokens one step "
                              "prefills (a longer prompt is prefilled over several steps)")
        for name, flag in (("compile", compile), ("graph_per_bucket", graph_per_bucket),
                           ("specialize_batch_one", specialize_batch_one),
                           ("layer_transfer", layer_transfer), ("warmup", warmup), ("progress", progress),
                           ("prefix_cache", prefix_cache)):
            option_bool(name, flag)
        self.device = resolve_device(device)
        # Tensor parallelism (`from_pretrained(..., tensor_parallel_size=N)`): this engine is one rank's.
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        if self.ranks is not None:
            self._check_parallel_options(dict(speculative=speculative, host_cache_bytes=host_cache_bytes,
                                              cpp_wrapper=cpp_wrapper))
            cpp_wrapper = False
        self._closed: str | None = None  # why the engine no longer steps (closed, or a rank failed)
        self.max_batch_size = option_int("max_batch_size", max_batch_size)
        self.max_model_len = option_int("max_model_len", max_model_len, 2)
        page_size = option_int("page_size", page_size)
        # Prompt tokens one step prefills (all requests together): a long prompt takes several steps,
        # and no step's prefill is longer than this, so decoding requests keep their pace.
        # (never more than every slot's whole context: the metadata buffers are sized for it)
        self.prefill_chunk_tokens = min(option_int("prefill_chunk_tokens", prefill_chunk_tokens),
                                        self.max_batch_size * self.max_model_len)
        option_int("seed", seed, 0)
        buckets = choose_buckets(max_batch_size, buckets)  # checked whether or not they are compiled
        pages_per_seq = pages_for(max_model_len, page_size)
        dtype = model.lm_head.weight.dtype
        # Speculative decoding: K drafts per request and step, checked by one verify forward.
        option_int("num_speculative_tokens", num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        self.num_speculative_tokens = num_speculative_tokens if speculative is not None else 0
        self.drafter = make_drafter(speculative, self.num_speculative_tokens, model)  # checked before any allocation
        self.speculative = speculative if speculative is None or isinstance(speculative, str) \
            else type(speculative).__name__
        draft_tokens = self.num_speculative_tokens
        # At least one: a cache that can keep no state at any boundary could never be resumed from.
        checkpoints = None if prefix_checkpoints is None else option_int("prefix_checkpoints", prefix_checkpoints, 1)
        checkpoints = checkpoints if prefix_cache else 0
        self.unit_costs = UnitCosts.of(config, page_size, dtype, draft_tokens)
        if state_memory_bytes is not None:  # one budget: slots first, then checkpoints, then pages
            if num_pages is not None:
                raise OptionError("give num_pages or state_memory_bytes, not both: the budget decides the pages")
            num_pages, checkpoints = split_budget(
                self.unit_costs, option_int("state_memory_bytes", state_memory_bytes), max_batch_size=max_batch_size,
                checkpoints=checkpoints, min_pages=pages_for(2, page_size))
        if num_pages is None:
            num_pages = max_batch_size * pages_per_seq + 1  # every slot can hold a full-length request
        option_int("num_pages", num_pages, 2)  # one of them is the dummy
        if pages_for(2, page_size) > num_pages - 1:  # not even a one-token prompt and one new token fit
            raise OptionError(f"num_pages={num_pages} holds no request: a 2-token request needs "
                              f"{pages_for(2, page_size)} pages of {page_size} beside the dummy")
        checkpoints = 4 * max_batch_size if checkpoints is None else checkpoints
        self.pool = StatePool(config, max_slots=max_batch_size, num_pages=num_pages, page_size=page_size,
                              max_pages_per_seq=pages_per_seq, dtype=dtype, device=self.device,
                              layer_transfer=layer_transfer, checkpoints=checkpoints,
                              spec_draft_tokens=draft_tokens + 1 if draft_tokens else 0)
        # Shared prompt prefixes: full KV pages and the state at their boundaries (see cache/prefix.py).
        self.prefix = PrefixCache(self.pool, option_int("host_cache_bytes", host_cache_bytes, 0)) \
            if prefix_cache else None
        self._loads: list = []  # (HostLoad, the Reload it carries out) admitted this step
        if self.drafter is not None:
            self.drafter.attach(self.pool, self.max_model_len)
        self._user_counter = None  # a layer-transfer counter attached by the caller
        self.backend = StepBackend(self.pool, config, max_batch_size=max_batch_size,
                                   max_tokens=self.prefill_chunk_tokens, device=self.device,
                                   draft_tokens=draft_tokens)
        self.decoder = self.verifier = None
        compile_package = option_bool("compile_package", compile_package)
        if compile:
            graph_options = dict(device=self.device, buckets=buckets, compile_backend=compile_backend, mode=compile_mode,
                                 cache_dir=compile_cache_dir, cpp_wrapper=cpp_wrapper,
                                 guarded_sources=DecodeStep.GUARDED_SOURCES)
            # The decode step saved whole in the compile cache, for later processes to load instead of
            # tracing (graphs/package.py); not under tensor parallelism or with a HiCache barrier.
            package_key = self._package_key() if compile_package and ranks is None and not layer_transfer else None
            self.decoder = CompiledDecoder(DecodeStep(model, self.backend), self.backend.prepare_padding,
                                           graph_per_bucket=graph_per_bucket, specialize_batch_one=specialize_batch_one,
                                           package_key=package_key, **graph_options)
            # A loaded package traces nothing, and its guards expect the metadata's slices unmarked; if it
            # is dropped for tracing after all, the slices are marked again.
            buffers, decoder = self.backend.buffers, self.decoder
            buffers.symbolic_batch = None if decoder.load_package() else decoder.symbolic_batch
            decoder.on_unpackage = lambda: buffers.mark_for_tracing(decoder.symbolic_batch)
            if self.drafter is not None:  # verify graphs: static, one per bucket (for this K)
                self.verifier = CompiledDecoder(
                    VerifyStep(model, self.backend, self.drafter.needs_hidden), self.backend.prepare_verify_padding,
                    graph_per_bucket=True, **graph_options)
            self.runner = CompiledRunner(model, self.backend, self.decoder, self.verifier)
        else:
            self.runner = EagerRunner(model, self.backend)
            self.runner.with_hidden = self.drafter is not None and self.drafter.needs_hidden
        self.counters = dict.fromkeys(("decode_steps", "verify_steps", "row_steps", "decode_tokens", "spec_proposed",
                                       "spec_accepted"), 0)
        # Steps run under the torch state the graphs are compiled for, whatever the caller sets later.
        self.torch_state = PinnedTorchState()
        self._lock = threading.RLock()
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted (slot and pages held), prompt partly in the pool
        self.running: list[Request] = []  # prompt in the pool: decoding
        self._finished: list[Request] = []  # finished outside a forward (aborted, interrupted): output pending
        self._known: set[str] = set()  # ids of requests whose final output has not been returned yet
        self._owners: dict[str, dict[str, RequestOutput]] = {}  # request id -> the generate() call awaiting it
        self._undelivered: dict[str, RequestOutput] = {}  # outputs generate() stepped past, for step() to return
        self._progress = progress
        StageLog(progress).finish(self.memory_summary())
        if compile and warmup:
            self.warm_up()
        if self.ranks is not None and self.ranks.rank == 0:  # from now on every forward is sent to every rank
            self.runner.mirror = parallel.StepMirror(self.ranks, self.pool, self.backend)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype=None, compile: bool = True,
                        max_batch_size: int = 32, check_finite: bool = True, **kwargs) -> "Engine":
        """Loads a checkpoint folder. compile=True (default) runs decode steps through the compiled
        graph (every bucket warmed up here); compile=False is the eager reference path. check_finite
        refuses a checkpoint with NaN or inf weights."""
        build_in_background()  # the C++ kernels (first time only) build while the weights load and compile
        # The MTP head is loaded only for MTP drafting, one depth per speculative token.
        mtp_depths = 0
        if kwargs.get("speculative") == "mtp":
            mtp_depths = option_int("num_speculative_tokens", kwargs.get("num_speculative_tokens", 2), 1,
                                    MAX_SPECULATIVE_TOKENS)
        world = option_int("tensor_parallel_size", kwargs.pop("tensor_parallel_size", 1))
        timeout = kwargs.pop("tensor_parallel_timeout", 300.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise OptionError(f"tensor_parallel_timeout must be a positive number of seconds, got {timeout!r}")
        if world > 1:
            return cls._from_pretrained_parallel(path, world, timeout, device, dtype, check_finite,
                                                 dict(compile=compile, max_batch_size=max_batch_size, **kwargs))
        model, _ = load_model(path, device=device, dtype=dtype, check_finite=check_finite, mtp_depths=mtp_depths)
        return cls(model, tokenizer=TextTokenizer.from_checkpoint(path), device=device, compile=compile,
                   max_batch_size=max_batch_size, **kwargs)

    @classmethod
    def _from_pretrained_parallel(cls, path, world: int, timeout, device, dtype, check_finite: bool,
                                  options: dict) -> "Engine":
        """Rank 0 of `world`: spawns ranks 1.. on this machine, or joins the group torchrun started (where
        the other ranks serve rank 0's steps inside this call and exit when it closes the engine)."""
        unknown = sorted(set(options) - set(inspect.signature(cls.__init__).parameters) - {"self", "model", "ranks"})
        if unknown:  # before any rank starts (each would build an engine and fail alike)
            raise TypeError(f"Engine.from_pretrained() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        cls._check_parallel_options(options)
        check_divisible(InklingConfig.from_file(Path(path)), world)  # before any process starts
        device = resolve_device(device)
        load_options = dict(dtype=dtype, check_finite=check_finite)
        # The other ranks only run the forwards rank 0 sends: which drafter proposes is rank 0's business,
        # they need only the number of draft tokens to verify.
        worker_options = {**options, "speculative": "ngram" if options.get("speculative") is not None else None,
                          "progress": False}
        if parallel.launched_by_torchrun():
            ranks = parallel.join(world, device, float(timeout))
            if ranks.rank != 0:
                local = torch.device(device.type, int(os.environ.get("LOCAL_RANK", ranks.rank))) \
                    if device.type == "cuda" else device
                parallel.serve_rank(ranks, path, local, load_options, worker_options)
                raise SystemExit(0)
        else:
            ranks = parallel.spawn(world, device, float(timeout), (str(path), str(device), load_options, worker_options))
        try:
            model, _ = load_model(path, device=device, tensor_parallel=(0, world, ranks.compute_group), **load_options)
            engine = cls(model, tokenizer=TextTokenizer.from_checkpoint(path), device=device, ranks=ranks, **options)
        except BaseException as e:
            dead = ranks.dead()
            ranks.close(graceful=False)
            if dead is not None and not isinstance(e, InklingError):  # an option error is rank 0's to report too
                raise parallel.ParallelError(f"{dead} while the engine was starting") from e
            raise
        weakref.finalize(engine, ranks.close)  # at exit or when dropped, the other ranks go too
        return engine

    @staticmethod
    def _check_parallel_options(options: dict) -> None:
        if options.get("speculative") == "mtp":
            raise OptionError("speculative='mtp' is not supported with tensor parallelism (the MTP head is not "
                              "sharded): use speculative='ngram'")
        if options.get("host_cache_bytes"):
            raise OptionError("host_cache_bytes (the prefix cache's host tier) is not supported with tensor "
                              "parallelism: leave it 0")
        if options.get("cpp_wrapper"):
            raise OptionError("cpp_wrapper=True is not supported with tensor parallelism: inductor's C++ wrapper "
                              "cannot call the collectives (torch 2.13); leave it None")

    def warm_up(self, buckets: Sequence[int] | None = None) -> dict[int, float]:
        """Compiles (or loads from the cache) the decode graphs of `buckets` (default: all) now, rather
        than on their first use; seconds per bucket. Engines built with warmup=True (the default) have
        done this for every bucket; a bucket never warmed up compiles on first use."""
        if self.decoder is None:
            return {}
        if buckets is not None:
            buckets = tuple(buckets)
            if any(b not in self.decoder.buckets for b in buckets):
                raise OptionError(f"buckets {buckets!r} are not all among the engine's buckets {self.decoder.buckets}")
        stages = StageLog(self._progress)
        t0 = time.perf_counter()
        with self._lock, self.torch_state.pinned():
            mirror = self.runner.mirror
            if mirror is not None:  # every rank compiles the same graphs, collectives and all
                self._check_open()
                mirror.warm_up(buckets)
            try:
                seconds = self.decoder.warmup(progress=stages, buckets=buckets)
                if self.verifier is not None:
                    verify = self.verifier.warmup(progress=lambda message, done, total: stages(
                        message.replace("decode step", f"verify step (K={self.num_speculative_tokens})"), done,
                        total), buckets=buckets)
                    seconds = {b: seconds[b] + verify.get(b, 0.0) for b in seconds}
            except BaseException as e:
                if mirror is not None:  # the other ranks are inside warm-up steps this rank left
                    self._raise_stopped([], e)
                raise
            if mirror is not None:
                mirror.in_step = False
        verify_note = f" and {len(self.verifier.graphs())} verify graph(s)" if self.verifier is not None else ""
        stages.finish(f"decode step ready: {len(self.decoder.graphs())} graph(s){verify_note} for buckets "
                      f"{', '.join(map(str, sorted(self.decoder.graph_of)))} in {time.perf_counter() - t0:.1f} s")
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
        if self.pool.pages_needed(budget) > self.pool.pages.capacity:
            raise RequestError(f"the request needs {self.pool.pages_needed(budget)} KV pages but the pool has "
                               f"{self.pool.pages.capacity}; lower max_new_tokens or enlarge num_pages")
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
        self.waiting.append(Request(request_id, ids, params, seed, frozenset(stop), budget))
        self._known.add(request_id)
        return request_id

    def abort(self, request_id: str | int) -> None:
        """Finishes a waiting or running request with finish_reason="abort"; its slot and pages are freed
        at once, and the next step() returns its final output."""
        rid = _request_id(request_id)
        with self._lock:
            req = next((r for r in self.waiting if r.request_id == rid), None)
            if req is not None:
                self.waiting.remove(req)
            else:
                req = next((r for r in self.running + self.prefilling if r.request_id == rid), None)
                if req is None:
                    raise RequestError(f"no unfinished request with id {rid!r}")
                self._release(req)
            req.finish_reason = "abort"
            self._finished.append(req)

    def attach_layer_transfer_counter(self, counter) -> None:
        """Attach a HiCache-style counter (`wait_until(layer_id)`): every step then waits for a layer's
        transfer before touching its state. Compiled engines built with layer_transfer=True wait at each
        layer inside the graph (the rest of the step overlaps the transfer); others wait for every layer
        before the replay starts."""
        if counter is not None and not callable(getattr(counter, "wait_until", None)):
            raise OptionError(f"a layer-transfer counter needs a wait_until(layer_id) method; "
                              f"{type(counter).__name__} has none")
        with self._lock:
            self._user_counter = counter
            self.pool.register_layer_transfer_counter(counter)

    def _package_key(self) -> tuple:
        """Everything the decode graph holds as a constant: our sources, the model and its weights' layout,
        the dtype, the page size, the ring's length, each state tensor's per-row shape and the torch state
        the steps are pinned to. The pool's sizes are symbols, so they are not in it."""
        pool = self.pool
        return (package.source_hash(sys.modules[__package__], custom_ops, graphs), repr(self.config),
                str(self.model.lm_head.weight.dtype), pool.page_size, pool.ring_size,
                [tuple(t.shape[1:]) for t in (*pool.state_tensors(), *pool.draft_windows())],
                [(tuple(p.shape), p.stride(), str(p.dtype)) for p in self.model.parameters()],
                [(name, repr(get())) for name, (get, _) in torch_state.SETTINGS.items()])

    def memory_report(self) -> dict[str, int]:
        """Bytes of each part of what the engine holds, and how many units of each the pool has."""
        pool, buffers = self.pool, self.backend.buffers

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "weights": size(self.model.parameters()),
            "slot conv windows": size(each_layer(pool.conv.values())),
            "slot sliding rings": size(each_layer(pool.sliding_kv)),
            "KV pages": size(each_layer(pool.global_kv)),
            "prefix checkpoints": size([*pool.conv_checkpoints.values(), *pool.ring_checkpoints]),
            "draft windows": size(pool.draft_windows()),
            "drafter state": size(self.drafter.state_tensors()) if self.drafter is not None else 0,
            "step metadata": sum(r.bytes.numel() for r in (buffers.decode_region, buffers.prefill_region,
                                                            buffers.verify_region) if r is not None),
            "slots": pool.max_slots, "pages": pool.num_pages - 1, "page_size": pool.page_size,
            "checkpoints": pool.checkpoints.capacity,
        }

    def memory_summary(self) -> str:
        """`memory_report()` as one line (what start-up prints)."""
        r = self.memory_report()

        def mib(n: int) -> str:
            return f"{n / 2**20:.1f} MiB"

        return (f"memory: weights {mib(r['weights'])}; {r['slots']} slots "
                f"{mib(r['slot conv windows'] + r['slot sliding rings'])}; {r['pages']} KV pages of "
                f"{r['page_size']} tokens {mib(r['KV pages'])}; {r['checkpoints']} prefix checkpoints "
                f"{mib(r['prefix checkpoints'])}; step metadata {r['step metadata'] / 1024:.0f} KiB"
                + (f"; speculative state {mib(r['draft windows'] + r['drafter state'])}"
                   if r["draft windows"] + r["drafter state"] else ""))

    def clear_prefix_cache(self) -> int:
        """Drops every prefix-cache entry no running request resumed from (their pages and checkpoints
        go back to the pool); how many were dropped."""
        with self._lock:
            return self.prefix.clear() if self.prefix is not None else 0

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.prefilling or self.running or self._finished or self._undelivered)

    # ---- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advances every unfinished request by one token; returns the cumulative outputs of the requests
        that advanced or finished (and of any that `generate` stepped past for this caller). Outputs of
        requests a `generate` call is waiting for go to that call instead."""
        with self._lock:
            self._check_open()
            latest = dict(self._undelivered)
            latest.update((o.request_id, o) for o in self._step())  # cumulative: the newest one says it all
            self._undelivered.clear()
            self._known.difference_update(rid for rid, o in latest.items() if o.finished)
            return list(latest.values())

    def _step(self) -> list[RequestOutput]:
        """One step; finished outputs a generate() call owns are handed to it, the rest returned."""
        with nvtx_range("step"):
            outputs = self._advance()
        unowned = []
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:
                unowned.append(out)
            elif out.finished:
                owner[out.request_id] = out
                del self._owners[out.request_id]
                self._known.discard(out.request_id)
        return unowned

    def _advance(self) -> list[RequestOutput]:
        stepped: list[Request] = []

        def run(batch: list[Request], forward, sampled: list[Request], after=None) -> None:
            stepped.extend(sampled)
            try:
                self._run_contained(batch, forward, sampled)
            finally:  # an interrupt too: it failed the batch before propagating
                # a failed forward also ends the requests that were not to sample (a prompt's middle chunk)
                stepped.extend(r for r in batch if r.finish_reason is not None and r not in sampled)
                if after is not None:
                    after()
            for req in batch:  # finished: slot and pages go back before anything else runs
                if req.finish_reason is not None and self._holds(req):
                    self._release(req)

        try:
            if self.running:
                batch = list(self.running)
                run(batch, self._decode, batch)
            chunks = self._schedule_prefill()  # after the decode, so the slots it freed are reused at once
            if chunks:
                batch, lengths = [r for r, _ in chunks], [n for _, n in chunks]
                complete = [r for r, n in chunks if r.prefilled + n == len(r.prompt)]
                checkpoints = self._plan_checkpoints(chunks)
                if self._loads:  # cached prefixes coming back from the host tier: layer L waits for them
                    counters = [load for load, _ in self._loads]
                    counters += [self._user_counter] if self._user_counter is not None else []
                    self.pool.register_layer_transfer_counter(Loads(counters))
                try:
                    run(batch, lambda reqs: self._prefill(reqs, lengths, checkpoints), complete,
                        after=lambda: self._cache_prefixes(chunks, checkpoints))
                finally:
                    self._finish_loads()
                for req, n in chunks:
                    if req.finish_reason is None:
                        req.prefilled += n
                        if req in complete:  # its first token is out: it decodes from the next step
                            self.prefilling.remove(req)
                            self.running.append(req)
        except BaseException:  # an interrupt: what finished in this step is delivered with the next one
            self._finished += [r for r in stepped if r.finish_reason is not None]
            if self._loads:  # an interrupt before the prefill forward: the loads still finish
                self._finish_loads()
            raise
        advanced, self._finished = self._finished + stepped, []
        return [self._output(r) for r in advanced]

    def _run_contained(self, reqs: list[Request], forward: Callable[[list[Request]], StepOutput],
                       sampled: list[Request]) -> None:
        """One forward for `reqs`, and the tokens of the `sampled` ones recorded (a prefill chunk that does
        not end its prompt samples nothing); if anything raises, those requests fail (their pool state
        may be half-written) and are freed, and the engine carries on. An interrupt (KeyboardInterrupt,
        SystemExit) fails them the same way, then propagates."""
        try:
            with self.torch_state.pinned():
                out = forward(reqs)
            self._record(reqs, out, sampled)
        except BaseException as e:
            if self.ranks is not None and (self.runner.mirror.in_step or self.ranks.dead()):
                self._raise_stopped(reqs, e)  # the ranks' collectives may be out of step: none can go on
            if isinstance(e, Exception):
                log.exception("a step failed; failing its %d request(s)", len(reqs))
            for req in reqs:
                req.fail(f"{type(e).__name__}: {e}")
                if self._holds(req):
                    self._release(req)
            if not isinstance(e, Exception):
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
        for req in [*reqs, *self.running, *self.prefilling, *self.waiting]:
            if req.finish_reason is None:
                req.fail(self._closed)
        self.waiting.clear()
        self.running.clear()
        self.prefilling.clear()
        if not isinstance(error, Exception):
            raise error
        raise parallel.ParallelError(self._closed) from error

    def _check_open(self) -> None:
        if self._closed is not None:
            raise (parallel.ParallelError if self.ranks is not None else InklingError)(self._closed)

    def close(self) -> None:
        """Stops the engine: with tensor parallelism the other ranks exit (and the process group goes, so
        another engine can start); later calls raise. Engines are also context managers."""
        with self._lock:
            if self._closed is None:
                self._closed = "the engine is closed"
            for req in [*self.running, *self.prefilling]:
                self._release(req)
            self.waiting.clear()
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
        from .graphs.census import census

        params = dict(self.model.named_parameters())
        recorder = getattr(self.decoder, "compiler", None)
        return {"rank": self.ranks.rank if self.ranks is not None else 0,
                "parameters": sum(p.numel() for p in params.values()),
                "parameter_bytes": sum(p.numel() * p.element_size() for p in params.values()),
                "shapes": {name: tuple(p.shape) for name, p in params.items()},
                "graphs": [census(gm) for gm in getattr(recorder, "graphs", [])]}

    def parallel_report(self) -> list[dict]:
        """`rank_report()` of every rank, rank 0 first (one entry without tensor parallelism)."""
        with self._lock:
            if self.runner.mirror is None:
                return [self.rank_report()]
            self._check_open()
            try:
                return self.runner.mirror.reports(self.rank_report())
            except BaseException as e:
                self._raise_stopped([], e)

    def _decode(self, batch: list[Request]) -> StepOutput | VerifyOutput:
        """The decode forward: a verify step when the drafter has a guess for any request in the batch (or
        needs the hidden states only verify steps return), else plain decode. Inside the contained forward:
        a drafter that fails fails the batch like any step."""
        if self.drafter is None:
            return self.runner.decode(batch)
        K, full = self.num_speculative_tokens, []
        for req, draft in zip(batch, self.drafter.propose(batch)):
            draft = [int(t) for t in (draft or [])[:K]]
            if any(not 0 <= t < self.config.vocab_size for t in draft):
                raise ValueError(f"the drafter proposed a token outside the vocabulary for request {req.request_id!r}")
            # A token past the logits (the unpadded vocabulary) can never be the target's: the draft ends there.
            draft = list(itertools.takewhile(lambda t: t < self.config.logits_vocab_size, draft))
            req.drafted = len(draft)
            full.append(draft + [req.output[-1]] * (K - len(draft)))  # stand-ins, never accepted
        if not any(r.drafted for r in batch) and not self.drafter.needs_hidden:
            return self.runner.decode(batch)
        return self.runner.verify(batch, full)

    def _prefill(self, reqs: list[Request], lengths: list[int], checkpoints: dict) -> StepOutput:
        """The prefill forward, taking the planned prefix-cache checkpoints on the way."""
        context, starts = self.backend.context, itertools.accumulate([0] + lengths)
        context.checkpoints = [(row, start, req.prefilled, pages * self.pool.page_size, checkpoint)
                               for row, (req, start) in enumerate(zip(reqs, starts))
                               for pages, checkpoint in checkpoints[req].items()]
        try:
            out = self.runner.prefill(reqs, lengths)
        finally:
            context.checkpoints = []
        if self.drafter is not None:
            self.drafter.observe_prefill(reqs, lengths, out.hidden)
        return out

    def _plan_checkpoints(self, chunks: list[tuple[Request, int]]) -> dict[Request, dict[int, int]]:
        """request -> {pages: checkpoint index} for the page boundaries its chunk crosses that the prefix
        cache has no checkpoint for yet, deepest first (a longer shared prefix saves more), as many as
        free or evictable checkpoints allow."""
        planned: dict[Request, dict[int, int]] = {req: {} for req, _ in chunks}
        if self.prefix is None:
            return planned
        page = self.pool.page_size
        for req, n in chunks:
            for pages in range((req.prefilled + n) // page, req.prefilled // page, -1):
                if not self.prefix.needs_checkpoint(req.prompt, pages):
                    continue
                if not self.prefix.make_room(checkpoints=1):
                    return planned
                planned[req][pages] = self.pool.checkpoints.allocate(1)[0]
        return planned

    def _cache_prefixes(self, chunks: list[tuple[Request, int]], checkpoints: dict[Request, dict[int, int]]) -> None:
        """After a prefill forward: each request's full prompt pages enter the prefix cache with the
        checkpoints taken at their boundaries (a failed request's checkpoints are dropped)."""
        for req, n in chunks:
            planned = checkpoints[req]
            if req.finish_reason == "error" or self.prefix is None:
                self.pool.checkpoints.free(list(planned.values()))
                continue
            self.prefix.insert(req.prompt, (req.prefilled + n) // self.pool.page_size,
                               self.pool.pages_of[req.request_id], planned)

    def _admit(self, req: Request) -> bool:
        """Gives the request a slot and pages, resuming from the longest cached prefix of its prompt
        (evicting unused cache entries if pages are short); False if it must wait."""
        hit = self.prefix.lookup(req.prompt) if self.prefix is not None else Hit(None, 0)
        if hit.entry is None:
            if not self.pool.can_admit(req.budget) and not (
                    self.prefix is not None and self.prefix.make_room(pages=self.pool.pages_needed(req.budget))
                    and self.pool.can_admit(req.budget)):
                return False
            self.pool.allocate(req.request_id, req.budget)
            return True
        path = hit.entry.path()
        if any(entry.loading for entry in path):
            return False  # its prefix is still coming back from the host for another request: next step
        self.prefix.acquire(hit)  # pinned first: making room must not evict what it resumes from
        host_pages, checkpoint_on_host = self.prefix.on_host(hit)  # to come back from the host tier
        shared = len(path) if self.pool.pages_needed(1) else 0
        pages = self.pool.pages_needed(req.budget) - shared + len(host_pages)
        if not self.prefix.make_room(pages=pages, checkpoints=int(checkpoint_on_host)) or \
                not self.pool.can_admit(req.budget, shared - len(host_pages)):
            self.prefix.release(hit.entry)
            return False
        reload = self.prefix.reserve_reload(hit)  # fresh device pages and checkpoint; the data follows
        slot = self.pool.allocate(req.request_id, req.budget, [e.page for e in path] if shared else [])
        if reload:
            self.prefix.host_hits += 1
            checkpoint = reload.checkpoint
            load = HostLoad(self.pool, [(e.host, e.page) for e in reload.pages],
                            (checkpoint.host, checkpoint.checkpoint) if checkpoint else None, slot)
            self._loads.append((load.start(), reload))
        if not checkpoint_on_host:
            self.pool.restore_checkpoint(slot, hit.entry.checkpoint)
        req.prefix_entry, req.prefilled, req.cached_tokens = hit.entry, hit.tokens, hit.tokens
        self.prefix.hits += 1
        self.prefix.hit_tokens += hit.tokens
        return True

    def _finish_loads(self) -> None:
        """After the prefill forward: host loads are complete, their entries live on the device again; a
        load that failed gives its fresh pages and checkpoint back, and its entries stay on the host."""
        for load, reload in self._loads:
            load.join()
            self.prefix.finish_reload(reload, ok=load.error is None)
        self._loads.clear()
        self.pool.register_layer_transfer_counter(self._user_counter)

    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, prompt tokens to prefill now) within the step's budget, first come first served:
        prompts already being prefilled continue, then waiting requests are admitted while a slot and
        the pages for their whole budget are free (a prefix-cache hit starts past its cached tokens)."""
        chunks, budget = [], self.prefill_chunk_tokens
        for req in self.prefilling:
            if budget == 0:
                break
            n = min(len(req.prompt) - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        while budget and self.waiting and len(self.running) + len(self.prefilling) < self.max_batch_size:
            req = self.waiting[0]
            if not self._admit(req):
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            self.prefilling.append(req)
            n = min(len(req.prompt) - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        return chunks

    def _record(self, reqs: list[Request], out: StepOutput | VerifyOutput, sampled: list[Request]) -> None:
        if not sampled:
            return
        top_n = max(r.params.top_logprobs for r in sampled)
        if isinstance(out, VerifyOutput):
            self._record_verify(reqs, out, top_n)
            return
        tokens, chosen, top_ids, top_vals = out.to_host(top_n)
        for i, req in enumerate(reqs):
            if req in sampled:
                self._append(req, tokens[i], chosen[i], top_ids[i], top_vals[i])
        if sampled is reqs:  # a decode step (a prefill samples only the rows whose prompt it completes)
            self._count_decode(reqs, [1] * len(reqs), hidden=None)

    def _record_verify(self, reqs: list[Request], out: VerifyOutput, top_n: int) -> None:
        """Each row's accepted drafts and the target's own token after them, up to a stop or the length."""
        accepted, flat = out.to_host(top_n)
        T_d = self.num_speculative_tokens + 1
        emitted = []
        for i, req in enumerate(reqs):
            n = 0
            for j in range(i * T_d, i * T_d + accepted[i] + 1):
                self._append(req, flat.tokens[j], flat.chosen_logprobs[j], flat.top_ids[j], flat.top_logprobs[j])
                n += 1
                if req.finish_reason is not None:
                    break
            emitted.append(n)
            taken = min(accepted[i], req.drafted, n)  # drafts accepted and emitted (a stop may come first)
            req.spec_proposed += req.drafted
            req.spec_accepted += taken
            self.counters["spec_proposed"] += req.drafted
            self.counters["spec_accepted"] += taken
        self._count_decode(reqs, emitted, out.hidden, verify=True)

    def _count_decode(self, reqs: list[Request], emitted: list[int], hidden, verify: bool = False) -> None:
        self.counters["verify_steps" if verify else "decode_steps"] += 1
        self.counters["row_steps"] += len(reqs)
        self.counters["decode_tokens"] += sum(emitted)
        if self.drafter is not None:
            self.drafter.observe_tokens(reqs, emitted, hidden)

    def _append(self, req: Request, tok: int, chosen: float, top_ids: list[int], top_vals: list[float]) -> None:
        """One generated token; finishes the request on a stop token or at its length."""
        req.output.append(tok)
        if req.params.logprobs:
            req.logprobs.append(chosen)
        n = req.params.top_logprobs
        if n:
            req.top_logprobs.append(list(zip(top_ids[:n], top_vals[:n])))
        if tok in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output) >= req.params.max_new_tokens or len(req.prompt) + len(req.output) >= req.budget:
            req.finish_reason = "length"

    def stats(self) -> dict:
        """Counters since start: decode and verify steps, tokens they yielded, and with speculative decoding
        the drafts proposed and accepted (acceptance rate) and the mean tokens a request gains per step."""
        with self._lock:
            c = dict(self.counters)
        stats = {"speculative": self.speculative, "num_speculative_tokens": self.num_speculative_tokens, **c,
                 "acceptance_rate": c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else None,
                 "mean_tokens_per_step": c["decode_tokens"] / c["row_steps"] if c["row_steps"] else None}
        if self.prefix is not None:
            stats.update(prefix_hits=self.prefix.hits, prefix_hit_tokens=self.prefix.hit_tokens)
        return stats

    def _holds(self, req: Request) -> bool:
        """Whether the request holds a slot (it is prefilling or decoding)."""
        return req in self.running or req in self.prefilling

    def _release(self, req: Request) -> None:
        (self.running if req in self.running else self.prefilling).remove(req)
        self.pool.free(req.request_id)
        if self.drafter is not None:
            self.drafter.release(req)
        if self.prefix is not None:
            self.prefix.release(req.prefix_entry)
            req.prefix_entry = None

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output) if self.tokenizer is not None else None
        return RequestOutput(req.request_id, req.prompt, list(req.output),
                             list(req.logprobs) if req.params.logprobs else None,
                             list(req.top_logprobs) if req.params.top_logprobs else None, req.finish_reason, text,
                             req.error, req.cached_tokens, req.spec_proposed, req.spec_accepted)

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
                        self._undelivered[out.request_id] = out
        except BaseException:  # interrupted: the requests become ordinary ones that step() delivers
            with self._lock:
                for rid in rids:
                    self._owners.pop(rid, None)
                    if rid in final:
                        self._undelivered[rid] = final[rid]
                        self._known.add(rid)
            raise
        return [final[r] for r in rids]
