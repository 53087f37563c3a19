"""The blocks' weights in the one-kernel decode step's layout
(:class:`DecodeWeights`, :func:`prepare_weights`) and how they are sharded
over the tensor axis (:func:`weight_specs`); the kernel itself:
:mod:`.transformer_decode_cuda`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .config import TransformerConfig

__all__ = ["DecodeWeights", "prepare_weights", "weight_specs", "QKV_COLUMNS", "OUT_COLUMNS",
           "GATE_UP_COLUMNS", "DOWN_COLUMNS", "item_order", "items_product"]

# Columns of a work item per weight (ffi/src/transformer_decode.cu).
QKV_COLUMNS = 32      # 16 rotary pairs: 16 columns of a head's first half, then its second
OUT_COLUMNS = 16
GATE_UP_COLUMNS = 64  # 32 hidden units, gate and up interleaved as in the model
DOWN_COLUMNS = 16


class DecodeWeights(NamedTuple):
    """The blocks' weights in the kernel's layout, stacked over the L layers.

    Each matrix is [L, items, k, columns]: work item i holds ``columns``
    columns of the model's [k, n] weight, contiguous, as 16x16 tiles in the
    order of the tensor cores' operand fragments (the kernel's
    ``ItemProduct``). d is the model width, f the MLP width, h the head
    dim, H and KV the heads.

    Attributes:
      attn_norm, mlp_norm: float32 [L, d], the norms' weights.
      qkv: bf16 [L, KV * (H/KV + 2) * h / 32, d, 32]. Items run over (KV head,
        role: its query heads then k then v, pair block); an item's columns
        are channels j0..j0+15 of the head's first half, then j0 + h/2 ...
      out: bf16 [L, d / 16, H * h, 16].
      gate_up: bf16 [L, 2 f / 64, d, 64].
      down: bf16 [L, d / 16, f, 16].
    """

    attn_norm: jax.Array
    mlp_norm: jax.Array
    qkv: jax.Array
    out: jax.Array
    gate_up: jax.Array
    down: jax.Array


def weight_specs(config: TransformerConfig) -> DecodeWeights:
    """Each of :func:`prepare_weights`' arrays' ``PartitionSpec`` (global
    view): QKV's and gate/up's items and out's and down's rows split over the
    tensor axis, as the blocks' own column- and row-parallel weights are, so
    that each rank's shard is :func:`prepare_weights` of its own blocks."""
    t = config.sharding.tensor
    return DecodeWeights(attn_norm=P(), mlp_norm=P(), qkv=P(None, t), out=P(None, None, t),
                         gate_up=P(None, t), down=P(None, None, t))


def _whole(a: jax.Array) -> jax.Array:
    """``a`` typed as whole on every device (at tensor size 1 it already is,
    but an explicit mesh axis still names it in the type)."""
    if any(entry is not None for entry in jax.typeof(a).sharding.spec):
        return jax.sharding.reshard(a, P())
    return a


def _qkv_items(w: jax.Array, roles: int, h: int) -> jax.Array:
    """[d, kv * roles * h] (per KV head: its query heads, k, v) -> [items, d, 32]."""
    d = w.shape[0]
    pairs = QKV_COLUMNS // 2
    w = w.reshape(d, -1, roles, 2, h // 2 // pairs, pairs)  # [d, kv, r, half, block, 16]
    return w.transpose(1, 2, 4, 0, 3, 5).reshape(-1, d, QKV_COLUMNS)


def _column_items(w: jax.Array, columns: int) -> jax.Array:
    """[k, n] -> [n / columns, k, columns]."""
    return w.reshape(w.shape[0], -1, columns).transpose(1, 0, 2)


# An item's [k, c] as 16x16 tiles (k-tile major), each in the order of
# mma.m16n8k16's A fragment for the tile transposed: lane (g, t) holds
# columns g, g + 8 at k 2t, 2t + 1, 2t + 8, 2t + 9. The tile's k splits as
# (half, t, pair), its columns as (half, g); the lane's 8 values run over
# (k half, column half, pair).
_TO_FRAGMENTS = (0, 4, 6, 2, 1, 5, 3)      # [kt, kh, t, p, ct, mh, g] -> [kt, ct, g, t, kh, mh, p]
_FROM_FRAGMENTS = tuple(int(a) for a in np.argsort(_TO_FRAGMENTS))   # its inverse


def _tile_split(k: int, c: int) -> tuple[int, ...]:
    """An item's [k, c] as [kt, kh, t, p, ct, mh, g]."""
    return (k // 16, 2, 4, 2, c // 16, 2, 8)


def _fragment_order(items: jax.Array) -> jax.Array:
    """[items, k, c] -> the same shape, each item in 16x16 MMA tiles."""
    n, k, c = items.shape
    tiles = items.reshape(n, *_tile_split(k, c))
    return tiles.transpose(0, *(1 + a for a in _TO_FRAGMENTS)).reshape(n, k, c)


def item_order(items: jax.Array) -> jax.Array:
    """The inverse of :func:`_fragment_order`."""
    n, k, c = items.shape
    split = _tile_split(k, c)
    tiles = items.reshape(n, *(split[a] for a in _TO_FRAGMENTS))
    return tiles.transpose(0, *(1 + a for a in _FROM_FRAGMENTS)).reshape(n, k, c)


def items_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """[b, k] times each item [items, k, c] (in MMA tiles) -> [b, items * c]
    in x's dtype, summed in float32: a decode kernel's GEMV, as its JAX
    references compute it."""
    y = jnp.einsum("bk,ikc->bic", x, item_order(w), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(x.shape[0], -1)


def prepare_weights(blocks, config: TransformerConfig) -> DecodeWeights:
    """The blocks' weights in the kernel's layout (jit it: a copy of each).

    Whole, or per device inside ``shard_map`` at any tensor-parallel size:
    a rank's shard of the whole layout (:func:`weight_specs`) is this
    function of its own shards of the blocks' weights.

    Args:
      blocks: the model's :class:`~models.transformer.Block` s, their
        matrices in the compute dtype (as ``decoding_params`` casts them).
      config: the model's.
    """
    dtype = jnp.dtype(config.dtype)

    def stack(fn):
        return jnp.stack([fn(block) for block in blocks])

    def matrix(param):
        return _whole(param[...]).astype(dtype)

    roles, h = config.num_heads // config.num_kv_heads + 2, config.head_dim
    return DecodeWeights(
        attn_norm=stack(lambda b: _whole(b.attn_norm.weight[...]).astype(jnp.float32)),
        mlp_norm=stack(lambda b: _whole(b.mlp_norm.weight[...]).astype(jnp.float32)),
        qkv=stack(lambda b: _fragment_order(_qkv_items(matrix(b.attn.qkv.kernel), roles, h))),
        out=stack(lambda b: _fragment_order(
            _column_items(matrix(b.attn.out.kernel), OUT_COLUMNS))),
        gate_up=stack(lambda b: _fragment_order(
            _column_items(matrix(b.mlp.gate_up.kernel), GATE_UP_COLUMNS))),
        down=stack(lambda b: _fragment_order(
            _column_items(matrix(b.mlp.down.kernel), DOWN_COLUMNS))))
