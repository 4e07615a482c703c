"""Text <-> token ids through a checkpoint's tokenizer.json (the `tokenizers` library)."""

from __future__ import annotations

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


class TextTokenizer:
    """Thin wrapper: encode without special tokens, decode skipping them and ids the vocab lacks."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own bare Exception
            raise CheckpointError(f"{path} cannot be read as a tokenizer: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> "TextTokenizer | None":
        path = Path(folder) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=True)

