"""Sampling parameters, the seed key a request hashes with, and the sampler a step calls.

The sampler's math (`custom_ops/sampling.py`) is pure tensor math with per-row parameters, so a batch of
greedy, temperature, top-k and top-p rows runs as one program inside a compiled step; its randomness is
counter-based (a hash of the request's seed key, the index of the token being generated and the vocab id),
so the same seed gives the same tokens whatever else is in the batch. A CPU step runs it as the
`sample_tokens` / `verify_tokens` ops (C++), a GPU step as torch math that inductor fuses.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from .custom_ops import sampling as _ops
from .custom_ops.sampling import sample, uniform_noise, unit_interval, verify_drafts  # noqa: F401  (the sampler's math)
from .checks import is_finite, is_int
from .errors import RequestError

MAX_TOP_LOGPROBS = 20
MAX_COUNT = 2**31 - 1  # max_new_tokens and top_k: what the step's int32/int64 buffers hold with room to spare
MAX_SEED = 2**64 - 1  # seeds are 64-bit: every bit is hashed
MAX_FLOAT32 = 3.4028234663852886e38
_MASK32 = 0xFFFFFFFF


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: the engine draws one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each chosen token (under the model's distribution, before temperature)
    top_logprobs: int = 0  # also the n most likely (token, logprob) pairs per step
    detokenize: bool = True  # outputs carry `new_text`; False leaves it None (a server that decodes text itself)
    # The logprob of each prompt token after the first (and the n most likely there, for n > 0), computed as
    # the prompt is prefilled; None = off. Such a request is prefilled whole, never from the prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self):
        problems = []
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_COUNT:
            problems.append(f"max_new_tokens must be an integer in 1..{MAX_COUNT}, got {self.max_new_tokens!r}")
        if not is_finite(self.temperature) or not 0 <= self.temperature <= MAX_FLOAT32:
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_COUNT:
            problems.append(f"top_k must be an integer in 0..{MAX_COUNT} (0 = off), got {self.top_k!r}")
        # top_p travels as fp32: a value that rounds to 0 there would keep no token at all
        if not is_finite(self.top_p) or not (0.0 < self.top_p <= 1.0) or float(np.float32(self.top_p)) <= 0.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            problems.append(f"seed must be None or an integer in 0..2**64-1, got {self.seed!r}")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            problems.append(f"prompt_logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}, "
                            f"got {self.prompt_logprobs!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (tuple, list)) or \
                not all(is_int(t) and 0 <= t < 2**63 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be a sequence of non-negative integers, got {self.stop_token_ids!r}")
        for flag in ("ignore_eos", "logprobs", "detokenize"):
            if not isinstance(getattr(self, flag), bool):
                problems.append(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if problems:
            raise RequestError("invalid sampling parameters: " + "; ".join(problems))


_MASK64 = (1 << 64) - 1


def seed_key(seed: int) -> int:
    """The 32-bit key a step hashes with, mixed from all 64 bits of a seed (splitmix64's finaliser).

    Mixed once per request on the host, so the compiled step hashes only (key, counter, vocab id):
    inductor inlines per-row arithmetic into the [rows, vocab] noise kernel, where every extra
    operation is paid once per vocabulary entry."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK32


def sample_with_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step's draw and what it reports: (tokens [B], their logprobs [B], the MAX_TOP_LOGPROBS most likely
    ids [B, n] and their logprobs [B, n]). On CPU the `sample_tokens` op; elsewhere its torch math, which
    inductor fuses into the step's kernels."""
    args = (logits.float(), temperature, top_k, top_p, seed, counter, MAX_TOP_LOGPROBS)
    if logits.device.type == "cpu":
        return torch.ops.inkling.sample_tokens(*args)
    return _ops.sample_tokens_reference(*args)


def verify_with_logprobs(logits: torch.Tensor, inputs: torch.Tensor, drafted: torch.Tensor, temperature: torch.Tensor,
                         top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor
                         ) -> tuple[torch.Tensor, ...]:
    """A verify step's acceptance (`verify_drafts`) and what it reports: (tokens [B, K+1], accepted [B], the
    tokens' logprobs [B, K+1], the top ids and logprobs [B, K+1, n]). On CPU the `verify_tokens` op;
    elsewhere its torch math."""
    args = (logits.float(), inputs, drafted, temperature, top_k, top_p, seed, counter, MAX_TOP_LOGPROBS)
    if logits.device.type == "cpu":
        return torch.ops.inkling.verify_tokens(*args)
    return _ops.verify_tokens_reference(*args)
