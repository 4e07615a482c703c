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
from .drafter import MAX_SPECULATIVE_TOKENS, SPECULATIVE, Drafter
from .mtp import DRAFT_QUANTIZATION, MtpDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "NgramDrafter", "MtpDrafter", "make_drafter", "MAX_SPECULATIVE_TOKENS", "SPECULATIVE",
           "DRAFT_QUANTIZATION"]


def make_drafter(kind: str | Drafter | None, num_tokens: int, model, quantization: str | None = None
                 ) -> Drafter | None:
    """The drafter an engine option names (None: no speculative decoding), or the Drafter it is.
    `quantization` (None: 'none') is the weights the MTP head drafts from; only that drafter has any."""
    if quantization is not None and (kind != "mtp" or quantization not in DRAFT_QUANTIZATION):
        raise OptionError(f"draft_quantization={quantization!r}: " + (
            f"choose one of {', '.join(DRAFT_QUANTIZATION)}" if kind == "mtp" else
            f"only the MTP head drafts from weights of its own (speculative={kind!r})"))
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
    return MtpDrafter(model, num_tokens, quantization or "none")
