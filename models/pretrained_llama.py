"""Llama in the Hugging Face layout, for :mod:`.pretrained`: its
``config.json`` as a :class:`TransformerConfig`, and its weights as the
model's parameters and back.

The model's fused layouts are built per shard: the attention projection
``qkv`` holds, per key/value head g, that group's query heads, then its key
head, then its value head; ``gate_up`` interleaves gate and up per hidden
unit. Both rotary layouts agree (Hugging Face's Llama weights are already in
the "rotate half" order the model uses).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ._checkpoint import Checkpoint, required, span
from .config import RopeScaling, TransformerConfig

__all__ = ["llama_config"]


def llama_config(hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Hugging Face Llama ``config.json``.

    Args:
      hf: the parsed ``config.json``.
      **overrides: fields of the result to set (``dtype``, ``impl``,
        ``max_seq_len``, ``sharding``, ...).

    Raises:
      ValueError: a field the model cannot express (another architecture,
        bias terms, an activation other than SiLU, a rope scaling other than
        Llama 3's), or a missing one; the message names it.
    """
    need = functools.partial(required, hf, reader="llama_config")

    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ValueError(f"llama_config: model_type is {model_type!r}; only 'llama' "
                         f"checkpoints load into Transformer")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            raise ValueError(f"llama_config: {name} is true; the model has no bias terms")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"llama_config: hidden_act is {hf['hidden_act']!r}; the model's "
                         f"MLP is SwiGLU (silu)")
    heads = need("num_attention_heads")
    embed_dim = need("hidden_size")
    head_dim = hf.get("head_dim") or embed_dim // heads
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5 nests them here
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    fields = dict(
        vocab_size=need("vocab_size"), num_layers=need("num_hidden_layers"),
        embed_dim=embed_dim, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        mlp_dim=need("intermediate_size"), rope_theta=float(theta),
        rope_scaling=_rope_scaling(scaling), tie_embeddings=bool(hf.get("tie_word_embeddings")),
        norm_eps=float(need("rms_norm_eps")),
        max_seq_len=int(hf.get("max_position_embeddings", 8192)))
    return dataclasses.replace(TransformerConfig(**fields), **overrides)


def _rope_scaling(scaling: dict[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"llama_config: rope_scaling of type {kind!r}; the model takes "
                         f"'llama3' or none")
    try:
        return RopeScaling(factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position=int(
                               scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"llama_config: rope_scaling has no {e.args[0]!r}") from None


def builders(config: TransformerConfig, ckpt: Checkpoint) -> dict[tuple, Callable]:
    """Our parameter path -> ``f(index)`` building that shard (float32) from
    the checkpoint's weights."""
    h, kv = config.head_dim, config.num_kv_heads
    q_per_kv, f = config.num_heads // kv, config.mlp_dim

    def transposed(name):  # our [in, out] from torch's [out, in]
        return lambda idx: ckpt.read(name, idx[1], idx[0]).T

    def plain(name):
        return lambda idx: ckpt.read(name, *idx)

    def qkv(prefix):
        width = (q_per_kv + 2) * h  # one key/value group's columns

        def build(idx):
            rows, cols = idx
            total = kv * width
            g0, g1, skip = span(cols, total, width)
            q = ckpt.read(f"{prefix}.q_proj.weight", slice(g0 * q_per_kv * h, g1 * q_per_kv * h),
                          rows)
            k = ckpt.read(f"{prefix}.k_proj.weight", slice(g0 * h, g1 * h), rows)
            v = ckpt.read(f"{prefix}.v_proj.weight", slice(g0 * h, g1 * h), rows)
            groups = g1 - g0
            block = np.concatenate([q.reshape(groups, q_per_kv, h, -1),
                                    k.reshape(groups, 1, h, -1), v.reshape(groups, 1, h, -1)],
                                   axis=1)                       # [groups, q_per_kv+2, h, in]
            block = block.reshape(groups * width, -1).T           # [in, groups * width]
            start, stop, _ = cols.indices(total)
            return block[:, skip:skip + stop - start]
        return build

    def gate_up(prefix):
        def build(idx):
            rows, cols = idx
            u0, u1, skip = span(cols, 2 * f, 2)
            gate = ckpt.read(f"{prefix}.gate_proj.weight", slice(u0, u1), rows)
            up = ckpt.read(f"{prefix}.up_proj.weight", slice(u0, u1), rows)
            block = np.stack([gate.T, up.T], axis=-1).reshape(gate.shape[1], -1)
            start, stop, _ = cols.indices(2 * f)
            return block[:, skip:skip + stop - start]
        return build

    out = {("embedding",): plain("model.embed_tokens.weight"),
           ("final_norm", "weight"): plain("model.norm.weight")}
    if not config.tie_embeddings:
        out[("head",)] = transposed("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        out |= {
            ("blocks", i, "attn_norm", "weight"): plain(f"{p}.input_layernorm.weight"),
            ("blocks", i, "mlp_norm", "weight"): plain(f"{p}.post_attention_layernorm.weight"),
            ("blocks", i, "attn", "qkv", "kernel"): qkv(f"{p}.self_attn"),
            ("blocks", i, "attn", "out", "kernel"): transposed(f"{p}.self_attn.o_proj.weight"),
            ("blocks", i, "mlp", "gate_up", "kernel"): gate_up(f"{p}.mlp"),
            ("blocks", i, "mlp", "down", "kernel"): transposed(f"{p}.mlp.down_proj.weight"),
        }
    return out




def tensors(config: TransformerConfig, flat: dict[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's weights (torch's [out, in] for linear layers) from
    the model's parameters by path, float32."""
    h, kv = config.head_dim, config.num_kv_heads
    q_per_kv, d = config.num_heads // kv, config.embed_dim
    out = {"model.embed_tokens.weight": flat[("embedding",)],
           "model.norm.weight": flat[("final_norm", "weight")]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = flat[("head",)].T
    for i in range(config.num_layers):
        p, b = f"model.layers.{i}", ("blocks", i)
        qkv = flat[(*b, "attn", "qkv", "kernel")].T.reshape(kv, q_per_kv + 2, h, d)
        gate_up = flat[(*b, "mlp", "gate_up", "kernel")].reshape(d, -1, 2)
        out |= {
            f"{p}.input_layernorm.weight": flat[(*b, "attn_norm", "weight")],
            f"{p}.post_attention_layernorm.weight": flat[(*b, "mlp_norm", "weight")],
            f"{p}.self_attn.q_proj.weight": qkv[:, :q_per_kv].reshape(-1, d),
            f"{p}.self_attn.k_proj.weight": qkv[:, q_per_kv].reshape(-1, d),
            f"{p}.self_attn.v_proj.weight": qkv[:, q_per_kv + 1].reshape(-1, d),
            f"{p}.self_attn.o_proj.weight": flat[(*b, "attn", "out", "kernel")].T,
            f"{p}.mlp.gate_proj.weight": gate_up[..., 0].T,
            f"{p}.mlp.up_proj.weight": gate_up[..., 1].T,
            f"{p}.mlp.down_proj.weight": flat[(*b, "mlp", "down", "kernel")].T,
        }
    return out


def hf_config(config: TransformerConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``config``, its weights stored as ``dtype``."""
    d, kv, h = config.embed_dim, config.num_kv_heads, config.head_dim
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": config.vocab_size, "hidden_size": d,
          "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
          "num_attention_heads": config.num_heads, "num_key_value_heads": kv, "head_dim": h,
          "rope_theta": config.rope_theta, "rms_norm_eps": config.norm_eps,
          "max_position_embeddings": config.max_seq_len,
          "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                              "low_freq_factor": s.low_freq_factor,
                              "high_freq_factor": s.high_freq_factor,
                              "original_max_position_embeddings": s.original_max_position}
    return hf
