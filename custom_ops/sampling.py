"""The sampler's math, and the ops that run it.

The sampler is pure tensor math with per-row parameters, so a batch of greedy, temperature, top-k and
top-p rows runs as one program inside a compiled step. Randomness is counter-based: the noise for a row
is a hash of (request seed key, index of the token being generated, vocab id), so the same seed gives the
same tokens whatever else is in the batch, and nothing depends on a `torch.Generator`'s hidden state.

- `top_k_top_p`: the filter behind an op, so that the sort runs only for the rows that ask for it. A
  full-vocabulary sort is expensive, and greedy or plain-temperature rows do not need it; deciding that is
  data-dependent, which a static graph cannot express without a branch, while an opaque op simply looks (on
  the host, where looking is free). The CUDA kernel (`gpu/sampling.py`) cannot look: it finds each row's
  cut-offs by bisection, with no sort at all, and copies rows that filter nothing.
- `sample` and `verify_drafts` (with `top_logprobs`): a decode step's and a verify step's sampler as torch
  math: what a GPU step runs (inductor fuses it into its own kernels), and the reference of
- `sample_tokens` and `verify_tokens`: the same samplers as ops, what a CPU step runs. Compiled for CPU,
  the torch math gives every row the noise of a draw (a hash and two logarithms per vocabulary entry), a
  softmax and ATen's top-k; the C++ kernel reads a greedy row twice (maximum and e^ sum, then its top n)
  and computes the filter and the noise only for rows that sample (`tools/bench_sampler.py` times both).
  Their CUDA kernels are the references (plain torch, no host sync). Where torch leaves an order open the
  kernel fixes one: equal values rank lower index first, and NaN ranks above every number (as torch's
  argmax and top-k take it). Seeds are the 32-bit keys `seed_key` mixes, counters non-negative int64s.
"""

from __future__ import annotations

import torch

from .library import define, gpu_kernel

_MASK32 = 0xFFFFFFFF


def filter_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top_k (0 = all), then outside the smallest prefix reaching top_p."""
    V = scaled.shape[-1]
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    rank = torch.arange(V, device=scaled.device)[None, :]
    ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The top token is always kept; top_p >= 1 keeps every token (the running sum may round past 1
    # before the tail, which must not drop it).
    kept = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (rank < k[:, None])
    threshold = ordered.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def top_k_top_p_reference(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows = ((top_k > 0) | (top_p < 1.0)).nonzero()[:, 0]
    out = scaled.clone()
    if rows.numel():
        out[rows] = filter_rows(scaled[rows], top_k[rows], top_p[rows])
    return out


top_k_top_p = define("top_k_top_p(Tensor scaled, Tensor top_k, Tensor top_p) -> Tensor",
                     fake=lambda scaled, top_k, top_p: torch.empty_like(scaled), reference=top_k_top_p_reference,
                     cuda=gpu_kernel("sampling", "top_k_top_p"))


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


def top_logprobs(tokens: torch.Tensor, logprobs: torch.Tensor, top_n: int) -> tuple[torch.Tensor, ...]:
    """(each row's token's logprob [R], the top_n (at most V) most likely ids [R, n] and their logprobs)."""
    top = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
    return logprobs.gather(-1, tokens[:, None])[:, 0], top.indices, top.values


def sample_tokens_reference(logits, temperature, top_k, top_p, seed, counter, top_n: int):
    tokens, logprobs = sample(logits, temperature, top_k, top_p, seed, counter)
    return (tokens, *top_logprobs(tokens, logprobs, top_n))


def verify_tokens_reference(logits, inputs, drafted, temperature, top_k, top_p, seed, counter, top_n: int):
    B, T, _ = logits.shape
    tokens, accepted, logprobs = verify_drafts(logits, inputs, drafted, temperature, top_k, top_p, seed, counter)
    chosen, ids, values = top_logprobs(tokens.reshape(-1), logprobs, top_n)
    return tokens, accepted, chosen.view(B, T), ids.view(B, T, -1), values.view(B, T, -1)


def _sample_tokens_fake(logits, temperature, top_k, top_p, seed, counter, top_n: int):
    B, V = logits.shape
    n = min(top_n, V)
    return (logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32),
            logits.new_empty(B, n, dtype=torch.int64), logits.new_empty(B, n, dtype=torch.float32))


def _verify_tokens_fake(logits, inputs, drafted, temperature, top_k, top_p, seed, counter, top_n: int):
    B, T, V = logits.shape
    n = min(top_n, V)
    return (logits.new_empty(B, T, dtype=torch.int64), logits.new_empty(B, dtype=torch.int64),
            logits.new_empty(B, T, dtype=torch.float32), logits.new_empty(B, T, n, dtype=torch.int64),
            logits.new_empty(B, T, n, dtype=torch.float32))


sample_tokens = define(
    "sample_tokens(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, Tensor counter, "
    "int top_n) -> (Tensor, Tensor, Tensor, Tensor)",
    fake=_sample_tokens_fake, reference=sample_tokens_reference, cuda=sample_tokens_reference)

verify_tokens = define(
    "verify_tokens(Tensor logits, Tensor inputs, Tensor drafted, Tensor temperature, Tensor top_k, Tensor top_p, "
    "Tensor seed, Tensor counter, int top_n) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_verify_tokens_fake, reference=verify_tokens_reference, cuda=verify_tokens_reference)
