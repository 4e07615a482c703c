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

class RequestOutput:
    """What one step (or `generate`) hands back for a request.

    `new_token_ids` / `new_logprobs` / `new_top_logprobs` / `new_text` are what this output adds since the
    request's previous one (the text decoded incrementally, once per request). The cumulative fields
    (`token_ids`, `logprobs`, `top_logprobs`, `text`) are read from the request's own append-only lists
    when asked for, cut at this output: making an output costs the same at the 2,000th token as at the
    first."""

    __slots__ = ("request_id", "prompt_token_ids", "finish_reason", "error", "cached_tokens", "spec_proposed",
                 "spec_accepted", "new_text", "_req", "_start", "_end", "_tokenizer", "_text")

    def __init__(self, req: "Request", start: int, new_text: str | None, tokenizer):
        self.request_id, self.prompt_token_ids = req.request_id, req.prompt
        self.finish_reason, self.error = req.finish_reason, req.error  # "length" | "stop" | "abort" | "error"
        self.cached_tokens = req.cached_tokens  # prompt tokens served from the prefix cache (not prefilled)
        self.spec_proposed, self.spec_accepted = req.spec_proposed, req.spec_accepted  # drafts proposed / accepted
        self.new_text = new_text
        self._req, self._start, self._end, self._tokenizer = req, start, len(req.output), tokenizer
        self._text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, earlier: "RequestOutput") -> "RequestOutput":
        """This output, also carrying the new tokens and text of an earlier one of the same request that
        was never delivered."""
        self._start = min(self._start, earlier._start)
        if self.new_text is not None:
            self.new_text = (earlier.new_text or "") + self.new_text
        return self

    @property
    def token_ids(self) -> list[int]:
        return self._req.output[:self._end]

    @property
    def new_token_ids(self) -> list[int]:
        return self._req.output[self._start:self._end]

    @property
    def logprobs(self) -> list[float] | None:
        return self._req.logprobs[:self._end] if self._req.params.logprobs else None

    @property
    def new_logprobs(self) -> list[float] | None:
        return self._req.logprobs[self._start:self._end] if self._req.params.logprobs else None

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self._req.top_logprobs[:self._end] if self._req.params.top_logprobs else None

    @property
    def new_top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self._req.top_logprobs[self._start:self._end] if self._req.params.top_logprobs else None

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        """With `prompt_logprobs` asked for: each prompt token's logprob given the tokens before it (None for
        the first, which has none), filled in as the prompt is prefilled."""
        return self._req.prompt_logprobs if self._req.params.prompt_logprobs is not None else None

    @property
    def prompt_top_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        """With `prompt_logprobs=n` for n > 0: the n most likely (token, logprob) pairs at each prompt token."""
        return self._req.prompt_top_logprobs if self._req.params.prompt_logprobs else None

    @property
    def text(self) -> str | None:
        """The whole text so far (decoded once, when first read), when the checkpoint has a tokenizer."""
        if self._tokenizer is None:
            return None
        if self._text is None:
            self._text = self._tokenizer.decode(self.token_ids)
        return self._text

    def __eq__(self, other) -> bool:
        fields = ("request_id", "prompt_token_ids", "token_ids", "logprobs", "top_logprobs", "prompt_logprobs",
                  "prompt_top_logprobs", "finish_reason", "text", "error", "cached_tokens", "spec_proposed", "spec_accepted")
        return isinstance(other, RequestOutput) and all(getattr(self, f) == getattr(other, f) for f in fields)

    __hash__ = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r}, text={self.text!r})")


class IncrementalText:
    """A request's text as its tokens arrive: each call decodes only a short window of recent tokens and
    returns the characters they complete (a character still missing bytes waits for the next token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0  # tokens[prefix:read] are the window's already-returned context

    def advance(self, tokens: list[int], final: bool = False) -> str:
        """The text `tokens` add past what earlier calls returned; `final` also gives out a character that
        is still missing bytes (the request ends there)."""
        before = self.tokenizer.decode(tokens[self.prefix:self.read])
        now = self.tokenizer.decode(tokens[self.prefix:])
        if now.endswith("\ufffd") and not final:
            return ""
        self.prefix, self.read = self.read, len(tokens)
        return now[len(before):]


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
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    drafted: int = 0  # real drafts in its row of the current verify step (the rest are stand-ins)
    spec_proposed: int = 0
    spec_accepted: int = 0
    reported: int = 0  # output tokens an earlier RequestOutput already carried
    text: IncrementalText | None = None

    def __post_init__(self):
        self.seed_key = seed_key(self.seed)
        if self.params.prompt_logprobs is not None:  # the first prompt token has nothing before it
            self.prompt_logprobs.append(None)
            self.prompt_top_logprobs.append(None)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def cached_len(self) -> int:
        """Tokens whose state is in the pool: the prompt and every generated token but the newest."""
        return len(self.prompt) + len(self.output) - 1

    def sampling_row(self) -> RowSampling:
        p = self.params
        return RowSampling(float(p.temperature), int(p.top_k), float(p.top_p), self.seed_key, len(self.output))

    def fail(self, message: str) -> None:
        self.finish_reason, self.error = "error", message

    def append(self, tok: int, chosen: float, top_ids: list[int], top_vals: list[float]) -> None:
        """One generated token; finishes the request on a stop token or at its length."""
        self.output.append(tok)
        if self.params.logprobs:
            self.logprobs.append(chosen)
        n = self.params.top_logprobs
        if n:
            self.top_logprobs.append(list(zip(top_ids[:n], top_vals[:n])))
        if tok in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens or len(self.prompt) + len(self.output) >= self.budget:
            self.finish_reason = "length"

    def append_prompt_scores(self, chosen: list[float], top_ids: list[list[int]], top_vals: list[list[float]]) -> None:
        """The logprobs of the prompt tokens a prefill chunk scored (each the token after a chunk position)."""
        n = self.params.prompt_logprobs
        self.prompt_logprobs.extend(chosen)
        if n:  # with n = 0 no top logprobs are kept (`prompt_top_logprobs` is None then)
            self.prompt_top_logprobs.extend(list(zip(i[:n], v[:n])) for i, v in zip(top_ids, top_vals))

    def output_since_reported(self, tokenizer) -> RequestOutput:
        """Its output now, carrying the tokens (and text) since the previous one."""
        new_text = None
        if tokenizer is not None and self.params.detokenize:
            if self.text is None:
                self.text = IncrementalText(tokenizer)
            new_text = self.text.advance(self.output, final=self.finish_reason is not None) \
                if len(self.output) > self.reported else ""
        out = RequestOutput(self, self.reported, new_text, tokenizer)
        self.reported = len(self.output)
        return out


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _token_ids(values: Sequence, what: str) -> list[int]:
    if all(type(t) is int for t in values):  # what nearly every caller passes: a third of the loop's time
        return list(values)
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
