"""Draft proposers for speculative decoding, behind one small interface.

A drafter guesses the next K tokens of each running request; the engine checks every guess with one
verify forward of the target (`runner.verify_step`) and keeps the longest accepted run plus one token
of the target's own, so the output is what the target alone would give (greedy: token for token;
sampled: in distribution). A drafter only affects how many tokens a step yields, never which.

`Drafter` is what the engine calls; `NgramDrafter` (prompt lookup) needs nothing but the tokens,
`mtp.MtpDrafter` runs the checkpoint's own multi-token-prediction head on the target's hidden states.
Another draft model plugs in by implementing the same four methods.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import OptionError

SPECULATIVE = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16


class Drafter:
    """Proposes up to `num_tokens` tokens per request.

    `propose` returns, per request, its drafts (at most num_tokens; fewer is fine, the step fills the
    rest with stand-ins that count as nothing) or None when it has no guess. A step where no request
    has a guess decodes plainly, unless the drafter needs hidden states (only verify steps return them). The `observe_*` hooks hear what the target did, for drafters that keep
    state of their own (the hidden states come only when `needs_hidden` is set)."""

    num_tokens: int
    needs_hidden: bool = False

    def attach(self, pool, max_model_len: int) -> None:
        """Called once the engine's pool exists (slot ids are the pool's), before any request."""

    def state_tensors(self) -> list[torch.Tensor]:
        """What the drafter keeps on the device (the memory report counts it)."""
        return []

    def propose(self, reqs: list) -> list[list[int] | None]:
        raise NotImplementedError

    def observe_prefill(self, reqs: list, lengths: list[int], hidden: torch.Tensor | None) -> None:
        """After a prefill forward of `lengths[i]` more prompt tokens of each request (packed hidden [T, H])."""

    def observe_tokens(self, reqs: list, emitted: list[int], hidden: torch.Tensor | None) -> None:
        """After a decode or verify step: request i emitted `emitted[i]` tokens (already in its output);
        hidden [B, n, H] holds the target's hidden state at the positions of the inputs that produced them."""

    def release(self, req) -> None:
        """The request is finished or aborted: forget it."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens (n from
    `max_ngram` down to `min_ngram`) in its prompt and output, and propose what followed it. No weights,
    no state; it shines where the output copies spans of the prompt (editing code, quoting, extraction)."""

    def __init__(self, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def propose(self, reqs: list) -> list[list[int] | None]:
        return [self.lookup(np.asarray(r.prompt + r.output, dtype=np.int64)) for r in reqs]

    def lookup(self, tokens: np.ndarray) -> list[int] | None:
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every n-gram but the last
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return tokens[follow:follow + self.num_tokens].tolist()
        return None


def make_drafter(kind: str | Drafter | None, num_tokens: int, model) -> Drafter | None:
    """The drafter an engine option names (None: no speculative decoding), or the Drafter it is."""
    if kind is None:
        return None
    if isinstance(kind, Drafter):
        if getattr(kind, "num_tokens", num_tokens) != num_tokens:
            raise OptionError(f"the drafter was made for {kind.num_tokens} tokens; num_speculative_tokens={num_tokens}")
        kind.num_tokens = num_tokens
        return kind
    if kind not in SPECULATIVE:
        raise OptionError(f"unknown speculative={kind!r}: choose one of {', '.join(map(repr, SPECULATIVE))} or None")
    if kind == "ngram":
        return NgramDrafter(num_tokens)
    from .mtp import MtpDrafter

    return MtpDrafter(model, num_tokens)
