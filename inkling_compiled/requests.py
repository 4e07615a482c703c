"""Requests as the engine keeps them, what it hands back, and the checks a prompt passes on the way in.

A prompt is exactly one of: a str (needs the checkpoint's tokenizer), or a sequence, 1-D numpy array
or 1-D tensor of integer token ids. Anything else (floats, bools, digit strings, bytes, nested lists,
2-D arrays, None) is a `RequestError` that names what was given.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import numpy as np
import torch

from .checks import is_int
from .errors import RequestError
from .metadata import RowSampling
from .sampling import SamplingParams, seed_key

@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # "length" | "stop" | "abort" | "error" once finished
    text: str | None = None
    error: str | None = None  # why, when finish_reason == "error"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled)
    spec_proposed: int = 0  # draft tokens proposed for it (speculative decoding)
    spec_accepted: int = 0  # of those, the ones the target accepted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)  # a request is itself: compared by identity
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # 0..2**64-1
    seed_key: int = dataclasses.field(init=False)  # what the step hashes with, mixed from all 64 bits
    stop_ids: frozenset[int]
    budget: int  # prompt + tokens it may generate, capped at max_model_len
    prefilled: int = 0  # prompt tokens whose state is in the pool (chunked prefill)
    cached_tokens: int = 0  # of those, the ones a prefix-cache hit supplied
    prefix_entry: object = None  # the prefix-cache entry it resumed from (pinned while it runs)
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    drafted: int = 0  # real drafts in its row of the current verify step (the rest are stand-ins)
    spec_proposed: int = 0
    spec_accepted: int = 0

    def __post_init__(self):
        self.seed_key = seed_key(self.seed)

    @property
    def cached_len(self) -> int:
        """Tokens whose state is in the pool: the prompt and every generated token but the newest."""
        return len(self.prompt) + len(self.output) - 1

    def sampling_row(self) -> RowSampling:
        p = self.params
        return RowSampling(float(p.temperature), int(p.top_k), float(p.top_p), self.seed_key, len(self.output))

    def fail(self, message: str) -> None:
        self.finish_reason, self.error = "error", message


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _token_ids(values: Sequence, what: str) -> list[int]:
    ids = []
    for i, t in enumerate(values):
        if not is_int(t):
            raise RequestError(f"{what}: token {i} is {_describe(t)}; token ids must be integers")
        ids.append(int(t))
    return ids


def prompt_ids(prompt, tokenizer) -> list[int]:
    """The token ids of one prompt, or a RequestError naming what is wrong with it (range not checked)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("text prompt given but the checkpoint has no tokenizer.json; pass token ids")
        try:
            return tokenizer.encode(prompt)
        except (UnicodeError, ValueError, TypeError) as e:
            raise RequestError(f"text prompt cannot be tokenized: {e}") from None
    if isinstance(prompt, torch.Tensor) or isinstance(prompt, np.ndarray):
        is_int = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex and prompt.dtype != torch.bool) \
            if isinstance(prompt, torch.Tensor) else np.issubdtype(prompt.dtype, np.integer)
        if prompt.ndim != 1 or not is_int:
            raise RequestError(f"a prompt array must be 1-D of integer token ids, got shape {tuple(prompt.shape)} "
                               f"of {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (list, tuple)):
        return _token_ids(prompt, "prompt")
    raise RequestError(f"a prompt must be a str or a sequence of token ids, got {_describe(prompt)}")


def prompt_list(prompts) -> list:
    """What `generate` was given, as a list of prompts: one prompt (a str, an array, a list of ids) or a
    list of them."""
    if isinstance(prompts, (str, torch.Tensor, np.ndarray)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(f"generate takes a prompt or a list of prompts, got {_describe(prompts)}")
    if not prompts:
        raise RequestError("generate was given no prompts")
    if isinstance(prompts[0], numbers.Number):
        return [prompts]  # one prompt of token ids (its values are checked as a prompt's)
    return list(prompts)
