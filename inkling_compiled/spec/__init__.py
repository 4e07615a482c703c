"""Draft proposers for speculative decoding, behind one small interface.

A drafter guesses the next K tokens of each running request; the engine checks every guess with one
verify forward of the target (`runner.verify_step`) and keeps the longest accepted run plus one token
of the target's own, so the output is what the target alone would give (greedy: token for token;
sampled: in distribution). A drafter only affects how many tokens a step yields, never which.

`Drafter` (`drafter.py`) is what the engine calls; `NgramDrafter` (`ngram.py`, prompt lookup) needs
nothing but the tokens; `MtpDrafter` (`mtp.py`) runs the checkpoint's own multi-token-prediction head
on the target's hidden states. Another draft model plugs in by implementing the same methods.
`make_drafter` is the one factory; the modules import only `drafter.py`, never this package.
"""

from __future__ import annotations

from ..errors import OptionError
from ..quantize import CHOICES
from .drafter import MAX_SPECULATIVE_TOKENS, SPECULATIVE, Drafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "NgramDrafter", "MtpDrafter", "make_drafter", "check_drafter_options", "MAX_SPECULATIVE_TOKENS",
           "SPECULATIVE"]


def check_drafter_options(kind: str | Drafter | None, draft_quantization: str | None) -> str:
    """The `speculative` and `draft_quantization` options checked (before anything is loaded); the draft
    weights meant ('none' or 'int8'; None is 'none'). Only the MTP head drafts from weights, so 'int8' needs
    speculative='mtp'."""
    if kind is not None and not isinstance(kind, Drafter) and kind not in SPECULATIVE:
        raise OptionError(f"unknown speculative={kind!r}: choose one of {', '.join(map(repr, SPECULATIVE))} or None")
    if draft_quantization is None:
        return "none"
    if not isinstance(draft_quantization, str) or draft_quantization not in CHOICES:
        raise OptionError(f"draft_quantization={draft_quantization!r}: choose one of {', '.join(CHOICES)}")
    if draft_quantization != "none" and kind != "mtp":
        raise OptionError(f"draft_quantization={draft_quantization!r}: only the MTP head drafts from weights of "
                          f"its own (speculative={kind if isinstance(kind, str) or kind is None else type(kind).__name__!r})")
    return draft_quantization


def make_drafter(kind: str | Drafter | None, num_tokens: int, model, draft_quantization: str | None = None
                 ) -> Drafter | None:
    """The drafter an engine option names (None: no speculative decoding), or the Drafter it is.
    `draft_quantization` is the weights the MTP head drafts from (`check_drafter_options`)."""
    draft_quantization = check_drafter_options(kind, draft_quantization)
    if kind is None:
        return None
    if isinstance(kind, Drafter):
        if getattr(kind, "num_tokens", num_tokens) != num_tokens:
            raise OptionError(f"the drafter was made for {kind.num_tokens} tokens; num_speculative_tokens={num_tokens}")
        kind.num_tokens = num_tokens
        return kind
    if kind == "ngram":
        return NgramDrafter(num_tokens)
    return MtpDrafter(model, num_tokens, draft_quantization)
