"""Prompt lookup: drafts copied from where the request's newest tokens appeared before."""

from __future__ import annotations

import numpy as np

from .drafter import Drafter


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
