"""Runs one prepared step of the model: forward, lm_head on each row's last token, sampling."""

from __future__ import annotations

import itertools

import msgspec
import torch
from torch import nn

from .backend import StepBackend
from .cache.pool import each_layer
from .graphs.capture import INSTANCE_SOURCE
from .metadata import StepMetadata
from .model import InklingForCausalLM
from .nvtx import nvtx_range
from .sampling import MAX_TOP_LOGPROBS, sample, verify_drafts


class StepOutput(msgspec.Struct):
    tokens: torch.Tensor  # [B] int64
    chosen_logprobs: torch.Tensor  # [B] fp32
    top_ids: torch.Tensor  # [B, n] int64, most likely first
    top_logprobs: torch.Tensor  # [B, n] fp32
    hidden: torch.Tensor | None = None  # [T, H] every token's final-normed hidden state, when asked for

    def to_host(self, top_n: int, one_copy: bool | None = None
                ) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """(tokens, chosen logprobs, top ids, top logprobs) as Python lists, the tops cut to `top_n`. Off
        the CPU (`one_copy`, by default) in one device-to-host copy: everything packed as float64, which
        holds every token id (< 2**53) and every fp32 logprob exactly."""
        parts = [self.tokens[:, None], self.chosen_logprobs[:, None], self.top_ids[:, :top_n],
                 self.top_logprobs[:, :top_n]]
        if self.tokens.device.type != "cpu" if one_copy is None else one_copy:
            host = torch.cat([p.double() for p in parts], dim=1).cpu()
            parts = [host[:, :1].long(), host[:, 1:2].float(), host[:, 2:2 + top_n].long(), host[:, 2 + top_n:].float()]
        tokens, chosen, top_ids, top_vals = (p.tolist() for p in parts)
        return [t for (t,) in tokens], [c for (c,) in chosen], top_ids, top_vals


class VerifyOutput(msgspec.Struct):
    """A verify step's result: row i emits tokens[i, :accepted[i] + 1]."""

    tokens: torch.Tensor  # [B, K+1] int64
    accepted: torch.Tensor  # [B] int64, drafts accepted
    chosen_logprobs: torch.Tensor  # [B, K+1] fp32
    top_ids: torch.Tensor  # [B, K+1, n]
    top_logprobs: torch.Tensor  # [B, K+1, n]
    hidden: torch.Tensor | None = None  # [B, K+1, H] final-normed hidden states, for drafters that read them

    def to_host(self, top_n: int) -> tuple[list[int], StepOutput]:
        """(accepted per row, the per-position outputs as a StepOutput over B*(K+1) rows on the host)."""
        B, T_d = self.tokens.shape
        flat = StepOutput(torch.cat([self.tokens, self.accepted[:, None]], 1).reshape(-1),
                          torch.cat([self.chosen_logprobs, self.chosen_logprobs[:, :1]], 1).reshape(-1),
                          torch.cat([self.top_ids, self.top_ids[:, :1]], 1).reshape(B * (T_d + 1), -1),
                          torch.cat([self.top_logprobs, self.top_logprobs[:, :1]], 1).reshape(B * (T_d + 1), -1))
        tokens, chosen, top_ids, top_vals = flat.to_host(top_n)  # one copy: accepted rides as a column
        per_row = T_d + 1
        accepted = tokens[T_d::per_row]
        keep = [i for i in range(len(tokens)) if i % per_row != T_d]
        return accepted, StepOutput(*([seq[i] for i in keep] for seq in (tokens, chosen, top_ids, top_vals)))


def _top(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    top = logprobs.topk(min(MAX_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return logprobs.gather(-1, tokens[:, None])[:, 0], top.indices, top.values


def forward_step(model: InklingForCausalLM, backend: StepBackend, with_hidden: bool = False) -> tuple[torch.Tensor, ...]:
    """The whole step as one function of the static buffers (what the compiled path captures)."""
    md: StepMetadata = backend.metadata
    every = hidden = model.hidden_states(md.input_ids, backend.context)
    if not md.is_decode:
        hidden = hidden[md.last_token_index]
    logits = model.logits(hidden)
    tokens, logprobs = sample(logits, md.temperature, md.top_k, md.top_p, md.seed, md.sample_counter)
    return (tokens, *_top(tokens, logprobs), *((every,) if with_hidden else ()))


def verify_step(model: InklingForCausalLM, backend: StepBackend, with_hidden: bool = False) -> tuple[torch.Tensor, ...]:
    """A speculative verify step: the target over every row's K+1 tokens, then acceptance (`verify_drafts`).
    The conv ops save each token's window and leave the slots alone; the commit comes after."""
    md: StepMetadata = backend.metadata
    T_d = md.draft_tokens + 1
    hidden = model.hidden_states(md.input_ids, backend.context)
    logits = model.logits(hidden)
    B = logits.shape[0] // T_d
    tokens, accepted, logprobs = verify_drafts(logits.view(B, T_d, -1), md.input_ids.view(B, T_d), md.drafted,
                                               md.temperature, md.top_k, md.top_p, md.seed, md.sample_counter)
    chosen, top_ids, top_vals = _top(tokens.reshape(-1), logprobs)
    out = (tokens, accepted, chosen.view(B, T_d), top_ids.view(B, T_d, -1), top_vals.view(B, T_d, -1))
    return (*out, hidden.view(B, T_d, -1)) if with_hidden else out


_STEPS = itertools.count()


class DecodeStep(nn.Module):
    """The step as a module for the compiler: parameters, pools and metadata are all reached through
    `self`, which makes them static inputs (fixed addresses) for Dynamo and for CUDA graphs."""

    # What Dynamo's guards must watch (every other guard is dropped, see graphs.capture.guard_filter):
    # the metadata, the one thing the step reads that changes between steps (its sizes per bucket),
    # and which step this is. Parameters, pool and module structure are fixed for a step's life, but two
    # steps (two engines in one process) may share Dynamo's cache: the instance number keeps them apart.
    GUARDED_SOURCES = ("self.backend.metadata", INSTANCE_SOURCE)

    def __init__(self, model: InklingForCausalLM, backend: StepBackend):
        super().__init__()
        self.model = model
        self.backend = backend
        self.instance = next(_STEPS)  # counts from 0 in every process, so caches on disk still match

    def forward(self) -> tuple[torch.Tensor, ...]:
        if self.instance < 0:  # never true: the comparison makes Dynamo guard on the instance number
            raise AssertionError(self.instance)
        return forward_step(self.model, self.backend)


class VerifyStep(nn.Module):
    """The verify step as a module for the compiler, like `DecodeStep`; one static graph per bucket."""

    GUARDED_SOURCES = DecodeStep.GUARDED_SOURCES

    def __init__(self, model: InklingForCausalLM, backend: StepBackend, with_hidden: bool = False):
        super().__init__()
        self.model, self.backend, self.with_hidden = model, backend, with_hidden
        self.instance = next(_STEPS)

    def forward(self) -> tuple[torch.Tensor, ...]:
        if self.instance < 0:  # never true: the comparison makes Dynamo guard on the instance number
            raise AssertionError(self.instance)
        return verify_step(self.model, self.backend, self.with_hidden)


class EagerRunner:
    """The reference path: every step runs eagerly, unpadded.

    Every forward goes through `_launch(kind, bucket)` once its buffers are prepared: under tensor
    parallelism the scheduling rank's `mirror` sends the step to the other ranks there, and they run the
    same `replay(kind, bucket)` on their shards."""

    mirror = None  # a parallel.StepMirror on the scheduling rank of a tensor-parallel engine

    def __init__(self, model: InklingForCausalLM, backend: StepBackend):
        self.model, self.backend = model, backend

    def _forward(self, kind: str, bucket: int | None) -> tuple[torch.Tensor, ...]:
        if kind == "prefill":
            return forward_step(self.model, self.backend, self.with_hidden)
        if kind == "decode":
            return forward_step(self.model, self.backend)
        if kind == "verify":
            return verify_step(self.model, self.backend, self.with_hidden)
        raise ValueError(f"unknown forward {kind!r}")

    def _launch(self, kind: str, bucket: int | None = None, slots: list[int] | None = None) -> tuple[torch.Tensor, ...]:
        if self.mirror is None:
            return self._forward(kind, bucket)
        self.mirror.publish(kind, bucket, slots)
        out = self._forward(kind, bucket)
        self.mirror.in_step = False
        return out

    @torch.inference_mode()
    def replay(self, kind: str, bucket: int | None, slots: list[int] | None) -> None:
        """What another rank runs for a forward the scheduling rank launched (its buffers already loaded);
        a verify step commits the windows its own acceptance picks, which is every rank's."""
        out = self._forward(kind, bucket)
        if kind == "verify":
            self.commit(slots, out[1])

    @torch.inference_mode()
    def prefill(self, reqs, lengths: list[int]) -> StepOutput:
        """The next `lengths[i]` prompt tokens of each request, continuing what is prefilled already; a
        row's sampled token means something only where its chunk ends the prompt."""
        with nvtx_range("prepare prefill"):
            self.backend.prepare_extend([r.prompt[r.prefilled:r.prefilled + n] for r, n in zip(reqs, lengths)],
                                        [r.prefilled for r in reqs],
                                        [self.backend.pool.slot_of[r.request_id] for r in reqs],
                                        [r.sampling_row() for r in reqs])
        with nvtx_range(f"prefill {len(reqs)} rows, {sum(lengths)} tokens"):
            return StepOutput(*self._launch("prefill"))

    def _prepare_decode(self, reqs, pad_to: int | None = None) -> None:
        slot_of = self.backend.pool.slot_of
        with nvtx_range("prepare decode"):
            self.backend.prepare_decode([r.output[-1] for r in reqs], [slot_of[r.request_id] for r in reqs],
                                        [r.cached_len for r in reqs], [r.sampling_row() for r in reqs], pad_to=pad_to)

    @torch.inference_mode()
    def decode(self, reqs) -> StepOutput:
        self._prepare_decode(reqs)
        with nvtx_range(f"decode {len(reqs)} rows (eager)"):
            return StepOutput(*self._launch("decode"))

    # ---- speculative decoding ------------------------------------------------------------------------

    with_hidden = False  # whether verify steps hand back hidden states (a drafter that reads them)

    def _prepare_verify(self, reqs, drafts: list[list[int]], pad_to: int | None = None) -> list[int]:
        slots = [self.backend.pool.slot_of[r.request_id] for r in reqs]
        with nvtx_range("prepare verify"):
            self.backend.prepare_verify([[r.output[-1], *d] for r, d in zip(reqs, drafts)], slots,
                                        [r.cached_len for r in reqs], [r.budget for r in reqs],
                                        [r.drafted for r in reqs], [r.sampling_row() for r in reqs], pad_to=pad_to)
        return slots

    def commit(self, slots: list[int], steps: torch.Tensor) -> None:
        """Each verify row's slot takes the conv windows saved after its last accepted token (`steps`,
        the accepted counts). Slot ids come from the caller's verify batch, never from the step buffers,
        which the next prep may already have refilled."""
        pool = self.backend.pool
        with nvtx_range("commit conv windows"):
            # The op takes stacked [L, ...] tensors per stream; the pool's are per layer, one L=1 view each.
            torch.ops.inkling.commit_conv_windows(
                [t[None] for t in each_layer(pool.conv.values())], [w[None] for w in pool.draft_windows()],
                torch.tensor(slots, dtype=torch.int32).to(steps.device, non_blocking=True), steps[:len(slots)])

    def _verify_chunk(self, reqs, drafts) -> VerifyOutput:
        bucket = self._verify_bucket(len(reqs))
        slots = self._prepare_verify(reqs, drafts, pad_to=bucket)
        out = VerifyOutput(*(t[:len(reqs)] for t in self._launch("verify", bucket, slots)))
        self.commit(slots, out.accepted)  # before the next chunk's verify overwrites the saved windows
        return out

    def _verify_bucket(self, rows: int) -> int | None:
        return None

    @torch.inference_mode()
    def verify(self, reqs, drafts: list[list[int]]) -> VerifyOutput:
        """Checks `drafts[i]` (K tokens) after each request's newest token, commits what is accepted."""
        with nvtx_range(f"verify {len(reqs)} rows (eager)"):
            return self._verify_chunk(reqs, drafts)


class CompiledRunner(EagerRunner):
    """Decode through the compiled graph(s), one bucket per replay; prefill stays eager (its shapes vary)."""

    def __init__(self, model: InklingForCausalLM, backend: StepBackend, decoder, verifier=None):
        super().__init__(model, backend)
        self.decoder, self.verifier = decoder, verifier
        if verifier is not None:
            self.with_hidden = verifier.step.with_hidden

    def _forward(self, kind: str, bucket: int | None) -> tuple[torch.Tensor, ...]:
        if kind == "decode":
            return self.decoder.run(bucket)
        if kind == "verify":
            return self.verifier.run(bucket)
        return super()._forward(kind, bucket)

    def _wait_for_transfers(self) -> None:
        """Graphs without a per-layer barrier: every layer's transfer completes before a replay starts."""
        pool = self.backend.pool
        if pool.layer_transfer_counter is not None and not pool.layer_transfer:
            with nvtx_range("wait for every layer's transfer"):
                pool.wait_for_all_layers()

    def decode(self, reqs) -> StepOutput:
        self._wait_for_transfers()
        parts = []
        for start in range(0, len(reqs), self.decoder.largest):  # a batch over the largest bucket is split
            chunk = reqs[start:start + self.decoder.largest]
            bucket = self.decoder.bucket_for(len(chunk))
            self._prepare_decode(chunk, pad_to=bucket)
            with nvtx_range(f"replay bucket {bucket} ({len(chunk)} rows)"):
                parts.append([t[: len(chunk)] for t in self._launch("decode", bucket)])
        return StepOutput(*(torch.cat(ts) for ts in zip(*parts)))

    def _verify_bucket(self, rows: int) -> int:
        return self.verifier.bucket_for(rows)

    def verify(self, reqs, drafts: list[list[int]]) -> VerifyOutput:
        self._wait_for_transfers()
        parts = []
        for start in range(0, len(reqs), self.verifier.largest):  # a batch over the largest bucket is split
            chunk = reqs[start:start + self.verifier.largest]
            with nvtx_range(f"verify replay ({len(chunk)} rows)"):
                parts.append(self._verify_chunk(chunk, drafts[start:start + len(chunk)]))
        if len(parts) == 1:
            return parts[0]
        fields = [f for f in VerifyOutput.__struct_fields__ if getattr(parts[0], f) is not None]
        return VerifyOutput(**{f: torch.cat([getattr(p, f) for p in parts]) for f in fields})
