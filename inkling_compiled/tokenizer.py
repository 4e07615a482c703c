"""Text <-> token ids through a checkpoint's tokenizer.json (the `tokenizers` library)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import CheckpointError


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer(path: str | Path, *, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> None:
    """A byte-level tokenizer: three special tokens, then one token per byte (ids 3..258), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {pad_id: "<pad>", bos_id: "<bos>", eos_id: "<eos>"}
    first = max(specials) + 1
    vocab = {tok: i for i, tok in specials.items()}
    vocab.update({ch: first + b for b, ch in _bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(path))


_BYTE_OF_CHAR = {ch: b for b, ch in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextTokenizer:
    """Thin wrapper: encode without special tokens, decode skipping them and ids the vocab lacks."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own bare Exception
            raise CheckpointError(f"{path} cannot be read as a tokenizer: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        self._byte_level = "ByteLevel" in kinds  # GPT-2 style: each byte spelled as one printable character
        self._special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level token's bytes, a byte-fallback piece's byte ("<0xC3>"),
        a SentencePiece piece with its word-start mark as a space; a special token's own spelling."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if self._byte_level and token_id not in self._special and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> "TextTokenizer | None":
        path = Path(folder) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=True)

