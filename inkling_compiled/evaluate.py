"""Perplexity and bits per byte of a text under the engine (`inkling-compiled eval`), and the same under
transformers for comparison.

The text's tokens are cut into windows of `window` tokens starting every `stride` tokens; each token but
the first is scored once, in the first window that holds it past the previous window's end, so every
scored token has at least `window - stride` tokens before it (all of them in the first window). The
engine scores a window as one request's prompt (`prompt_logprobs=0`); every window is queued at once and
continuous batching prefills them together.
"""

from __future__ import annotations

import math
import time

import msgspec

from .errors import RequestError
from .sampling import SamplingParams


class Window(msgspec.Struct, frozen=True):
    begin: int  # the window is tokens[begin:end]
    end: int
    scored_from: int  # it scores tokens[scored_from:end]


class Score(msgspec.Struct, kw_only=True):
    tokens: int  # tokens scored
    bytes: int  # the UTF-8 bytes those tokens stand for
    nll: float  # their summed negative log-likelihood, nats

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes

    def summary(self) -> dict:
        return {"tokens": self.tokens, "bytes": self.bytes, "nll": self.nll, "perplexity": self.perplexity,
                "bits_per_byte": self.bits_per_byte}


def windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    if n_tokens < 2:
        raise RequestError(f"the text has {n_tokens} token(s); scoring needs at least 2")
    if window < 2 or not 1 <= stride < window:  # a window's first token has no context within it
        raise RequestError(f"window must be at least 2 and stride in 1..window-1, got window {window}, "
                           f"stride {stride}")
    out, begin, scored_to = [], 0, 1
    while True:
        end = min(begin + window, n_tokens)
        out.append(Window(begin, end, scored_to))
        if end == n_tokens:
            return out
        scored_to, begin = end, begin + stride


def _score(tokens: list[int], per_window: list[list[float]], wins: list[Window], tokenizer) -> Score:
    nll, count, nbytes = 0.0, 0, 0
    for w, logprobs in zip(wins, per_window):
        scored = logprobs[w.scored_from - w.begin:]  # logprobs[j] is tokens[begin + j]'s
        nll -= math.fsum(scored)
        count += len(scored)
        nbytes += sum(len(tokenizer.token_bytes(t)) for t in tokens[w.scored_from:w.end])
    return Score(tokens=count, bytes=nbytes, nll=nll)


def engine_score(engine, tokens: list[int], window: int, stride: int, progress=None) -> Score:
    """The engine's score of `tokens` over windows of `window` tokens every `stride`."""
    if window > engine.max_model_len - 1:
        raise RequestError(f"window of {window} tokens is too long: a prompt may have at most "
                           f"max_model_len - 1 = {engine.max_model_len - 1}")
    if engine.tokenizer is None:
        raise RequestError("the checkpoint has no tokenizer.json: bits per byte need each token's bytes")
    wins = windows(len(tokens), window, stride)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(tokens[w.begin:w.end], params) for w in wins]
    done, t0 = {}, time.perf_counter()
    while engine.has_unfinished():
        finished = [out for out in engine.step() if out.finished]
        for out in finished:
            if out.error is not None:
                raise RequestError(f"window {ids.index(out.request_id)} failed: {out.error}")
            done[out.request_id] = out.prompt_logprobs
        if progress is not None and finished:
            progress(f"scored {len(done)}/{len(wins)} windows in {time.perf_counter() - t0:.1f} s")
    return _score(tokens, [done[i] for i in ids], wins, engine.tokenizer)


def transformers_score(folder, tokens: list[int], window: int, stride: int, tokenizer, progress=None) -> Score:
    """The same score under transformers' InklingForCausalLM (fp32), one forward per window."""
    import torch
    from transformers import InklingForCausalLM

    model = InklingForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    wins, per_window = windows(len(tokens), window, stride), []
    with torch.no_grad():
        for i, w in enumerate(wins):
            ids = torch.tensor([tokens[w.begin:w.end]])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)[:-1]
            picked = logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()
            per_window.append([None] + picked)
            if progress is not None:
                progress(f"transformers: scored {i + 1}/{len(wins)} windows")
    return _score(tokens, per_window, wins, tokenizer)
