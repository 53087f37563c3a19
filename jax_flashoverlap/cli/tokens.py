"""Text to token ids and back: a checkpoint's ``tokenizer.json``, or bytes.

The tiny presets train and generate on bytes (256 ids). A Hugging Face
checkpoint brings its tokenizer as ``tokenizer.json``, read with the
``tokenizers`` library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["Tokens", "ByteTokens", "TokenizerJson", "for_checkpoint"]


class Tokens(Protocol):
    def encode(self, text: str) -> np.ndarray: ...   # int32 [n]
    def decode(self, ids: np.ndarray) -> str: ...


class ByteTokens:
    """UTF-8 bytes as ids 0..255; bytes that are not UTF-8 decode as U+FFFD."""

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, np.uint8).tolist()).decode(errors="replace")


class TokenizerJson:
    """A Hugging Face ``tokenizer.json`` (no special tokens added or shown)."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(f"{path} needs the `tokenizers` package: pip install "
                              f"'jax-flashoverlap[models]'") from None
        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def for_checkpoint(directory: str | Path | None, vocab_size: int) -> Tokens:
    """The tokenizer of a checkpoint directory (its ``tokenizer.json``), or
    bytes where there is none and the vocabulary holds them.

    Raises:
      ValueError: no ``tokenizer.json`` and fewer than 256 ids.
    """
    if directory is not None and (Path(directory) / "tokenizer.json").is_file():
        return TokenizerJson(Path(directory) / "tokenizer.json")
    if vocab_size < 256:
        where = f"{directory} has no tokenizer.json" if directory else "no tokenizer"
        raise ValueError(f"{where}, and the model's {vocab_size} ids cannot hold bytes; "
                         f"put the checkpoint's tokenizer.json beside its config.json")
    return ByteTokens()
