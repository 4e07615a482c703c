"""A request's tokens as text, as they arrive: whole characters only, and stop strings honoured.

Token ids come in a few at a time (one per step, more with speculative decoding). Decoding each new
token alone is wrong twice over: a byte-level token may hold half of a UTF-8 character, and tokenizers
that mark word starts (SentencePiece's "▁") drop a leading space when decoding a suffix. So the stream
decodes a short window that starts at a character boundary it has already passed and keeps what the new
tokens add (the approach vLLM's detokenizer takes), and waits while the end is an incomplete character.
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character that has not ended yet


class TextStream:
    """`update(tokens, final)` -> the text to send now. Text that could still turn out to be the start of
    a stop string is held back; once a stop string appears, the text ends before it (`stopped`)."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # every whole character decoded so far (up to the stop, once stopped)
        self.sent = 0  # characters of `text` already sent
        self.stopped = False
        self._window = 0  # first token of the decode window (a character boundary)
        self._read = 0  # tokens whose text is in `text`

    def _decode_new(self, tokens: list[int], final: bool) -> None:
        window = self.tokenizer.decode(tokens[self._window:])
        known = self.tokenizer.decode(tokens[self._window:self._read])
        if len(tokens) > self._read and (final or not window.endswith(_INCOMPLETE)) and window.startswith(known):
            self.text += window[len(known):]
            self._window, self._read = self._read, len(tokens)
        elif final and len(tokens) > self._read:  # a decoder that rewrote the window: take the whole text
            self.text = self.tokenizer.decode(tokens)
            self._read = len(tokens)

    def update(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self._decode_new(tokens, final)
        if self.stops:
            start = max(0, self.sent - self.hold)
            found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.text, self.stopped = self.text[:min(found)], True
        end = len(self.text) if self.stopped or final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def tokens_within(self, tokens: list[int]) -> int:
        """How many of `tokens` start inside the text (all of them, unless a stop string cut it)."""
        if not self.stopped:
            return len(tokens)
        return sum(1 for offset in token_offsets(self.tokenizer, tokens) if offset < len(self.text))


def token_offsets(tokenizer, tokens: list[int], start: int = 0, end: int | None = None) -> list[int]:
    """Where tokens [start, end) start in the decoded text of `tokens` (OpenAI's `text_offset`)."""
    end = len(tokens) if end is None else end
    return [len(tokenizer.decode(tokens[:i]).rstrip(_INCOMPLETE)) for i in range(start, end)]
