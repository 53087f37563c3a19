"""Training data: byte-level tokens (or a checkpoint tokenizer's) from a
file, or from a corpus that ships with Python (so that training runs
offline), in random windows that are a function of the step alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from .tokens import Tokens

__all__ = ["default_corpus", "load_corpus", "batch_at"]


def default_corpus() -> Path:
    """Python's own documentation text (``pydoc_data/topics.py``, ~800 KB)."""
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("this Python ships no pydoc_data.topics; pass --data FILE")
    return Path(spec.origin)


def load_corpus(path: Path | None, seq_len: int, codes: Tokens | None = None) -> np.ndarray:
    """The training tokens: the file's bytes, uint8 (byte-level tokens:
    vocabulary 256), or with ``codes`` (a checkpoint's tokenizer) its text
    through them, int32."""
    path = path or default_corpus()
    if codes is None:
        corpus, unit = np.frombuffer(path.read_bytes(), np.uint8), "bytes"
    else:
        corpus, unit = codes.encode(path.read_bytes().decode(errors="replace")), "tokens"
    if corpus.size <= seq_len + 1:
        raise ValueError(f"--data {path}: {corpus.size} {unit}, need more than "
                         f"--seq-len + 1 = {seq_len + 1}")
    return corpus


def batch_at(corpus: np.ndarray, step: int, *, batch: int, seq_len: int,
             seed: int) -> np.ndarray:
    """Step ``step``'s batch: random windows [batch, seq_len + 1], int32.

    A function of the step alone, so that a restored run sees the same data.
    """
    starts = np.random.default_rng((seed, step)).integers(0, corpus.size - seq_len - 1, batch)
    return np.stack([corpus[s:s + seq_len + 1] for s in starts]).astype(np.int32)
