"""Generation by full recomputation: the simplest correct loop, kept as a cache-free reference."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_full_recompute(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens, re-running the whole sequence for every new token (O(n^2), no state)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        logits = model.forward_sequences([seq])[0]
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):]
