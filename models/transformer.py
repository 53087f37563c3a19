"""A Llama-style decoder with tensor and sequence parallelism on the overlap ops.

RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP. Each
block has two column-parallel GEMMs (fused QKV, fused gate/up) and two
row-parallel ones (attention output, MLP down): with sequence parallelism,
two all-gather→GEMMs and two GEMM→reduce-scatters per block, in the forward
and (mirrored) in the backward pass. Heads and MLP width are split over the
tensor axis; attention runs on each rank's heads over the whole sequence.

Attention goes through ``jax.nn.dot_product_attention``: cuDNN's flash
attention on GPUs (``TransformerConfig.attention_impl``, see
:func:`attention_implementation`), XLA's reference attention elsewhere.

Fused kernels keep their columns grouped so that a contiguous column shard is
a whole unit at any tensor-parallel size (the parameters do not depend on
it): QKV by key/value head ([q heads of the group, k, v] per kv head), gate/up
interleaved per hidden unit.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from jax_flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

from .config import TransformerConfig
from .layers import CausalLM, RMSNorm, linear_options

__all__ = ["Transformer", "Block", "Attention", "MLP", "rope", "attention_implementation",
           "cudnn_attention_unsupported", "resolve_scan_layers"]


def cudnn_attention_unsupported(dtype, head_dim: int, platform: str,
                                compute_capability: str | None) -> str | None:
    """Why cuDNN flash attention cannot run this attention, or None if it can.

    The constraints ``jax.nn.dot_product_attention(implementation="cudnn")``
    checks for 16-bit inputs (``jax/_src/cudnn/fused_attention_stablehlo.py``),
    and an Ampere-or-later GPU, which cuDNN's flash attention needs.

    Args:
      dtype: the compute dtype.
      head_dim: h.
      platform: "cuda", "rocm", "cpu", ... (see :func:`attention_implementation`).
      compute_capability: the CUDA GPU's, e.g. "9.0"; None elsewhere.
    """
    if platform != "cuda":
        return f"cuDNN attention needs a CUDA GPU (running on {platform})"
    capability = tuple(int(v) for v in (compute_capability or "0.0").split("."))
    if capability < (8, 0):
        return f"cuDNN flash attention needs compute capability 8.0+, got {compute_capability}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN attention needs bfloat16 or float16, got {jnp.dtype(dtype)}"
    h_max = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > h_max:
        return (f"cuDNN attention needs head_dim a multiple of 8 and at most {h_max} on "
                f"compute capability {compute_capability}, got {head_dim}")
    return None


def attention_implementation(config: TransformerConfig,
                             device: jax.Device | None = None) -> str:
    """``config.attention_impl`` on ``device`` (default the first): "cudnn" or "xla".

    "auto" is "cudnn" where cuDNN supports it (see
    :func:`cudnn_attention_unsupported`), else "xla".

    Raises:
      ValueError: "cudnn" asked for where it cannot run.
    """
    device = device or jax.devices()[0]
    platform = device.platform
    if platform == "gpu":  # CUDA or ROCm: the client says which.
        platform = "cuda" if "cuda" in device.client.platform_version.lower() else "rocm"
    why_not = cudnn_attention_unsupported(config.dtype, config.head_dim, platform,
                                          getattr(device, "compute_capability", None))
    if config.attention_impl == "auto":
        return "xla" if why_not else "cudnn"
    if config.attention_impl == "cudnn" and why_not:
        raise ValueError(f"TransformerConfig: attention_impl='cudnn' but {why_not}; use "
                         f"attention_impl='auto' (cuDNN where it runs, else XLA) or 'xla'.")
    return config.attention_impl


def resolve_scan_layers(config: TransformerConfig, attention: str) -> TransformerConfig:
    """``config`` with ``scan_layers`` decided for the attention that runs.

    None becomes False with cuDNN attention and True otherwise: on the GPU
    machine (jax 0.11.2, H200) XLA's compiler died with SIGSEGV on the
    training step of the scanned blocks with cuDNN attention (the 1B model
    and the tiny test model), while the same step unrolled compiled and ran,
    and so did cuDNN attention inside a plain ``lax.scan``. Asking for
    ``scan_layers=True`` with cuDNN attention warns.

    Args:
      config: the model's config.
      attention: "cudnn" or "xla", from :func:`attention_implementation`.
    """
    if config.scan_layers is None:
        return dataclasses.replace(config, scan_layers=attention != "cudnn")
    if config.scan_layers and attention == "cudnn":
        warnings.warn("TransformerConfig(scan_layers=True) with cuDNN attention: XLA's "
                      "compiler crashed (SIGSEGV) on this combination with jax 0.11.2; "
                      "scan_layers=None (unrolled with cuDNN) or attention_impl='xla' avoid "
                      "it.", stacklevel=2)
    return config


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embeddings ("rotate half" layout), positions 0..s-1.

    Args:
      x: [s, b, heads, h], the whole sequence.
      theta: base of the frequencies.

    Returns:
      x rotated by position, same shape and dtype.
    """
    h = x.shape[-1]
    freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)     # [h/2]
    angle = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] * freq  # [s, h/2]
    cos, sin = (f(angle)[:, None, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query self-attention over this rank's heads."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, h, kv = config.embed_dim, config.head_dim, config.num_kv_heads
        self.q_per_kv = config.num_heads // kv
        self.head_dim = h
        self.rope_theta = config.rope_theta
        self.implementation = attention_implementation(config)
        self.qkv = ColumnParallelLinear(d, kv * (self.q_per_kv + 2) * h,
                                        **linear_options(config, rngs))
        self.out = RowParallelLinear(config.num_heads * h, d, **linear_options(config, rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [s/tp, b, d] (or [s, b, d] without SP) -> the same."""
        qkv = self.qkv(x)                                   # [s, b, kv/tp * (q_per_kv+2) * h]
        s, b = qkv.shape[:2]
        qkv = qkv.reshape(s, b, -1, self.q_per_kv + 2, self.head_dim)
        # Query head g*q_per_kv + j uses kv head g: the order GQA in
        # dot_product_attention expects.
        q = rope(qkv[:, :, :, :-2].reshape(s, b, -1, self.head_dim), self.rope_theta)
        k = rope(qkv[:, :, :, -2], self.rope_theta)
        v = qkv[:, :, :, -1]
        # dot_product_attention (cuDNN too) takes [b, s, heads, h]; with b = 1
        # per device the swaps are bitcasts, else one copy of q, k, v and out.
        out = jax.nn.dot_product_attention(*(t.swapaxes(0, 1) for t in (q, k, v)),
                                           is_causal=True, implementation=self.implementation)
        return self.out(out.swapaxes(0, 1).reshape(s, b, -1))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))`` over this rank's hidden units."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, f = config.embed_dim, config.mlp_dim
        self.gate_up = ColumnParallelLinear(d, 2 * f, **linear_options(config, rngs))
        self.down = RowParallelLinear(f, d, **linear_options(config, rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [s/tp, b, d] (or [s, b, d] without SP) -> the same."""
        h = self.gate_up(x)                                 # [s, b, 2 * f/tp]
        h = h.reshape(*h.shape[:-1], -1, 2)
        return self.down(jax.nn.silu(h[..., 0]) * h[..., 1])


class Block(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(CausalLM):
    """The decoder LM: ``Transformer(config, rngs=...)(tokens [b, s]) -> logits [b, s, v]``.

    Create and call it under ``jax.set_mesh(mesh)`` with a (data, tensor)
    mesh; see :class:`models.layers.CausalLM`.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        config = resolve_scan_layers(config, attention_implementation(config))
        super().__init__(config, lambda rngs: Block(config, rngs=rngs), rngs=rngs)
