"""The serving engine: requests in, tokens out, continuous batching over the state pool.

Each `step()` admits waiting requests that fit (a free slot and the pages for their whole budget),
prefills them together as one packed varlen forward, and decodes every request that was already
running as one batched forward. Requests finish (eos, stop token, length) or are aborted at any step;
their slot and pages go back to the pool at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import deque
from pathlib import Path
from typing import Sequence

import torch

from .backend import StepBackend
from .cache import StatePool
from .config import InklingConfig
from .errors import CompileError, RequestError
from .loading import load_model
from .model import InklingForCausalLM
from .nvtx import nvtx_range
from .graphs import CompiledDecoder, choose_buckets
from .kv_layout import pages_for
from .metadata import RowSampling
from .runner import CompiledRunner, DecodeStep, EagerRunner, StepOutput
from .sampling import SamplingParams, fold_seed
from .tokenizer import TextTokenizer


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # "length" | "stop" | "abort" once finished
    text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # 32-bit
    stop_ids: frozenset[int]
    budget: int  # prompt + tokens it may generate, capped at max_model_len
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    @property
    def cached_len(self) -> int:
        """Tokens whose state is in the pool: the prompt and every generated token but the newest."""
        return len(self.prompt) + len(self.output) - 1

    def sampling_row(self) -> RowSampling:
        p = self.params
        return RowSampling(float(p.temperature), p.top_k, float(p.top_p), self.seed, len(self.output))


class Engine:
    def __init__(self, model: InklingForCausalLM, *, tokenizer: TextTokenizer | None = None, device="cpu",
                 compile: bool = True, max_batch_size: int = 32, max_model_len: int = 2048,
                 max_prefill_tokens: int | None = None, page_size: int = 16, num_pages: int | None = None,
                 seed: int = 0, buckets: tuple[int, ...] | None = None, compile_backend: str = "inductor",
                 compile_mode: str | None = None, compile_cache_dir: str | Path | None = None,
                 cpp_wrapper: bool | None = None, layer_transfer: bool = False, warmup: bool = True,
                 progress: bool = True):
        config: InklingConfig = model.config
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.device = torch.device(device)
        if max_batch_size < 1 or max_model_len < 2 or page_size < 1:
            raise ValueError("max_batch_size >= 1, max_model_len >= 2 and page_size >= 1 are required")
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.max_prefill_tokens = max_prefill_tokens or max_model_len
        pages_per_seq = pages_for(max_model_len, page_size)
        if num_pages is None:
            num_pages = max_batch_size * pages_per_seq + 1  # every slot can hold a full-length request
        dtype = model.lm_head.weight.dtype
        self.pool = StatePool(config, max_slots=max_batch_size, num_pages=num_pages, page_size=page_size,
                              max_pages_per_seq=pages_per_seq, dtype=dtype, device=self.device,
                              layer_transfer=layer_transfer)
        self.backend = StepBackend(self.pool, config, max_batch_size=max_batch_size,
                                   max_tokens=self.max_prefill_tokens, device=self.device)
        self.decoder = None
        if compile:
            self.decoder = CompiledDecoder(DecodeStep(model, self.backend), self.backend.prepare_padding,
                                           device=self.device, buckets=choose_buckets(max_batch_size, buckets),
                                           compile_backend=compile_backend, mode=compile_mode,
                                           cache_dir=compile_cache_dir, cpp_wrapper=cpp_wrapper)
            self.runner = CompiledRunner(model, self.backend, self.decoder)
            if warmup:
                self.decoder.warmup(progress=progress)
        else:
            self.runner = EagerRunner(model, self.backend)
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._aborted: list[Request] = []
        self._known: set[str] = set()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype=None, compile: bool = True,
                        max_batch_size: int = 32, **kwargs) -> "Engine":
        """Loads a checkpoint folder. compile=True (default) runs decode steps through the compiled
        per-bucket graphs (warmed up here); compile=False is the eager reference path."""
        model, _ = load_model(path, device=device, dtype=dtype)
        return cls(model, tokenizer=TextTokenizer.from_checkpoint(path), device=device, compile=compile,
                   max_batch_size=max_batch_size, **kwargs)

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._known:
            raise RequestError(f"request id {rid!r} is already in use")
        budget = min(len(ids) + params.max_new_tokens, self.max_model_len)
        if self.pool.pages_needed(budget) > self.pool.pages.capacity:
            raise RequestError(f"request {rid!r} needs {self.pool.pages_needed(budget)} KV pages but the pool has "
                               f"{self.pool.pages.capacity}; lower max_new_tokens or enlarge num_pages")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos and self.config.eos_token_id is not None:
            stop.add(self.config.eos_token_id)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        self.waiting.append(Request(rid, ids, params, fold_seed(seed), frozenset(stop), budget))
        self._known.add(rid)
        return rid

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompt given but the checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("empty prompt: at least one token is needed")
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.config.vocab_size]
        if bad:
            i, t = bad[0]
            raise RequestError(f"token id {t} at position {i} is out of range [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt of {len(ids)} tokens is too long: max_model_len={self.max_model_len} "
                               "leaves no room to generate")
        if len(ids) > self.max_prefill_tokens:
            raise RequestError(f"prompt of {len(ids)} tokens exceeds max_prefill_tokens={self.max_prefill_tokens}")
        return ids

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._known.discard(request_id)
                break
        else:
            req = next((r for r in self.running if r.request_id == request_id), None)
            if req is None:
                raise RequestError(f"no unfinished request with id {request_id!r}")
            self._release(req)
        req.finish_reason = "abort"
        self._aborted.append(req)

    def attach_layer_transfer_counter(self, counter) -> None:
        """Attach a HiCache-style counter (`wait_until(layer_id)`): every step then waits for a layer's
        transfer before touching its state. Compiled engines carry the per-layer barrier only when
        built with layer_transfer=True."""
        if self.decoder is not None and counter is not None and not self.pool.layer_transfer:
            raise CompileError("this compiled engine has no per-layer barrier in its graphs; "
                               "build it with layer_transfer=True to attach a layer-transfer counter")
        self.pool.register_layer_transfer_counter(counter)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    # ---- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advances every unfinished request by one token; returns their cumulative outputs."""
        with nvtx_range("step"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        advanced: list[Request] = self._aborted
        self._aborted = []
        decoding = list(self.running)
        if decoding:
            self._record(decoding, self.runner.decode(decoding))
        admitted = self._admit()
        if admitted:
            self._record(admitted, self.runner.prefill(admitted))
        advanced += decoding + admitted
        for req in decoding + admitted:
            if req.finish_reason is not None:
                self._release(req)
        return [self._output(r) for r in advanced]

    def _admit(self) -> list[Request]:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            if tokens + len(req.prompt) > self.max_prefill_tokens or not self.pool.can_admit(req.budget):
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            self.pool.allocate(req.request_id, req.budget)
            self.running.append(req)
            admitted.append(req)
            tokens += len(req.prompt)
        return admitted

    def _record(self, reqs: list[Request], out: StepOutput) -> None:
        tokens = out.tokens.tolist()
        chosen = out.chosen_logprobs.tolist()
        top_n = max(r.params.top_logprobs for r in reqs)
        top_ids = out.top_ids[:, :top_n].tolist() if top_n else None
        top_vals = out.top_logprobs[:, :top_n].tolist() if top_n else None
        for i, req in enumerate(reqs):
            tok = tokens[i]
            req.output.append(tok)
            if req.params.logprobs:
                req.logprobs.append(chosen[i])
            n = req.params.top_logprobs
            if n:
                req.top_logprobs.append(list(zip(top_ids[i][:n], top_vals[i][:n])))
            if tok in req.stop_ids:
                req.finish_reason = "stop"
            elif len(req.output) >= req.params.max_new_tokens or len(req.prompt) + len(req.output) >= req.budget:
                req.finish_reason = "length"

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.request_id)
        self._known.discard(req.request_id)

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output) if self.tokenizer is not None else None
        return RequestOutput(req.request_id, req.prompt, list(req.output),
                             list(req.logprobs) if req.params.logprobs else None,
                             list(req.top_logprobs) if req.params.top_logprobs else None, req.finish_reason, text)

    # ---- offline --------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion (continuous batching underneath); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"{len(per_prompt)} sampling parameter sets for {len(prompts)} prompts")
        rids = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                rids.append(self.add_request(prompt, p))
        except RequestError:
            for rid in rids:
                self.abort(rid)
            self._aborted = [r for r in self._aborted if r.request_id not in rids]
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(rids)
        while wanted - final.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[r] for r in rids]

