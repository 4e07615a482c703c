"""Sampling parameters and the batched sampler.

The sampler is pure tensor math with per-row parameters, so a batch of greedy, temperature, top-k
and top-p rows runs as one program (and can live inside a compiled step). Randomness is
counter-based: the noise for a row is a hash of (request seed, index of the token being generated,
vocab id), so the same seed gives the same tokens whatever else is in the batch, and nothing depends
on a `torch.Generator`'s hidden state.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from . import custom_ops  # noqa: F401  (registers torch.ops.inkling)
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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # An integer finaliser; every product stays below 2^63 so int64 never overflows.
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) [B, vocab] from per-row seed keys [B] (`seed_key`, 32-bit) and counters [B], independent
    of batch layout."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    x = _mix32(seed ^ ((counter * 0x27D4EB2D) & _MASK32))
    x = _mix32(x[:, None] ^ ((ids[None, :] * 0x165667B1) & _MASK32))
    return unit_interval(x)


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes to fp32 strictly inside (0, 1): the top 23 bits, centred. (24 bits would round the
    largest to exactly 1.0 in fp32, whose Gumbel noise is +inf: that entry would win whatever its logit.)"""
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chooses one token per row; returns (token ids [B] int64, log-softmax of the raw logits [B, V]).

    Rows with temperature 0 take the argmax. Others: logits / temperature, keep the top_k (0 = all),
    then the smallest prefix whose probability reaches top_p, then Gumbel-max with the row's noise.
    """
    logits = logits.float()
    V = logits.shape[-1]
    logprobs = torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature.clamp(min=1e-6)[:, None]

    candidates = torch.ops.inkling.top_k_top_p(scaled, top_k, top_p)  # sorts only rows that filter

    gumbel = -torch.log(-torch.log(uniform_noise(seed, counter, V)))
    sampled = (candidates + gumbel).argmax(dim=-1)
    tokens = torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
    return tokens, logprobs



def _per_token(row_values: torch.Tensor, tokens_per_row: int) -> torch.Tensor:
    return row_values[:, None].expand(-1, tokens_per_row).reshape(-1)


def verify_drafts(logits: torch.Tensor, inputs: torch.Tensor, drafted: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance of K drafts per row, as one program (it runs inside the compiled verify step).

    logits [B, K+1, V] at each row's K+1 verify positions; inputs [B, K+1] the tokens fed in (the newest
    token, then drafts d_1..d_K: position i's draft is d_{i+1}); drafted [B] how many of those drafts are
    real (the rest are stand-ins that fill the row: never accepted, never removed from a distribution, so
    a row without drafts gets exactly plain decoding's token). Returns (tokens [B, K+1], accepted [B] in
    0..drafted, log-softmax [B*(K+1), V]): the row emits tokens[:accepted+1], the accepted drafts then one
    token of the target's own.

    Greedy rows accept a draft while it is the argmax, and take the argmax where they stop: exactly what
    decoding one token at a time gives. Sampled rows use rejection sampling with the draft as a point
    mass: position i accepts d with probability p_i(d) under the row's filtered target distribution
    (temperature, top-k, top-p), and at the first rejection samples from p_i with d removed; with every
    draft accepted the bonus is sampled from p_K. Each emitted token is then distributed as the target
    says. Randomness is counter-based: position i's noise is that of token index counter + i, the accept
    draw a column of its own (V), so a seeded request is reproducible whatever the batch.
    """
    B, T_d, V = logits.shape
    flat = logits.reshape(B * T_d, V).float()
    logprobs = torch.log_softmax(flat, dim=-1)
    temperature_t = _per_token(temperature, T_d)
    scaled = flat / temperature_t.clamp(min=1e-6)[:, None]
    candidates = torch.ops.inkling.top_k_top_p(scaled, _per_token(top_k, T_d), _per_token(top_p, T_d))
    probs = torch.softmax(candidates, dim=-1)
    greedy = flat.argmax(dim=-1)

    position = torch.arange(T_d, device=logits.device)
    counters = (counter[:, None] + position).reshape(-1)
    noise = uniform_noise(_per_token(seed, T_d), counters, V + 1)
    has_draft = (position[None, :] < drafted[:, None]).reshape(-1)
    # the last column is a stand-in; a stand-in may lie outside the logits (the unpadded vocabulary)
    draft = torch.cat([inputs[:, 1:], inputs[:, :1]], dim=1).reshape(-1).clamp(0, V - 1)
    sampled_row = temperature_t > 0
    accept = torch.where(sampled_row, noise[:, V] < probs.gather(1, draft[:, None])[:, 0], draft == greedy)
    accept = (accept & has_draft).view(B, T_d)
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # length of the leading accepted run

    removed = has_draft[:, None] & (torch.arange(V, device=logits.device)[None, :] == draft[:, None])
    residual = candidates.masked_fill(removed, float("-inf"))
    gumbel = -torch.log(-torch.log(noise[:, :V]))
    own = torch.where(sampled_row, (residual + gumbel).argmax(dim=-1), greedy).view(B, T_d)
    tokens = torch.where(position[None, :] < accepted[:, None], draft.view(B, T_d), own)
    return tokens, accepted, logprobs
