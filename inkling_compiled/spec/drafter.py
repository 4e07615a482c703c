"""The interface every draft proposer implements (speculative decoding), and its bounds."""

from __future__ import annotations

import torch

SPECULATIVE = ("ngram", "mtp")  # the drafters an engine option names
MAX_SPECULATIVE_TOKENS = 16


class Drafter:
    """Proposes up to `num_tokens` tokens per request.

    `propose` returns, per request, its drafts (at most num_tokens; fewer is fine, the step fills the
    rest with stand-ins that count as nothing) or None when it has no guess. A step where no request
    has a guess decodes plainly, unless the drafter needs hidden states (only verify steps return them). The `observe_*` hooks hear what the target did, for drafters that keep
    state of their own (the hidden states come only when `needs_hidden` is set)."""

    num_tokens: int
    needs_hidden: bool = False
    draft_quantization: str = "none"  # the weights its drafts read: only the MTP drafter has any

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
