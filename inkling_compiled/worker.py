"""The worker: the model, the state pool, the step buffers and the runner, executing one `StepPlan` at a
time. It decides nothing about which requests run; it is all that the other ranks of a tensor-parallel
engine build.

It sizes the pool from the engine's options (one memory budget split between slots, checkpoints and
pages, or the pages asked for), compiles the decode step (and the verify step when drafts are
verified), warms them up, keys the saved package, and pins the torch state the graphs are compiled for.
On rank 0 of a tensor-parallel engine (`lead`) every plan and warm-up is sent to the other ranks first,
which execute the same plan on their shards (`parallel/runtime.serve`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import msgspec
import torch

from . import custom_ops, graphs, torch_state
from .backend import StepBackend
from .cache import StatePool
from .cache.budget import UnitCosts, split_budget
from .cache.pool import each_layer
from .checks import option_bool, option_int
from .errors import OptionError
from .graphs import Buckets, CompiledStep, choose_buckets, package
from .host_memory import keep_freed_memory
from .kv_layout import pages_for
from .model import InklingForCausalLM
from .parallel.ranks import StepChannel
from .quantize import is_weight_scale
from .runner import EXTEND_GRAPH, DecodeStep, ExtendStep, Runner, VerifyStep
from .step_plan import PoolEffect, Sampled, StepKind, StepPlan
from .torch_state import PinnedTorchState

# The engine's options a worker takes (a tensor-parallel rank gets these, and nothing else).
WORKER_OPTIONS = ("compile", "max_batch_size", "max_model_len", "prefill_chunk_tokens", "idle_prefill_tokens",
                  "page_size", "num_pages",
                  "buckets", "compile_backend", "compile_mode", "compile_cache_dir", "cpp_wrapper", "graph_per_bucket",
                  "specialize_batch_one", "compile_package", "compile_extend", "layer_transfer", "prefix_cache",
                  "prefix_checkpoints", "state_memory_bytes")


# Prompt tokens one step prefills while requests decode: the knee of a long prompt's time to first token
# against the decoders' stall (README, Prefill: the default chunk).
DEFAULT_PREFILL_CHUNK_TOKENS = 256
# ... and while none does: nobody's inter-token latency is at stake, and a 1,024- or 2,048-token prompt in
# one chunk reaches its first token 1.2-1.4x sooner than in 256-token chunks (README, Prefill).
DEFAULT_IDLE_PREFILL_TOKENS = 2048


def prefill_budgets(chunk: int | None, idle: int | None, context_tokens: int) -> tuple[int, int]:
    """(prompt tokens a step prefills while requests decode, and while none does). By default 256 and 2048;
    a chunk set alone is a hard cap on both, as it always was (idle defaults to it); idle is at least the
    chunk. Neither exceeds every slot's whole context (`context_tokens`): the metadata buffers are sized
    for the larger."""
    explicit = chunk is not None
    chunk = option_int("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK_TOKENS if chunk is None else chunk)
    if idle is None:
        idle = chunk if explicit else max(chunk, DEFAULT_IDLE_PREFILL_TOKENS)
    idle = option_int("idle_prefill_tokens", idle)
    if idle < chunk:
        raise OptionError(f"idle_prefill_tokens={idle} is below prefill_chunk_tokens={chunk}: a step with no "
                          "request decoding may prefill more than one beside them, not less")
    return min(chunk, context_tokens), min(idle, context_tokens)


class Worker:
    def __init__(self, model: InklingForCausalLM, *, device: torch.device, compile: bool = True,
                 max_batch_size: int = 32, max_model_len: int = 2048, prefill_chunk_tokens: int | None = None,
                 idle_prefill_tokens: int | None = None, page_size: int = 16, num_pages: int | None = None, buckets: tuple[int, ...] | None = None,
                 compile_backend: str = "inductor", compile_mode: str | None = None,
                 compile_cache_dir: str | Path | None = None, cpp_wrapper: bool | None = None,
                 graph_per_bucket: bool = False, specialize_batch_one: bool = False, compile_package: bool = True,
                 compile_extend: bool = True, layer_transfer: bool = False, prefix_cache: bool = True,
                 prefix_checkpoints: int | None = None,
                 state_memory_bytes: int | None = None, draft_tokens: int = 0, with_hidden: bool = False,
                 tensor_parallel: bool = False):
        config = model.config
        self.model, self.config, self.device = model, config, device
        if device.type == "cpu":
            keep_freed_memory()  # a prefill's buffers stay mapped between prompts (host_memory.py)
        for name, flag in (("compile", compile), ("graph_per_bucket", graph_per_bucket),
                           ("specialize_batch_one", specialize_batch_one), ("layer_transfer", layer_transfer),
                           ("prefix_cache", prefix_cache), ("compile_extend", compile_extend)):
            option_bool(name, flag)
        self.max_batch_size = option_int("max_batch_size", max_batch_size)
        self.max_model_len = option_int("max_model_len", max_model_len, 2)
        page_size = option_int("page_size", page_size)
        self.prefill_chunk_tokens, self.idle_prefill_tokens = prefill_budgets(
            prefill_chunk_tokens, idle_prefill_tokens, self.max_batch_size * self.max_model_len)
        bucket_sizes = choose_buckets(max_batch_size, buckets)  # checked whether or not they are compiled
        self.buckets = Buckets(bucket_sizes if compile else None)
        dtype = model.dtype
        self.unit_costs = UnitCosts.of(config, page_size, dtype, draft_tokens)
        num_pages, checkpoints = self._pool_sizes(page_size, num_pages, prefix_cache, prefix_checkpoints,
                                                  state_memory_bytes)
        self.pool = StatePool(config, max_slots=max_batch_size, num_pages=num_pages, page_size=page_size,
                              max_pages_per_seq=pages_for(max_model_len, page_size), dtype=dtype, device=device,
                              layer_transfer=layer_transfer, checkpoints=checkpoints,
                              spec_draft_tokens=draft_tokens + 1 if draft_tokens else 0)
        # An extend step holds a prompt budget's tokens, and beside them (a mixed step) a token per running row.
        self.backend = StepBackend(self.pool, config, max_batch_size=max_batch_size,
                                   max_tokens=self.idle_prefill_tokens + self.max_batch_size, device=device,
                                   draft_tokens=draft_tokens)
        self.draft_tokens = draft_tokens
        compile_package = option_bool("compile_package", compile_package)
        steps: dict[StepKind, CompiledStep | None] = {kind: None for kind in StepKind}
        # How this engine compiles a step (None: eager), for a drafter that compiles its own steps alike.
        self.step_options: dict | None = None
        if compile:
            options = dict(device=device, buckets=bucket_sizes, compile_backend=compile_backend, mode=compile_mode,
                           cache_dir=compile_cache_dir, cpp_wrapper=False if tensor_parallel else cpp_wrapper,
                           guarded_sources=DecodeStep.GUARDED_SOURCES)
            # The decode step saved whole in the compile cache, for later processes to load instead of
            # tracing (graphs/package.py); not under tensor parallelism or with a HiCache barrier.
            key = self.package_key() if compile_package and not tensor_parallel and not layer_transfer else None
            # (the package key is the decode step's, for a drafter's step to extend; None: nothing is saved)
            self.step_options = {**options, "graph_per_bucket": graph_per_bucket,
                                 "specialize_batch_one": specialize_batch_one, "package_key": key}
            decoder = steps[StepKind.DECODE] = CompiledStep(
                DecodeStep(model, self.backend), self.backend.prepare_padding, graph_per_bucket=graph_per_bucket,
                specialize_batch_one=specialize_batch_one, package_key=key, **options)
            # A loaded package traces nothing, and its guards expect the metadata's slices unmarked; if it
            # is dropped for tracing after all, the slices are marked again.
            buffers = self.backend.buffers
            buffers.symbolic_batch["decode"] = None if decoder.load_package() else decoder.symbolic_batch
            decoder.on_unpackage = lambda: buffers.mark_for_tracing("decode", decoder.symbolic_batch)
            if draft_tokens:  # verify: batch-symbolic like decode (for this K), saved whole beside it
                verifier = steps[StepKind.VERIFY] = CompiledStep(
                    VerifyStep(model, self.backend, with_hidden), self.backend.prepare_verify_padding,
                    graph_per_bucket=graph_per_bucket, specialize_batch_one=specialize_batch_one,
                    package_key=None if key is None else (*key, "verify", draft_tokens, with_hidden), kind="verify",
                    **options)
                buffers.symbolic_batch["verify"] = None if verifier.load_package() else verifier.symbolic_batch
                verifier.on_unpackage = lambda: buffers.mark_for_tracing("verify", verifier.symbolic_batch)
            # Not where a drafter reads every prompt token's hidden state: those prefills run eagerly
            # (`Runner.eager_extend`), so the graph would never run.
            if compile_extend and not tensor_parallel and not with_hidden:
                # Whether the pool keeps checkpoints is in the extend step's key: without them their
                # tensors have no rows, a size the saved graph would keep.
                extend_key = None if key is None else (*key, "extend", self.pool.checkpoints.capacity > 0)
                steps[StepKind.EXTEND] = self._extend_step(options, compile_mode, extend_key)
        self.runner = Runner(model, self.backend, steps, with_hidden)
        # Steps run under the torch state the graphs are compiled for, whatever the caller sets later.
        self.torch_state = PinnedTorchState()
        self.ranks = None  # the other ranks, on rank 0 of a tensor-parallel engine once it leads them
        self.decoder_compiled_beside = False  # whether a second process compiled the decode step (warm_up)

    def _extend_step(self, options: dict, compile_mode: str | None, package_key: tuple | None) -> CompiledStep:
        """The extend step compiled as one graph for every chunk (rows, tokens and checkpoints symbolic,
        nothing padded), saved whole beside the decode step's package. Never recorded as CUDA graphs: each
        chunk's shape would be a graph of its own, and a prefill chunk's kernels outlast their launches."""
        mode = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(compile_mode,
                                                                                                  compile_mode)
        if mode is None and self.device.type == "cuda":
            mode = "default"
        buffers = self.backend.buffers
        extender = CompiledStep(ExtendStep(self.model, self.backend), lambda _: buffers.prepare_extend_padding(),
                                kind="extend", package_key=package_key, **{**options, "buckets": (EXTEND_GRAPH,),
                                                                            "mode": mode})
        # As for decode: a loaded package expects the slices unmarked, a traced step needs them marked.
        buffers.symbolic_extend = not extender.load_package()
        extender.on_unpackage = buffers.mark_extend_for_tracing
        return extender

    def _pool_sizes(self, page_size: int, num_pages, prefix_cache: bool, prefix_checkpoints, state_memory_bytes
                    ) -> tuple[int, int]:
        """(pages including the dummy, prefix checkpoints) the options ask for."""
        # At least one: a cache that can keep no state at any boundary could never be resumed from.
        checkpoints = None if prefix_checkpoints is None else option_int("prefix_checkpoints", prefix_checkpoints, 1)
        checkpoints = checkpoints if prefix_cache else 0
        if state_memory_bytes is not None:  # one budget: slots first, then checkpoints, then pages
            if num_pages is not None:
                raise OptionError("give num_pages or state_memory_bytes, not both: the budget decides the pages")
            num_pages, checkpoints = split_budget(
                self.unit_costs, option_int("state_memory_bytes", state_memory_bytes),
                max_batch_size=self.max_batch_size, checkpoints=checkpoints, min_pages=pages_for(2, page_size))
        if num_pages is None:  # every slot can hold a full-length request
            num_pages = self.max_batch_size * pages_for(self.max_model_len, page_size) + 1
        option_int("num_pages", num_pages, 2)  # one of them is the dummy
        if pages_for(2, page_size) > num_pages - 1:  # not even a one-token prompt and one new token fit
            raise OptionError(f"num_pages={num_pages} holds no request: a 2-token request needs "
                              f"{pages_for(2, page_size)} pages of {page_size} beside the dummy")
        return num_pages, 4 * self.max_batch_size if checkpoints is None else checkpoints

    @property
    def decoder(self) -> CompiledStep | None:
        return self.runner.steps[StepKind.DECODE]

    @property
    def verifier(self) -> CompiledStep | None:
        return self.runner.steps[StepKind.VERIFY]

    @property
    def extender(self) -> CompiledStep | None:
        return self.runner.steps[StepKind.EXTEND]

    def package_key(self) -> tuple:
        """Everything the decode graph holds as a constant: our sources, the model and its weights' layout,
        the dtype, the page size, the ring's length, each state tensor's per-row shape and the torch state
        the steps are pinned to. The pool's sizes are symbols, so they are not in it."""
        pool = self.pool
        return (package.source_hash(sys.modules[__package__], custom_ops, graphs), repr(self.config),
                str(self.model.dtype), pool.page_size, pool.ring_size,
                [tuple(t.shape[1:]) for t in (*pool.state_tensors(), *pool.draft_windows())],
                [(tuple(p.shape), p.stride(), str(p.dtype)) for p in self.model.parameters()],
                [(name, repr(get())) for name, (get, _) in torch_state.SETTINGS.items()])

    # ---- running plans ------------------------------------------------------------------------------

    def lead(self, ranks) -> None:
        """Rank 0 of a tensor-parallel engine: from now on every plan, warm-up and report request goes to
        the other ranks first."""
        self.ranks = ranks

    def _send(self, header: dict, plan: StepPlan | None = None) -> None:
        """To the other ranks, if this worker leads any (the plan encoded only then)."""
        if self.ranks is not None:
            self.ranks.check()
            self.ranks.channel.send(header, None if plan is None else msgspec.msgpack.encode(plan))

    def execute(self, plan: StepPlan, to_host: bool = True) -> tuple[Sampled | None, torch.Tensor | None]:
        """Runs the plan's forward: (what it sampled, on the host, when any row takes a token; the hidden
        states, when the plan asks for them)."""
        self._send({"op": "step"}, plan)
        with self.torch_state.pinned():
            out = self.runner.run(plan)
        takes = plan.kind is not StepKind.EXTEND or any(plan.sampled) or bool(plan.prompt_logprobs)
        return (out.sampled(plan.top_logprobs) if to_host and takes else None), out.hidden

    def apply_journal(self, journal: list[PoolEffect]) -> None:
        """Rank 0's pool writes since its previous plan, made to this rank's pool."""
        for effect in journal:
            if effect.name not in StatePool.EFFECTS:
                raise ValueError(f"unknown pool effect {effect.name!r}")
            getattr(self.pool, effect.name)(*effect.args)

    def warm_up(self, buckets: Sequence[int] | None = None, progress=None, beside=None) -> dict[int, float]:
        """Compiles (or loads) the compiled steps' graphs for `buckets` (default all); seconds per bucket.
        `beside` (`compile_beside.StepBeside`): the decode step compiles in a second process while this
        one compiles the others, and is loaded from the package it saves."""
        decoder, verifier = self.decoder, self.verifier
        if decoder is None:
            return {}
        if buckets is not None:
            buckets = tuple(buckets)
            if any(b not in decoder.buckets for b in buckets):
                raise OptionError(f"buckets {buckets!r} are not all among the engine's buckets {decoder.buckets}")
        self._send({"op": "warm_up", "buckets": buckets})  # every rank compiles the same graphs, collectives and all
        extender = self.extender if buckets is None else None
        verify_progress = progress and (lambda message, done, total: progress(
            message.replace("decode step", f"verify step (K={self.draft_tokens})"), done, total))
        with self.torch_state.pinned():
            # A child only where this process has another step to compile meanwhile.
            others = [s for s in (verifier, extender) if s is not None and not s.loaded and not s.graph_of]
            child = beside.start(decoder) if beside is not None and others else None
            if child is None:
                seconds = decoder.warmup(progress=progress, buckets=buckets)
            elif progress:
                progress("compiling the decode step in a second process")
            try:
                verify = verifier.warmup(progress=verify_progress, buckets=buckets) if verifier is not None else {}
                if extender is not None:
                    extender.warmup(progress=progress)
                saved = child is not None and child.wait()
            finally:
                if child is not None:
                    child.stop()  # a failed compile here leaves no child running
            if child is not None:
                if saved and decoder.load_package():
                    self.backend.buffers.mark_for_tracing("decode", None)  # a loaded package takes them unmarked
                seconds = decoder.warmup(progress=progress, buckets=buckets)
                self.decoder_compiled_beside = decoder.loaded  # still loaded: it took its first inputs
        return {b: s + verify.get(b, 0.0) for b, s in seconds.items()}

    # ---- reports ----------------------------------------------------------------------------------------

    def rank_report(self, rank: int = 0) -> dict:
        """This rank's share: its rank, parameters held (count and bytes, and each one's shape), and the
        census of every graph its compile backend recorded (a `graphs.GraphRecorder` backend)."""
        from .graphs.census import census

        params = dict(self.model.named_parameters())
        recorder = getattr(self.decoder, "compiler", None)
        return {"rank": rank, "parameters": sum(p.numel() for p in params.values()),
                "parameter_bytes": sum(p.numel() * p.element_size() for p in params.values()),
                "shapes": {name: tuple(p.shape) for name, p in params.items()},
                "graphs": [census(gm) for gm in getattr(recorder, "graphs", [])]}

    def reports(self) -> list[dict]:
        """`rank_report()` of every rank, rank 0 first."""
        if self.ranks is None:
            return [self.rank_report()]
        self._send({"op": "report"})
        return StepChannel.gather(self.rank_report(self.ranks.rank))

    def memory_report(self, drafter_bytes: int = 0) -> dict[str, int]:
        """Bytes of each part of what the worker holds, and how many units of each the pool has."""
        pool, buffers = self.pool, self.backend.buffers

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        model_bytes = torch.empty(0, dtype=self.model.dtype).element_size()
        int8 = [p for p in self.model.parameters() if p.dtype == torch.int8]
        return {
            "weights": size(self.model.parameters()),
            # what int8 storage saves against the model's dtype, its scales paid for
            "int8 saved": sum(p.numel() for p in int8) * (model_bytes - 1)
                          - size(p for n, p in self.model.named_parameters() if is_weight_scale(n)),
            "slot conv windows": size(each_layer(pool.conv.values())),
            "slot sliding rings": size(each_layer(pool.sliding_kv)),
            "KV pages": size(each_layer(pool.global_kv)),
            "prefix checkpoints": size([*pool.conv_checkpoints.values(), *pool.ring_checkpoints]),
            "draft windows": size(pool.draft_windows()),
            "drafter state": drafter_bytes,
            "step metadata": sum(r.bytes.numel() for r in (buffers.decode_region, buffers.prefill_region,
                                                            buffers.verify_region) if r is not None),
            "slots": pool.max_slots, "pages": pool.num_pages - 1, "page_size": pool.page_size,
            "checkpoints": pool.checkpoints.capacity,
        }


def memory_summary(r: dict[str, int]) -> str:
    """A `memory_report()` as one line (what start-up prints)."""
    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    saved = f" (int8: {mib(r['int8 saved'])} saved)" if r.get("int8 saved") else ""
    return (f"memory: weights {mib(r['weights'])}{saved}; {r['slots']} slots "
            f"{mib(r['slot conv windows'] + r['slot sliding rings'])}; {r['pages']} KV pages of "
            f"{r['page_size']} tokens {mib(r['KV pages'])}; {r['checkpoints']} prefix checkpoints "
            f"{mib(r['prefix checkpoints'])}; step metadata {r['step metadata'] / 1024:.0f} KiB"
            + (f"; speculative state {mib(r['draft windows'] + r['drafter state'])}"
               if r["draft windows"] + r["drafter state"] else ""))
