"""What one forward does, as the scheduler decides it: a `StepPlan`, and the kinds of step there are.

The scheduler returns one plan per forward; the worker executes it (prepares the step buffers from it
and runs the step its kind names); under tensor parallelism rank 0 sends the same plan to every other
rank, which executes it on its shard. So a plan holds only plain values (no tensors, no requests): it
round-trips through msgspec's msgpack, and it is all a rank needs beside its own pool.
"""

from __future__ import annotations

import enum

import msgspec

from .metadata import RowSampling


class StepKind(enum.Enum):
    DECODE = "decode"  # one new token per row
    VERIFY = "verify"  # each row's newest token and K drafts, checked by the target (speculative decoding)
    EXTEND = "extend"  # chunks of prompts, packed, each continuing its slot's state (chunked prefill); may lead
    # with running requests' newest tokens, one each (a mixed step: their decode rides in the prefill's forward)


class Checkpoint(msgspec.Struct, array_like=True, frozen=True):
    """A prefix-cache checkpoint an extend step takes on its way: the state of `row` at `boundary`."""

    row: int
    packed_start: int  # where the row's chunk starts among the step's packed tokens
    first: int  # the position of the chunk's first token
    boundary: int  # the position the state is taken before (a page boundary)
    index: int  # the pool checkpoint it is written to


class PoolEffect(msgspec.Struct, array_like=True, frozen=True):
    """A write to the pool made outside a forward (admission, release, a prefix hit's restore), for the
    other ranks of a tensor-parallel engine to replay on their shards (`StatePool.EFFECTS` names them)."""

    name: str
    args: list


class StepPlan(msgspec.Struct, kw_only=True):
    """One forward. Row i is request `request_ids[i]` in slot `slots[i]`, feeding `tokens[i]` from
    position `starts[i]`: its newest token (decode), its newest token and K drafts (verify) or the next
    chunk of its prompt (extend)."""

    kind: StepKind
    request_ids: list[str]
    slots: list[int]
    tokens: list[list[int]]
    starts: list[int]
    sampling: list[RowSampling]
    bucket: int | None = None  # the compiled step's bucket (rows padded up to it); None: eager, unpadded
    sampled: list[bool] = []  # extend: the rows whose chunk ends the prompt, or decode (only they take a token)
    decoding: int = 0  # extend: its leading rows are running requests decoding one token each (a mixed step)
    limits: list[int] = []  # verify: each row's token budget (a draft at or past it is never emitted)
    drafted: list[int] = []  # verify: how many of a row's K drafts are real (the rest stand in)
    checkpoints: list[Checkpoint] = []  # extend: prefix-cache checkpoints taken on the way
    journal: list[PoolEffect] = []  # the pool's writes since the previous plan
    top_logprobs: int = 0  # top logprobs the host needs per sampled token (the most any row asked for)
    # extend, when any row asks for prompt logprobs: per row, the top logprobs each of its prompt tokens needs
    # (-1: the row asks for none), and the prompt token after its chunk (-1: the chunk ends the prompt)
    prompt_logprobs: list[int] = []
    next_tokens: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.slots)


class PromptScores(msgspec.Struct, kw_only=True):
    """Per row of an extend plan, the logprob of each prompt token its chunk predicts (the chunk's tokens
    after its first, then the next chunk's first) with the most likely tokens there; empty for rows that
    asked for none."""

    logprobs: list[list[float]]
    top_ids: list[list[list[int]]]
    top_logprobs: list[list[list[float]]]


class Sampled(msgspec.Struct, kw_only=True):
    """What a forward sampled, on the host, per row: the tokens it may emit (one; K+1 for verify) with
    their logprobs and top logprobs, and for verify how many drafts the target accepted."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_ids: list[list[list[int]]]
    top_logprobs: list[list[list[float]]]
    accepted: list[int] = []
    prompt: PromptScores | None = None  # extend: the prompt tokens' logprobs, when the plan asked for them
