"""The shapes of published checkpoints, for benchmarks on random weights.

``config_of("llama-3.2-1b")`` is what :func:`models.from_pretrained` would
build from that checkpoint's ``config.json`` (the real vocabulary, heads and
rope scaling), without its weights; a directory holding a ``config.json``
works too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import TransformerConfig
from .mamba_config import MambaConfig
from .pretrained import llama_config, pretrained_config

__all__ = ["NAMES", "config_of"]

# The config.json fields that shape the model, as the checkpoints publish them.
_LLAMA = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
}
_LLAMA_COMMON = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                     max_position_embeddings=131072)
NAMES = (*_LLAMA, "mamba2-1.3b")


def config_of(name: str) -> tuple[str, TransformerConfig | MambaConfig]:
    """(model name for ``models.MODELS``, config) of a published shape in
    :data:`NAMES`, or of a checkpoint directory's ``config.json`` (Llama or
    Mamba-2).

    Raises:
      ValueError: neither a known name nor a directory with a config.json.
    """
    if name in _LLAMA:
        return "transformer", llama_config({**_LLAMA_COMMON, **_LLAMA[name]}, dtype="bfloat16")
    if name == "mamba2-1.3b":
        # state-spaces/mamba2-1.3b: one B/C group, its 50,277 tokens padded to
        # 50,288, the LM head tied to the embedding.
        return "mamba", dataclasses.replace(MambaConfig.b1(), vocab_size=50288, num_groups=1,
                                            tie_embeddings=True)
    if (Path(name) / "config.json").is_file():
        config = pretrained_config(name)
        return ("transformer" if isinstance(config, TransformerConfig) else "mamba"), config
    raise ValueError(f"config_of: {name!r} is neither one of {NAMES} nor a directory with a "
                     f"config.json")
