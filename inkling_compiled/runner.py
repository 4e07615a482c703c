"""Runs one planned forward of the model: the step buffers prepared from a `StepPlan`, the step its kind
names (compiled, or eager), lm_head on each row's last token, sampling; a verify step commits its
accepted conv windows itself."""

from __future__ import annotations

import itertools

import msgspec
import torch
from torch import nn

from .backend import StepBackend
from .graphs.capture import INSTANCE_SOURCE
from .metadata import StepMetadata, check_verify_shapes
from .model import InklingForCausalLM
from .nvtx import DECODE_REPLAY, VERIFY_REPLAY, nvtx_range
from .sampling import sample_with_logprobs, verify_with_logprobs
from .step_plan import PromptScores, Sampled, StepKind, StepPlan

# Prompt positions scored per lm_head call: bounds the [positions, vocab] logits a long chunk would make.
PROMPT_SCORE_POSITIONS = 256


class StepOutput(msgspec.Struct):
    tokens: torch.Tensor  # [B] int64
    chosen_logprobs: torch.Tensor  # [B] fp32
    top_ids: torch.Tensor  # [B, n] int64, most likely first
    top_logprobs: torch.Tensor  # [B, n] fp32
    hidden: torch.Tensor | None = None  # [T, H] every token's final-normed hidden state, when asked for
    prompt: PromptScores | None = None  # extend: the prompt tokens' logprobs, when the plan asked for them

    def to_host(self, top_n: int, one_copy: bool | None = None
                ) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """(tokens, chosen logprobs, top ids, top logprobs) as Python lists, the tops cut to `top_n`. Off
        the CPU (`one_copy`, by default) in one device-to-host copy: everything packed as float64, which
        holds every token id (< 2**53) and every fp32 logprob exactly."""
        if not (self.tokens.device.type != "cpu" if one_copy is None else one_copy):
            # read in place; the tops only when asked for (a decode step's host work runs cold: each op counts)
            rows = len(self.tokens)
            top_ids = self.top_ids[:, :top_n].tolist() if top_n else [[] for _ in range(rows)]
            top_vals = self.top_logprobs[:, :top_n].tolist() if top_n else [[] for _ in range(rows)]
            return self.tokens.tolist(), self.chosen_logprobs.tolist(), top_ids, top_vals
        parts = [self.tokens[:, None], self.chosen_logprobs[:, None], self.top_ids[:, :top_n],
                 self.top_logprobs[:, :top_n]]
        host = torch.cat([p.double() for p in parts], dim=1).cpu()
        parts = [host[:, :1].long(), host[:, 1:2].float(), host[:, 2:2 + top_n].long(), host[:, 2 + top_n:].float()]
        tokens, chosen, top_ids, top_vals = (p.tolist() for p in parts)
        return [t for (t,) in tokens], [c for (c,) in chosen], top_ids, top_vals

    def sampled(self, top_n: int) -> Sampled:
        """The host form the scheduler reads: one token per row."""
        tokens, chosen, top_ids, top_vals = self.to_host(top_n)
        return Sampled(tokens=[[t] for t in tokens], logprobs=[[c] for c in chosen], top_ids=[[t] for t in top_ids],
                       top_logprobs=[[v] for v in top_vals], prompt=self.prompt)


class VerifyOutput(msgspec.Struct):
    """A verify step's result: row i emits tokens[i, :accepted[i] + 1]."""

    tokens: torch.Tensor  # [B, K+1] int64
    accepted: torch.Tensor  # [B] int64, drafts accepted
    chosen_logprobs: torch.Tensor  # [B, K+1] fp32
    top_ids: torch.Tensor  # [B, K+1, n]
    top_logprobs: torch.Tensor  # [B, K+1, n]
    hidden: torch.Tensor | None = None  # [B, K+1, H] final-normed hidden states, for drafters that read them

    def to_host(self, top_n: int, one_copy: bool | None = None) -> tuple[list[int], StepOutput]:
        """(accepted per row, the per-position outputs as a StepOutput over B*(K+1) rows on the host), in one
        copy off the CPU (`StepOutput.to_host`)."""
        B, T_d = self.tokens.shape
        flat = StepOutput(torch.cat([self.tokens, self.accepted[:, None]], 1).reshape(-1),
                          torch.cat([self.chosen_logprobs, self.chosen_logprobs[:, :1]], 1).reshape(-1),
                          torch.cat([self.top_ids, self.top_ids[:, :1]], 1).reshape(B * (T_d + 1), -1),
                          torch.cat([self.top_logprobs, self.top_logprobs[:, :1]], 1).reshape(B * (T_d + 1), -1))
        tokens, chosen, top_ids, top_vals = flat.to_host(top_n, one_copy)  # one copy: accepted rides as a column
        per_row = T_d + 1
        accepted = tokens[T_d::per_row]
        keep = [i for i in range(len(tokens)) if i % per_row != T_d]
        return accepted, StepOutput(*([seq[i] for i in keep] for seq in (tokens, chosen, top_ids, top_vals)))

    def sampled(self, top_n: int) -> Sampled:
        """The host form the scheduler reads: each row's K+1 candidates and how many drafts it accepted.
        On the CPU each field is read in place, already in rows (no packing: each op of a step's host work
        counts); off it, in one copy (`to_host`)."""
        B, T_d = self.tokens.shape
        if self.tokens.device.type == "cpu":
            def tops(t: torch.Tensor) -> list:
                return t[:, :, :top_n].tolist() if top_n else [[[] for _ in range(T_d)] for _ in range(B)]

            return Sampled(tokens=self.tokens.tolist(), logprobs=self.chosen_logprobs.tolist(),
                           top_ids=tops(self.top_ids), top_logprobs=tops(self.top_logprobs),
                           accepted=self.accepted.tolist())
        accepted, flat = self.to_host(top_n)

        def rows(seq: list) -> list[list]:
            return [seq[i:i + T_d] for i in range(0, len(seq), T_d)]

        return Sampled(tokens=rows(flat.tokens), logprobs=rows(flat.chosen_logprobs), top_ids=rows(flat.top_ids),
                       top_logprobs=rows(flat.top_logprobs), accepted=accepted)


def _rows(out: tuple[torch.Tensor, ...], rows: int) -> list[torch.Tensor]:
    """A decode or verify step's outputs cut to the plan's rows: sliced only past them (a bucket's padding),
    since each op of a step's host work runs cold, after the replay has swept the caches."""
    return [t if t.shape[0] == rows else t[:rows] for t in out]


def forward_step(model: InklingForCausalLM, backend: StepBackend, with_hidden: bool = False) -> tuple[torch.Tensor, ...]:
    """The whole step as one function of the static buffers (what the compiled path captures)."""
    md: StepMetadata = backend.metadata
    every = hidden = model.hidden_states(md.input_ids, backend.context)
    if not md.is_decode:
        hidden = hidden[md.last_token_index]
    logits = model.logits(hidden)
    drawn = sample_with_logprobs(logits, md.temperature, md.top_k, md.top_p, md.seed, md.sample_counter)
    return (*drawn, *((every,) if with_hidden else ()))


def verify_step(model: InklingForCausalLM, backend: StepBackend, with_hidden: bool = False) -> tuple[torch.Tensor, ...]:
    """A speculative verify step: the target over every row's K+1 tokens, then acceptance (`verify_drafts`),
    then the commit. The conv ops save each token's window and leave the slots alone; each row's slot then
    takes the window saved after its last accepted token, inside the step (`PoolContext.commit_conv_windows`)."""
    md: StepMetadata = backend.metadata
    T_d = md.draft_tokens + 1
    B = check_verify_shapes(md)
    hidden = model.hidden_states(md.input_ids, backend.context)
    logits = model.logits(hidden)
    out = verify_with_logprobs(logits.view(B, T_d, -1), md.input_ids.view(B, T_d), md.drafted, md.temperature,
                               md.top_k, md.top_p, md.seed, md.sample_counter)
    backend.context.commit_conv_windows(out[1])  # each row's windows after its accepted drafts
    return (*out, hidden.view(B, T_d, -1)) if with_hidden else out


def score_prompt(model: InklingForCausalLM, hidden: torch.Tensor, plan: StepPlan) -> PromptScores:
    """The logprob of each prompt token an extend plan's chunks predict, for the rows that ask: chunk
    position j scores the prompt token after it (the chunk's token j+1, or for its last position the next
    chunk's first token). Computed like a sampled token's logprob (lm_head, then log-softmax in fp32); a
    token past the logits' vocabulary scores -inf. Every rank of a tensor-parallel engine runs the same
    lm_head calls (they gather across ranks)."""
    offsets = list(itertools.accumulate([0] + [len(t) for t in plan.tokens]))
    positions, targets, counts = [], [], []
    for row, (chunk, top_n, after) in enumerate(zip(plan.tokens, plan.prompt_logprobs, plan.next_tokens)):
        scored = chunk[1:] + [after] if after >= 0 else chunk[1:]
        counts.append(len(scored) if top_n >= 0 else 0)
        if top_n >= 0:
            positions.extend(range(offsets[row], offsets[row] + len(scored)))
            targets.extend(scored)
    top_n = max(plan.prompt_logprobs)
    chosen, top_ids, top_vals = [], [], []
    for i in range(0, len(positions), PROMPT_SCORE_POSITIONS):
        index = torch.tensor(positions[i:i + PROMPT_SCORE_POSITIONS], device=hidden.device)
        target = torch.tensor(targets[i:i + PROMPT_SCORE_POSITIONS], device=hidden.device)
        logprobs = torch.log_softmax(model.logits(hidden[index]).float(), dim=-1)
        vocab = logprobs.shape[-1]
        picked = logprobs.gather(1, target.clamp(max=vocab - 1)[:, None])[:, 0]
        chosen.append(torch.where(target < vocab, picked, float("-inf")))
        top = logprobs.topk(min(top_n, vocab), dim=-1)
        top_ids.append(top.indices), top_vals.append(top.values)
    if positions:
        chosen, top_ids, top_vals = (torch.cat(p).cpu().tolist() for p in (chosen, top_ids, top_vals))
    rows = list(itertools.accumulate([0] + counts))
    return PromptScores(logprobs=[chosen[a:b] for a, b in zip(rows, rows[1:])],
                        top_ids=[top_ids[a:b] for a, b in zip(rows, rows[1:])],
                        top_logprobs=[top_vals[a:b] for a, b in zip(rows, rows[1:])])


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


class ExtendStep(nn.Module):
    """The extend step (prefill chunks) as a module for the compiler, like `DecodeStep`: its rows and tokens
    are symbols of the metadata's slices, so one graph serves every chunk (`EXTEND_GRAPH`)."""

    GUARDED_SOURCES = DecodeStep.GUARDED_SOURCES

    def __init__(self, model: InklingForCausalLM, backend: StepBackend):
        super().__init__()
        self.model, self.backend = model, backend
        self.instance = next(_STEPS)

    def forward(self) -> tuple[torch.Tensor, ...]:
        if self.instance < 0:  # never true: the comparison makes Dynamo guard on the instance number
            raise AssertionError(self.instance)
        return forward_step(self.model, self.backend)


# The compiled extend step's one "bucket": its graph serves every chunk, at its own size (nothing padded).
EXTEND_GRAPH = 1


class VerifyStep(nn.Module):
    """The verify step as a module for the compiler, like `DecodeStep`; one graph serves every bucket."""

    GUARDED_SOURCES = DecodeStep.GUARDED_SOURCES

    def __init__(self, model: InklingForCausalLM, backend: StepBackend, with_hidden: bool = False):
        super().__init__()
        self.model, self.backend, self.with_hidden = model, backend, with_hidden
        self.instance = next(_STEPS)

    def forward(self) -> tuple[torch.Tensor, ...]:
        if self.instance < 0:  # never true: the comparison makes Dynamo guard on the instance number
            raise AssertionError(self.instance)
        return verify_step(self.model, self.backend, self.with_hidden)


class Runner:
    """One runner for every step kind: `steps` maps a kind to its compiled step, or to None (eager).
    Decode and verify replay their compiled step at the plan's bucket; rows past the plan's are padding,
    which write only the dummies. An extend step runs its compiled step at the plan's own size (its
    prefix-cache checkpoints included), unless it scores prompt tokens or hands hidden states to a
    drafter: those run eagerly (`eager_extend`)."""

    def __init__(self, model: InklingForCausalLM, backend: StepBackend, steps: dict[StepKind, object | None],
                 with_hidden: bool = False):
        self.model, self.backend, self.steps = model, backend, steps
        self.with_hidden = with_hidden  # whether extend and verify steps hand back hidden states (for a drafter)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput | VerifyOutput:
        """The plan's forward; outputs cut to its rows."""
        self.prepare(plan)
        scoring = plan.kind is StepKind.EXTEND and bool(plan.prompt_logprobs)
        compiled = None if plan.kind is StepKind.EXTEND and self.eager_extend(plan) else self.steps.get(plan.kind)
        if compiled is not None:
            self._wait_for_transfers()
        with nvtx_range(self._range_name(plan, compiled is not None)):
            if compiled is None:
                out = self._eager(plan.kind, scoring)
            else:
                out = self._run_compiled(compiled, plan)
        if plan.kind is StepKind.EXTEND:
            if not scoring:
                return StepOutput(*out)
            with nvtx_range("score prompt tokens"):
                tokens, chosen, top_ids, top_vals, every = out
                return StepOutput(tokens, chosen, top_ids, top_vals, every if self.with_hidden else None,
                                  prompt=score_prompt(self.model, every, plan))
        if plan.kind is StepKind.DECODE:
            return StepOutput(*_rows(out, plan.rows))
        return VerifyOutput(*_rows(out, plan.rows))

    def _run_compiled(self, compiled, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """The compiled step of the plan's kind. A decode or verify bucket reads the same metadata slices at
        every step, and an extend step of a shape seen lately the same as its last of that shape (kept by
        the step buffers), so those slices stand for its inputs. An extend shape is bound (a recorded
        call) from its second step on: prompts of many lengths would pay the recording for shapes that
        never come again."""
        buffers = self.backend.buffers
        if plan.kind is StepKind.EXTEND:
            return compiled.run(EXTEND_GRAPH, inputs=buffers.published if buffers.extend_shape_seen else None)
        return compiled.run(plan.bucket, inputs=buffers.published)

    def eager_extend(self, plan: StepPlan) -> bool:
        """Whether an extend plan runs eagerly: the compiled step does not hand back every token's hidden
        state (what prompt scoring and a drafter read)."""
        return bool(plan.prompt_logprobs or self.with_hidden)

    @staticmethod
    def _range_name(plan: StepPlan, compiled: bool) -> str:
        """The NVTX range of the forward (`profile.py` finds decode and verify replays by theirs)."""
        if plan.kind is StepKind.EXTEND:
            tokens = sum(len(t) for t in plan.tokens)
            return f"prefill {plan.rows} rows, {tokens} tokens" + ("" if compiled else " (eager)")
        if not compiled:
            return f"{plan.kind.value} {plan.rows} rows (eager)"
        prefix = DECODE_REPLAY if plan.kind is StepKind.DECODE else VERIFY_REPLAY
        return f"{prefix} {plan.bucket} ({plan.rows} rows)"

    def prepare(self, plan: StepPlan) -> None:
        """The step buffers filled from the plan (and the metadata pointed at them)."""
        buffers = self.backend.buffers
        with nvtx_range(f"prepare {plan.kind.value}"):
            if plan.kind is StepKind.DECODE:
                buffers.prepare_decode([t[0] for t in plan.tokens], plan.slots, plan.starts, plan.sampling,
                                       pad_to=plan.bucket)
            elif plan.kind is StepKind.VERIFY:
                buffers.prepare_verify(plan.tokens, plan.slots, plan.starts, plan.limits, plan.drafted, plan.sampling,
                                       pad_to=plan.bucket)
            else:
                buffers.prepare_extend(plan.tokens, plan.starts, plan.slots, plan.sampling, plan.checkpoints)

    def _eager(self, kind: StepKind, every_hidden: bool = False) -> tuple[torch.Tensor, ...]:
        """The step run eagerly; an extend step hands back every token's hidden state when a drafter reads
        them or `every_hidden` (prompt tokens to score) asks."""
        if kind is StepKind.VERIFY:
            return verify_step(self.model, self.backend, self.with_hidden)
        return forward_step(self.model, self.backend, kind is StepKind.EXTEND and (self.with_hidden or every_hidden))

    def _wait_for_transfers(self) -> None:
        """Graphs without a per-layer barrier: every layer's transfer completes before a replay starts."""
        pool = self.backend.pool
        if pool.layer_transfer_counter is not None and not pool.layer_transfer:
            with nvtx_range("wait for every layer's transfer"):
                pool.wait_for_all_layers()
