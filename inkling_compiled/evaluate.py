"""Perplexity and bits per byte of a text under the engine (`inkling-compiled eval`), and the same under
transformers for comparison.

The text's tokens are cut into windows of `window` tokens starting every `stride` tokens; each token but
the first is scored once, in the first window that holds it past the previous window's end, so every
scored token has at least `window - stride` tokens before it (all of them in the first window). The
engine scores a window as one request's prompt (`prompt_logprobs=0`); a few batches' worth are queued at a
time and continuous batching prefills them together.
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
        return self.nll / math.log(2) / self.bytes if self.bytes else float("nan")

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


class _Tally:
    """Scores summed window by window, as windows finish (nothing per token is kept)."""

    def __init__(self, tokens: list[int], tokenizer):
        self.tokens, self.tokenizer = tokens, tokenizer
        self.nll, self.count, self.bytes = 0.0, 0, 0

    def add(self, w: Window, logprobs: list) -> None:
        """`logprobs[j]`: the logprob of tokens[w.begin + j] (None for j = 0)."""
        scored = logprobs[w.scored_from - w.begin:]
        if len(scored) != w.end - w.scored_from or any(lp is None for lp in scored):
            raise RequestError(f"window [{w.begin}, {w.end}) came back with {len(scored)} of its "
                               f"{w.end - w.scored_from} scores")
        self.nll -= math.fsum(scored)
        self.count += len(scored)
        self.bytes += sum(len(self.tokenizer.token_bytes(t)) for t in self.tokens[w.scored_from:w.end])

    def score(self) -> Score:
        return Score(tokens=self.count, bytes=self.bytes, nll=self.nll)


def check_windows(n_tokens: int, window: int, stride: int, max_model_len: int) -> list[Window]:
    """The windows, or a RequestError naming what cannot be scored (before any model is loaded)."""
    if window > max_model_len - 1:
        raise RequestError(f"window of {window} tokens is too long: a prompt may have at most max_model_len - 1 = "
                           f"{max_model_len - 1} (raise max_model_len)")
    return windows(n_tokens, window, stride)


def engine_score(engine, tokens: list[int], window: int, stride: int, progress=None) -> Score:
    """The engine's score of `tokens` over windows of `window` tokens every `stride`, a few batches' worth of
    windows queued at a time."""
    wins = check_windows(len(tokens), window, stride, engine.max_model_len)
    if engine.tokenizer is None:
        raise RequestError("the checkpoint has no tokenizer.json: bits per byte need each token's bytes")
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    tally, queued, done, t0 = _Tally(tokens, engine.tokenizer), {}, 0, time.perf_counter()
    pending = iter(wins)
    in_flight = 4 * engine.max_batch_size
    while True:
        while len(queued) < in_flight and (w := next(pending, None)) is not None:
            queued[engine.add_request(tokens[w.begin:w.end], params)] = w
        if not queued:
            return tally.score()
        finished = [out for out in engine.step() if out.finished]
        for out in finished:
            w = queued.pop(out.request_id)
            if out.finish_reason not in ("length", "stop"):
                raise RequestError(f"window [{w.begin}, {w.end}) did not finish ({out.finish_reason}): {out.error}")
            tally.add(w, out.prompt_logprobs)
            done += 1
        if progress is not None and finished:
            progress(f"scored {done}/{len(wins)} windows in {time.perf_counter() - t0:.1f} s")


def transformers_score(folder, tokens: list[int], window: int, stride: int, tokenizer, progress=None) -> Score:
    """The same score under transformers' InklingForCausalLM (fp32), one forward per window."""
    import torch
    from transformers import InklingForCausalLM

    model = InklingForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    wins, tally = windows(len(tokens), window, stride), _Tally(tokens, tokenizer)
    with torch.no_grad():
        for i, w in enumerate(wins):
            ids = torch.tensor([tokens[w.begin:w.end]])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)[:-1]
            tally.add(w, [None] + logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist())
            if progress is not None:
                progress(f"transformers: scored {i + 1}/{len(wins)} windows")
    return tally.score()
