"""Tokenizers behind `data.tokenizer`: UTF-8 bytes, or a HuggingFace `tokenizers` JSON file.

Both expose the same small interface: `vocab_size`, `eos_id`, `encode(text) -> list[int]`, `decode(ids) -> str`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from nsa_training.config import ConfigError

EOS_TOKENS = ("</s>", "<|endoftext|>", "<eos>")  # the usual spellings, tried in this order


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS 256: needs no file and covers any text."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` JSON file (e.g. a model's tokenizer.json); EOS is its end-of-text special token."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _Tokenizer  # optional dependency: only needed for this spec
        except ImportError:
            raise ConfigError(f"data.tokenizer: {path} needs the `tokenizers` package, which is not installed: "
                              "`pip install tokenizers`, or set data.tokenizer = 'byte'") from None
        try:
            self._tokenizer = _Tokenizer.from_file(path)
        except Exception as error:  # tokenizers raises a bare Exception for any unreadable or malformed file
            cause = " ".join(str(error).split())  # one line: its messages may span several
            raise ConfigError(f"data.tokenizer: {path} is not a tokenizers JSON file ({cause}); "
                              "give `byte` or the path of a tokenizer.json") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos_ids = [self._tokenizer.token_to_id(token) for token in EOS_TOKENS]
        eos_ids = [i for i in eos_ids if i is not None]
        if not eos_ids:
            raise ConfigError(f"data.tokenizer: {path} has no end-of-text token (one of {', '.join(EOS_TOKENS)}); "
                              "use a tokenizer that defines one, or `byte`")
        self.eos_id = eos_ids[0]

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte`, or the path of a `tokenizers` JSON file."""
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ConfigError(f"data.tokenizer: no such file {spec!r}; give `byte` or the path of a tokenizers JSON file")
    return HFTokenizer(spec)
