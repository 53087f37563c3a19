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
import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_flashoverlap.nn import ColumnParallelLinear, RowParallelLinear, shard_map_apply

from . import decode_attention_pallas, transformer_decode_cuda
from .config import TransformerConfig
from .layers import CausalLM, KVCache, RMSNorm, linear_options, rope
from .pallas_gpu import on_cuda

__all__ = ["Transformer", "Block", "Attention", "MLP", "KVCache", "rope",
           "attention_implementation", "cudnn_attention_unsupported",
           "decode_attention_implementation", "decode_blocks_implementation",
           "resolve_scan_layers"]


def _capability(compute_capability: str | None) -> tuple[int, ...]:
    """A CUDA compute capability ("9.0") as a comparable tuple; (0, 0) for None."""
    return tuple(int(v) for v in (compute_capability or "0.0").split("."))


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
    capability = _capability(compute_capability)
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


def decode_attention_implementation(config: TransformerConfig, batch: int | None = None,
                                    device: jax.Device | None = None) -> str:
    """``config.decode_attention`` for a decode step of ``batch`` rows per
    device, on ``device`` (default the first): "pallas" or "model".

    "auto" is "pallas" on CUDA GPUs where the kernel takes the heads
    (:func:`models.decode_attention_pallas.unsupported_reason`) and ``batch``
    is at most :data:`models.decode_attention_pallas.AUTO_MAX_BATCH`, else
    "model"; ``batch`` None asks whether any batch would run the kernel.

    Raises:
      ValueError: "pallas" asked for heads the kernel cannot take.
    """
    if config.decode_attention == "model":
        return "model"
    why_not = decode_attention_pallas.unsupported_reason(
        config.num_heads // config.num_kv_heads, config.head_dim)
    if config.decode_attention == "auto":
        small = batch is None or batch <= decode_attention_pallas.AUTO_MAX_BATCH
        return "pallas" if on_cuda(device) and not why_not and small else "model"
    if why_not:
        raise ValueError(f"TransformerConfig: decode_attention='pallas' but {why_not}; use "
                         f"decode_attention='model' or 'auto'.")
    return "pallas"


def decode_blocks_implementation(config: TransformerConfig, *, batch: int, tensor_size: int,
                                 weight_bytes: int = 0,
                                 device: jax.Device | None = None) -> str:
    """``config.decode_blocks`` for a decode step of ``batch`` rows per
    device at tensor-parallel size ``tensor_size``, on ``device`` (default
    the first): "cuda" or "layers".

    "auto" is "cuda" where the kernel runs the step
    (:func:`models.transformer_decode_cuda.unsupported_reason`) on a CUDA GPU
    of compute capability 9.0 or later, at tensor-parallel size 1 (its
    tensor-parallel form is experimental), ``batch`` is at most
    :data:`models.transformer_decode_cuda.AUTO_MAX_BATCH`, and the kernel's
    copy of the blocks' weights (``weight_bytes``) takes at most half the
    device's free memory; else "layers".

    Raises:
      ValueError: "cuda" where the kernel cannot run the step, naming why.
    """
    if config.decode_blocks == "layers":
        return "layers"
    why_not = transformer_decode_cuda.unsupported_reason(config, tensor_size=tensor_size,
                                                         batch=batch)
    if config.decode_blocks == "auto":
        device = device or jax.devices()[0]
        capability = _capability(getattr(device, "compute_capability", None))
        runs = (not why_not and tensor_size == 1
                and batch <= transformer_decode_cuda.AUTO_MAX_BATCH
                and on_cuda(device) and capability >= (9, 0)
                and weight_bytes <= _free_bytes(device) // 2)
        return "cuda" if runs else "layers"
    if why_not:
        raise ValueError(f"TransformerConfig(decode_blocks='cuda'): the decode kernel cannot "
                         f"run this step: {why_not}. Use decode_blocks='layers' or 'auto'.")
    return "cuda"


def _free_bytes(device: jax.Device) -> float:
    """Bytes ``device`` can still allocate (its allocator's limit less what
    is in use; unbounded where it keeps no statistics)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return math.inf
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


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


class Attention(nnx.Module):
    """Causal grouped-query self-attention over this rank's heads."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, h, kv = config.embed_dim, config.head_dim, config.num_kv_heads
        self.q_per_kv = config.num_heads // kv
        self.head_dim = h
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.implementation = attention_implementation(config)
        # Checked here, so that a "pallas" the heads rule out fails at construction.
        decode_attention_implementation(config)
        self.decode_config = config
        self.qkv = ColumnParallelLinear(d, kv * (self.q_per_kv + 2) * h,
                                        **linear_options(config, rngs))
        self.out = RowParallelLinear(config.num_heads * h, d, **linear_options(config, rngs))

    def decode_implementation(self, batch: int) -> str:
        """The decode attention a step of ``batch`` rows per device runs:
        "pallas" or "model" (see :func:`decode_attention_implementation`)."""
        return decode_attention_implementation(self.decode_config, batch)

    def _heads(self, qkv: jax.Array, positions: jax.Array | None = None):
        """[s, b, kv * (q_per_kv+2) * h] -> q [s, b, heads, h], k and v [s, b, kv, h].

        Query head g*q_per_kv + j uses kv head g: the order GQA in
        dot_product_attention expects. Rotary embeddings are applied to q, k.
        """
        s, b = qkv.shape[:2]
        qkv = qkv.reshape(s, b, -1, self.q_per_kv + 2, self.head_dim)
        q = rope(qkv[:, :, :, :-2].reshape(s, b, -1, self.head_dim), self.rope_theta, positions,
                 self.rope_scaling)
        k = rope(qkv[:, :, :, -2], self.rope_theta, positions, self.rope_scaling)
        return q, k, qkv[:, :, :, -1]

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [s/tp, b, d] (or [s, b, d] without SP) -> the same."""
        return self._attend(x)[0]

    def _attend(self, x: jax.Array):
        """(output, (k, v)): the keys and values [s, b, kv, h] of the whole sequence."""
        q, k, v = self._heads(self.qkv(x))                  # the whole sequence
        s, b = q.shape[:2]
        # dot_product_attention (cuDNN too) takes [b, s, heads, h]; with b = 1
        # per device the swaps are bitcasts, else one copy of q, k, v and out.
        out = jax.nn.dot_product_attention(*(t.swapaxes(0, 1) for t in (q, k, v)),
                                           is_causal=True, implementation=self.implementation)
        return self.out(out.swapaxes(0, 1).reshape(s, b, -1)), (k, v)

    def prefill(self, x: jax.Array, cache_len: int) -> tuple[jax.Array, KVCache]:
        """The forward over a prompt, keeping its keys and values.

        Args:
          x: as in ``__call__``; the prompt is the whole sequence s.
          cache_len: L >= s, the positions the cache holds.

        Returns:
          (output as ``__call__``'s, the cache with positions 0..s-1 filled).
        """
        out, (k, v) = self._attend(x)
        pad = ((0, 0), (0, 0), (0, cache_len - k.shape[0]), (0, 0))
        return out, KVCache(*(jnp.pad(t.transpose(1, 2, 0, 3), pad) for t in (k, v)))

    def decode(self, x: jax.Array, cache: KVCache,
               pos: jax.Array) -> tuple[jax.Array, KVCache]:
        """One token: attends over the cache up to and including ``pos``.

        Args:
          x: [1, b, d], the same on every tensor rank.
          cache: this layer's; positions before ``pos`` filled.
          pos: int32 scalar, this token's position.

        Returns:
          ([1, b, d] identical on every tensor rank, the cache with ``pos``
          filled, in place when the caller donates it).
        """
        q, k, v = self._heads(self.qkv.decode(x), pos[None])
        b = cache.k.shape[0]
        q = q.swapaxes(0, 1)                                # [b, 1, heads, h]
        k, v = (t.transpose(1, 2, 0, 3).astype(cache.k.dtype) for t in (k, v))  # [b, kv, 1, h]
        if self.decode_implementation(b) == "pallas":
            grouped = q[:, 0].reshape(b, k.shape[1], self.q_per_kv, self.head_dim)
            out, *updated = decode_attention_pallas.decode_attention(grouped, k, v, *cache, pos)
            out, cache = out.reshape(q.shape), KVCache(*updated)
        elif self.implementation == "cudnn":
            cache = KVCache(*(jax.lax.dynamic_update_slice(c, t, (0, 0, pos, 0))
                              for c, t in ((cache.k, k), (cache.v, v))))
            out = jax.nn.dot_product_attention(
                q, cache.k.swapaxes(1, 2), cache.v.swapaxes(1, 2), implementation="cudnn",
                key_value_seq_lengths=jnp.full((b,), pos + 1, jnp.int32))
        else:
            out, cache = _decode_attention(q, k, v, cache, pos)
        return self.out.decode(out.swapaxes(0, 1).reshape(1, b, -1)), cache


def _decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                      pos: jax.Array) -> tuple[jax.Array, KVCache]:
    """XLA's decode attention of one new position.

    Args:
      q: [b, 1, heads, h]; k, v: [b, kv, 1, h], this position's.
      cache: [b, kv, L, h] each, positions before ``pos`` filled.
      pos: int32 scalar.

    Returns:
      (out [b, 1, heads, h] in q's dtype, the cache with ``pos`` written).
    """
    b, kv, length, h = cache.k.shape
    q = q[:, 0].reshape(b, kv, -1, h)                       # [b, kv, q_per_kv, h]
    # The earlier positions from the cache, this one from k and v: the cache
    # update then has no reader in this step, and the barrier orders the
    # reads before it, so XLA writes it in place instead of copying the
    # cache to keep the old one.
    scores = jnp.concatenate([
        jnp.where(jnp.arange(length) < pos,
                  jnp.einsum("bgqh,bglh->bgql", q, cache.k,
                             preferred_element_type=jnp.float32), -jnp.inf),
        jnp.einsum("bgqh,bglh->bgql", q, k, preferred_element_type=jnp.float32)],
        axis=-1) / math.sqrt(h)
    probs = jax.nn.softmax(scores, axis=-1).astype(cache.v.dtype)
    out = (jnp.einsum("bgql,bglh->bgqh", probs[..., :length], cache.v,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bgql,bglh->bgqh", probs[..., length:], v,
                        preferred_element_type=jnp.float32))
    out, cache = jax.lax.optimization_barrier((out, cache))
    cache = KVCache(*(jax.lax.dynamic_update_slice(c, t, (0, 0, pos, 0))
                      for c, t in ((cache.k, k), (cache.v, v))))
    return out.reshape(b, 1, -1, h).astype(q.dtype), cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))`` over this rank's hidden units."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, f = config.embed_dim, config.mlp_dim
        self.gate_up = ColumnParallelLinear(d, 2 * f, **linear_options(config, rngs))
        self.down = RowParallelLinear(f, d, **linear_options(config, rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [s/tp, b, d] (or [s, b, d] without SP) -> the same."""
        return self.down(_swiglu(self.gate_up(x)))

    def decode(self, x: jax.Array) -> jax.Array:
        """x: [1, b, d], the same on every tensor rank -> the same."""
        return self.down.decode(_swiglu(self.gate_up.decode(x)))


def _swiglu(h: jax.Array) -> jax.Array:
    """[..., 2 * f] with gate and up interleaved per unit -> [..., f]."""
    h = h.reshape(*h.shape[:-1], -1, 2)
    return jax.nn.silu(h[..., 0]) * h[..., 1]


class Block(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._residual(x, lambda y: (self.attn(y), None), self.mlp)[0]

    def prefill(self, x: jax.Array, *, length: int, cache_len: int) -> tuple[jax.Array, KVCache]:
        """``__call__`` over a prompt, and this layer's cache (see :meth:`Attention.prefill`).

        Positions from ``length`` on are padding; causal attention keeps them
        out of the real positions, and decoding overwrites them.
        """
        del length
        return self._residual(x, lambda y: self.attn.prefill(y, cache_len), self.mlp)

    def decode(self, x: jax.Array, cache: KVCache, pos: jax.Array) -> tuple[jax.Array, KVCache]:
        """One token, x: [1, b, d] (see :meth:`Attention.decode`)."""
        return self._residual(x, lambda y: self.attn.decode(y, cache, pos), self.mlp.decode)

    def _residual(self, x, attend, mlp):
        h, cache = attend(self.attn_norm(x))
        x = x + h
        return x + mlp(self.mlp_norm(x)), cache


class Transformer(CausalLM):
    """The decoder LM: ``Transformer(config, rngs=...)(tokens [b, s]) -> logits [b, s, v]``.

    Create and call it under ``jax.set_mesh(mesh)`` with a (data, tensor)
    mesh; see :class:`models.layers.CausalLM`.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        config = resolve_scan_layers(config, attention_implementation(config))
        super().__init__(config, lambda rngs: Block(config, rngs=rngs), rngs=rngs)

    def decode_weights(self, *, batch: int, tensor_size: int):
        """Where the blocks decode in one kernel (:func:`decode_blocks_implementation`
        says "cuda"), their weights in its layout
        (:func:`models.transformer_decode_cuda.prepare_weights`); else None.

        Raises:
          ValueError: ``decode_blocks="cuda"`` where the kernel cannot run, naming why.
        """
        if self.decode_blocks_implementation(batch=batch, tensor_size=tensor_size) == "layers":
            return None
        # Each rank lays out its own shards (transformer_decode_cuda.weight_specs).
        return shard_map_apply(
            lambda model: transformer_decode_cuda.prepare_weights(model.blocks, model.config),
            self, in_specs=(), out_specs=self.decode_weights_specs())

    def decode_weights_specs(self):
        """:meth:`decode_weights`' ``PartitionSpec`` s (global view)."""
        return transformer_decode_cuda.weight_specs(self.config)

    def decode_blocks_implementation(self, *, batch: int, tensor_size: int) -> str:
        """How a decode step of ``batch`` rows per device runs the blocks:
        "cuda" or "layers" (:func:`decode_blocks_implementation`, the
        kernel's copy of the blocks' weights as large as a rank's share of theirs)."""
        weight_bytes = sum(leaf.size * leaf.dtype.itemsize
                           for leaf in jax.tree.leaves(nnx.state(self.blocks, nnx.Param)))
        weight_bytes //= tensor_size
        return decode_blocks_implementation(self.config, batch=batch, tensor_size=tensor_size,
                                            weight_bytes=weight_bytes)

    def _decode_layers_with(self, weights, x, caches, pos):
        y, caches = transformer_decode_cuda.decode_blocks(x[0], pos, weights, caches, self.config)
        return y[None], caches

    def layer_cache_spec(self) -> KVCache:
        """The ``PartitionSpec`` of each of a layer's cache arrays (global view)."""
        sharding = self.config.sharding
        spec = P(sharding.data, sharding.tensor, None, None)
        return KVCache(spec, spec)
