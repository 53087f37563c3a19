"""One decode step's attention as a Pallas (Triton) GPU kernel, with the cache update.

A decode step attends one new position over a layer's KV cache. Through
cuDNN (or XLA's einsums) that is four kernels a layer: two cache updates and
cuDNN's two, each a few microseconds while the cache read itself takes well
under one at batch 1 and context 512. Here one kernel does it all: each
program takes one (batch row, KV head, split of the cache) and its
``q_per_kv`` query heads, starts its online softmax from the new position's
own key and value (split 0 only), streams the cache's earlier positions of
its split in blocks, and split 0 writes the new key and value into the cache
in place. With several splits, XLA combines the splits' partial results.

Positions at and after the new one are never read, so the write cannot race
a read; the kernel's loads are masked to the positions before it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_flashoverlap.nn import same_variance

from .pallas_gpu import plgpu, require_runnable

__all__ = ["AUTO_MAX_BATCH", "MIN_SPLIT_POSITIONS", "PACKED_INPUTS", "Tiling",
           "decode_attention", "unsupported_reason"]

# Cache positions a program reads per loop iteration.
_BLOCK = 64
# The fewest cache positions a split covers by default: below that, another
# split costs more (a program, the combine) than it saves. Read where the
# kernel is traced. The 1B Transformer's decode step on one H200 at batch 1,
# context 512, one process: 64 positions 0.883 ms [0.878, 0.890], 128 0.896
# [0.876, 0.899], 256 0.918 [0.914, 0.925] (benchmarks/decode.py
# --split-positions). 64 and 128 overlap: 128 stays.
MIN_SPLIT_POSITIONS = 128
# The largest batch per device at which decode_attention="auto" runs this
# kernel: at batch 1 it measured 1.077x cuDNN's step, at 8 0.994x and at 32
# 0.967x (same run), where cuDNN's programs fill the GPU and these do not win.
AUTO_MAX_BATCH = 1
# Programs the default splitting aims for: about one per SM of an H100/H200.
_TARGET_PROGRAMS = 128
_NUM_WARPS = 4
_NUM_STAGES = 2
# Query rows a program multiplies: the tensor cores' smallest tile side. The
# q_per_kv query heads of a KV head are padded with zero rows up to it.
_ROWS = 16
# Whether the kernel takes q, k and v as one array [b, kv, rows, h] (the
# query rows, then the key, the value and zero rows; rows a power of two
# from _ROWS) instead of q padded to _ROWS rows, k and v apart. XLA wrote
# each of the three in a kernel of its own (with the rotary embeddings):
# one array can be one such kernel. Its
# rows past the queries are attended too and dropped. Read where the kernel
# is traced. On: the 1B model's step at batch 1 ran 1.023-1.042x faster
# than with the inputs apart, at contexts 512 and 2048, with two XLA
# kernels a layer fewer.
PACKED_INPUTS = True
# A finite "minus infinity": exp(_NEG - _NEG) is 1, not NaN, for a split
# that reads nothing, and masked scores are dropped by a select, not by it.
_NEG = -1e30


class Tiling(NamedTuple):
    """``splits`` programs per (batch row, KV head), each reading up to
    ``split_len`` cache positions in blocks of ``block``; ``interpret`` runs
    the kernel in Pallas's interpreter."""

    block: int
    splits: int
    split_len: int
    num_warps: int
    interpret: bool = False


def unsupported_reason(q_per_kv: int, head_dim: int) -> str | None:
    """Why the kernel cannot run these heads, or None when it can."""
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    if q_per_kv > _ROWS:
        return f"query heads per KV head ({q_per_kv}) are more than {_ROWS}"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim={head_dim} is not a power of two from 16"
    return None


def _tiling(batch: int, kv_heads: int, length: int, splits: int | None,
            interpret: bool) -> Tiling:
    """The Tiling of ``splits`` (None: the default) over a cache of ``length``."""
    if splits is None:
        splits = max(1, min(-(-length // MIN_SPLIT_POSITIONS),
                            -(-_TARGET_PROGRAMS // (batch * kv_heads))))
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"decode_attention: splits={splits!r} must be a positive int")
    split_len = -(-length // splits)
    split_len = -(-split_len // _BLOCK) * _BLOCK
    return Tiling(_BLOCK, splits, split_len, _NUM_WARPS, interpret)


def _packed_kernel(pos_ref, heads_ref, k_ref, v_ref, *out_refs, q_per_kv: int, **kwargs):
    """:func:`_kernel` with its inputs in one block (see :data:`PACKED_INPUTS`)."""
    _kernel(pos_ref, heads_ref, heads_ref.at[pl.ds(q_per_kv, 1), :],
            heads_ref.at[pl.ds(q_per_kv + 1, 1), :], k_ref, v_ref, *out_refs, **kwargs)


def _kernel(pos_ref, q_ref, k_new_ref, v_new_ref, k_ref, v_ref, *out_refs, tiling: Tiling,
            scale: float, precision):
    *result_refs, k_out_ref, v_out_ref = out_refs
    split = pl.program_id(2)
    pos = pos_ref[()]
    q = q_ref[...]                                         # [rows, h], the query rows first
    # The online softmax's running max score, sum of weights and weighted sum
    # of values per query row. The new position opens split 0's: its score,
    # weight 1, its value. (Triton selects need the condition in the
    # operands' shape.)
    first = split == 0
    score = jnp.sum(q.astype(jnp.float32) * k_new_ref[...].astype(jnp.float32), axis=1) * scale
    peak = jnp.where(jnp.broadcast_to(first, score.shape), score, _NEG)
    mass = jnp.where(jnp.broadcast_to(first, score.shape), 1.0, 0.0)
    acc = jnp.where(jnp.broadcast_to(first, q.shape),
                    v_new_ref[...].astype(jnp.float32) + jnp.zeros(q.shape, jnp.float32), 0.0)

    start = split * tiling.split_len
    end = jnp.minimum(start + tiling.split_len, pos)       # this split's positions < pos
    blocks = jnp.maximum(end - start + tiling.block - 1, 0) // tiling.block

    def body(i, carry):
        peak, mass, acc = carry
        first_row = start + i * tiling.block
        valid = first_row + jnp.arange(tiling.block) < end                 # [block]
        rows = pl.ds(first_row, tiling.block)
        k = plgpu.load(k_ref.at[rows, :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[rows, :], mask=valid[:, None], other=0.0)
        scores = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [rows, block]
        scores = jnp.where(valid[None, :], scores, _NEG)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=1))
        correction = jnp.exp(peak - new_peak)
        p = jnp.where(valid[None, :], jnp.exp(scores - new_peak[:, None]), 0.0)
        mass = mass * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return new_peak, mass, acc

    peak, mass, acc = jax.lax.fori_loop(0, blocks, body, (peak, mass, acc))
    if tiling.splits == 1:
        (out_ref,) = result_refs
        out_ref[...] = (acc / mass[:, None]).astype(out_ref.dtype)
    else:
        acc_ref, peak_ref, mass_ref = result_refs
        acc_ref[...] = acc
        peak_ref[...] = peak
        mass_ref[...] = mass

    @pl.when(first)
    def _():
        at_pos = pl.ds(pos, 1)
        plgpu.store(k_out_ref.at[at_pos, :], k_new_ref[...].astype(k_out_ref.dtype))
        plgpu.store(v_out_ref.at[at_pos, :], v_new_ref[...].astype(v_out_ref.dtype))


def _combine(acc, peak, mass, dtype):
    """The splits' partial softmaxes -> the attention output [b, kv, rows,
    h]: ``acc`` [b, kv, splits, rows, h] unnormalised, ``peak`` and ``mass``
    [b, kv, splits, rows] their max scores and sums of weights."""
    weight = jnp.exp(peak - jnp.max(peak, axis=2, keepdims=True))
    total = jnp.sum(weight * mass, axis=2)
    return (jnp.sum(weight[..., None] * acc, axis=2) / total[..., None]).astype(dtype)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                     cache_v: jax.Array, pos: jax.Array, *, splits: int | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of one new position over the cache, writing its key and value there.

    Args:
      q: [b, kv, q_per_kv, h], the new position's query heads, grouped by
        their KV head (rotary embeddings applied); q_per_kv at most 16, h a
        power of two from 16.
      k, v: [b, kv, 1, h], its key (rotated) and value.
      cache_k, cache_v: [b, kv, L, h], positions before ``pos`` filled; L > pos.
      pos: int32 scalar, the new position.
      splits: programs per (batch row, KV head) along the cache; default:
        enough for about 128 programs, each reading at least
        :data:`MIN_SPLIT_POSITIONS` positions.
      interpret: run the kernel in Pallas's interpreter (any backend; for tests).

    Returns:
      (out [b, kv, q_per_kv, h] in q's dtype, softmax(q·kᵀ/√h)·v over
      positions 0..pos; cache_k and cache_v with ``pos`` written, in place
      where the caller donates them).
    """
    b, kv, q_per_kv, h = q.shape
    if k.shape != (b, kv, 1, h) or v.shape != k.shape:
        raise ValueError(f"decode_attention: k {k.shape} and v {v.shape} must be "
                         f"{(b, kv, 1, h)} for q {q.shape}")
    if cache_k.shape[:2] + cache_k.shape[3:] != (b, kv, h) or cache_v.shape != cache_k.shape:
        raise ValueError(f"decode_attention: caches {cache_k.shape} and {cache_v.shape} must "
                         f"be [{b}, {kv}, L, {h}] for q {q.shape}")
    require_runnable("decode_attention_pallas.decode_attention",
                     unsupported_reason(q_per_kv, h), interpret,
                     "use decode_attention='model'")
    length = cache_k.shape[2]
    tiling = _tiling(b, kv, length, splits, interpret)
    packed = PACKED_INPUTS
    if packed:
        rows = max(_ROWS, 1 << (q_per_kv + 1).bit_length())     # a power of two > q_per_kv + 1
        fill = jnp.zeros((b, kv, rows - q_per_kv - 2, h), q.dtype)
        inputs = (jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype), fill], axis=2),)
    else:
        # Zero query rows up to the tensor cores' tile: XLA fuses the pad into
        # q's producer and the slice below into the output's consumer.
        rows = _ROWS
        inputs = (jnp.pad(q, ((0, 0), (0, 0), (0, rows - q_per_kv), (0, 0))), k, v)
    (*inputs, cache_k, cache_v, pos), varying = same_variance(
        *inputs, cache_k, cache_v, jnp.asarray(pos, jnp.int32))

    def per_head(*shape):  # (b, kv) picked by the grid, the rest whole
        return pl.BlockSpec((None, None, *shape), lambda i, g, s: (i, g) + (0,) * len(shape))

    def per_split(*shape):
        return pl.BlockSpec((None, None, None, *shape),
                            lambda i, g, s: (i, g, s) + (0,) * len(shape))

    def out(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=varying)

    if tiling.splits == 1:
        result_specs, result_shapes = [per_head(rows, h)], [out((b, kv, rows, h), q.dtype)]
    else:
        partial = (b, kv, tiling.splits, rows)
        result_specs = [per_split(rows, h), per_split(rows), per_split(rows)]
        result_shapes = [out((*partial, h), jnp.float32), out(partial, jnp.float32),
                         out(partial, jnp.float32)]
    cache_spec = per_head(length, h)
    precision = lax.Precision.HIGHEST if jnp.dtype(q.dtype) == jnp.float32 else None
    kernel = (functools.partial(_packed_kernel, q_per_kv=q_per_kv) if packed else _kernel)
    input_specs = [per_head(rows, h)] if packed else [per_head(rows, h), per_head(1, h),
                                                      per_head(1, h)]
    first_cache = 1 + len(inputs)                          # after pos and the inputs
    *results, cache_k, cache_v = pl.pallas_call(
        functools.partial(kernel, tiling=tiling, scale=1.0 / math.sqrt(h),
                          precision=precision),
        grid=(b, kv, tiling.splits),
        in_specs=[pl.BlockSpec((), lambda i, g, s: ()), *input_specs, cache_spec, cache_spec],
        out_specs=[*result_specs, cache_spec, cache_spec],
        out_shape=[*result_shapes, out(cache_k.shape, cache_k.dtype),
                   out(cache_v.shape, cache_v.dtype)],
        input_output_aliases={first_cache: len(result_shapes),
                              first_cache + 1: len(result_shapes) + 1},
        interpret=tiling.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=_NUM_STAGES),
        name="decode_attention",
    )(pos, *inputs, cache_k, cache_v)
    attended = results[0] if tiling.splits == 1 else _combine(*results, q.dtype)
    return attended[:, :, :q_per_kv], cache_k, cache_v
