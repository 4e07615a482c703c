"""A request's tokens as text, as they arrive: whole characters only, and stop strings honoured.

Token ids come in a few at a time (one per step, more with speculative decoding). Decoding each new
token alone is wrong twice over: a byte-level token may hold half of a UTF-8 character, and tokenizers
that mark word starts (SentencePiece's "▁") drop a leading space when decoding a suffix. So the stream
decodes a short window that starts at a character boundary it has already passed and keeps what each
new token adds (the approach vLLM's detokenizer takes), and waits while the end is an incomplete
character. Every token gets the offset where its text starts (OpenAI's `text_offset`): a token that
only begins a character starts where that character does. The work per token is a window's decode,
never the whole text again.
"""

from __future__ import annotations

import bisect

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
        self.offsets: list[int] = []  # where each token seen so far starts in `text`
        self._window = 0  # first token of the decode window (a character boundary)
        self._read = 0  # tokens whose text is in `text`

    def _take(self, tokens: list[int], final: bool) -> None:
        """Tokens past the ones seen, one at a time: each is given its offset, and the text grows whenever
        the window's end is a whole character (or the tokens are final)."""
        for end in range(len(self.offsets) + 1, len(tokens) + 1):
            self.offsets.append(len(self.text))
            window = self.tokenizer.decode(tokens[self._window:end])
            if window.endswith(_INCOMPLETE) and not (final and end == len(tokens)):
                continue
            known = self.tokenizer.decode(tokens[self._window:self._read])
            if window.startswith(known):
                self.text += window[len(known):]
            else:  # a decoder that rewrote the window: take the whole text again
                self.text = self.tokenizer.decode(tokens[:end])
            self._window, self._read = self._read, end

    def update(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self._take(tokens, final)
        if self.stops:
            start = max(0, self.sent - self.hold)
            found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.text, self.stopped = self.text[:min(found)], True
        end = len(self.text) if self.stopped or final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def tokens_within(self) -> int:
        """How many of the tokens seen start inside the text (all of them, unless a stop string cut it)."""
        if not self.stopped:
            return len(self.offsets)
        return bisect.bisect_left(self.offsets, len(self.text))

    def tokens_sent(self) -> int:
        """How many tokens start inside the text already sent (their logprobs may go out with it)."""
        return bisect.bisect_left(self.offsets, self.sent)
