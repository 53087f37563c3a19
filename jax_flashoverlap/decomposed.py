"""Pure-JAX FlashOverlap: the schedules of :mod:`.schedule` run with ``ppermute``.

This is ``impl="decomposed"``: it runs on every backend, serves as the CPU path
and as the oracle the CUDA kernels are tested against. Every function here
must be called inside ``jax.shard_map`` with ``axis_name`` bound, and works on
2-D operands (the public ops flatten batch dimensions).

The schedules are rank-symmetric: what rank ``r`` does at a step is what rank 0
does, shifted by ``r``. A buffer is therefore tracked by its block *offset*
``(block - r) % n``, which is static, while the block index itself is traced.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import schedule as sched_lib

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "all_reduce",
]

# compute(step, offset, part, received) -> the value that step sends on.
_ComputeFn = Callable[[int, int, int, list[jax.Array]], jax.Array]


def _split_rows(a: jax.Array, parts: int) -> list[jax.Array]:
    """Cuts ``a`` [rows, ...] into ``parts`` row ranges (the first the larger)."""
    if parts == 1:
        return [a]
    half = (a.shape[0] + 1) // 2
    return [a[:half], a[half:]]


def _ring_perm(n: int, shift: int) -> list[tuple[int, int]]:
    return [(i, (i + shift) % n) for i in range(n)]


def _run(sched: sched_lib.CollectiveMatmulSchedule, axis_name,
         initial: dict[tuple[int, int], jax.Array], compute: _ComputeFn) -> None:
    """Executes ``sched`` for this rank: computes, then ships each step's data."""
    n = sched.n
    held: dict[tuple[int, int], list[jax.Array]] = collections.defaultdict(list)
    for key, value in initial.items():
        held[key].append(value)
    for t, step in enumerate(sched.steps):
        sent: dict[tuple[int, int], jax.Array] = {}
        for work in step.compute[0]:
            key = (work.block % n, work.part)
            sent[key] = compute(t, key[0], work.part, held.pop(key, []))
        for tr in step.transfers:
            if tr.src != 0:
                continue  # rank symmetry: rank 0's transfers describe everyone's.
            shift = (tr.dst - tr.src) % n
            offset = tr.block % n
            # Every schedule ships data in the step that computed on it.
            data = sent[(offset, tr.part)]
            received = lax.ppermute(data, axis_name, _ring_perm(n, shift))
            held[((offset - shift) % n, tr.part)].append(received)


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name, *,
                      topology: sched_lib.Topology = "ring") -> tuple[jax.Array, jax.Array]:
    """AllGather→GEMM with the local shard first and no communication tail.

    Args:
      x: [m, k], this rank's rows.
      w: [k, n_out].
      axis_name: the mesh axis of ``n`` ranks that ``x`` is sharded over.
      topology: schedule topology (see :mod:`.schedule`).

    Returns:
      ``(y, x_gathered)``: y [n*m, n_out] = all_gather(x) @ w and
      x_gathered [n*m, k].
    """
    n = lax.axis_size(axis_name)
    sched = sched_lib.all_gather_schedule(n, topology)
    r = lax.axis_index(axis_name)
    m = x.shape[0]
    out_parts = [[None] * n for _ in range(sched.parts)]
    x_parts = [[None] * n for _ in range(sched.parts)]

    def compute(t, offset, part, received):
        shard = x_split[part] if offset == 0 else received[0]
        out_parts[part][offset] = jnp.dot(shard, w, preferred_element_type=x.dtype)
        x_parts[part][offset] = shard
        return shard

    x_split = _split_rows(x, sched.parts)
    _run(sched, axis_name, {}, compute)
    y = _assemble_by_offset([jnp.concatenate(blk, axis=0) for blk in zip(*out_parts)], r, n)
    xg = _assemble_by_offset([jnp.concatenate(blk, axis=0) for blk in zip(*x_parts)], r, n)
    return y.reshape(n * m, -1), xg.reshape(n * m, -1)


def _assemble_by_offset(blocks: list[jax.Array], r, n: int) -> jax.Array:
    """Stacks blocks held by offset into block order: out[b] = blocks[(b-r)%n]."""
    stacked = jnp.stack(blocks)  # [n, ...] indexed by offset
    return jnp.roll(stacked, shift=r, axis=0)


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name, *,
                          topology: sched_lib.Topology = "ring") -> jax.Array:
    """GEMM→ReduceScatter, other ranks' blocks first and the own block last.

    Args:
      x: [n*m, k]; row block ``b`` contributes to the output of rank ``b``.
      w: [k, n_out].
      axis_name: the mesh axis of ``n`` ranks.
      topology: schedule topology (see :mod:`.schedule`).

    Returns:
      y [m, n_out]: this rank's row block of ``psum(x @ w)``.
    """
    n = lax.axis_size(axis_name)
    if x.shape[0] % n:
        raise ValueError(f"x has {x.shape[0]} rows, not divisible by {n} ranks")
    sched = sched_lib.reduce_scatter_schedule(n, topology)
    r = lax.axis_index(axis_name)
    blocks = x.reshape(n, x.shape[0] // n, x.shape[1])
    result = [None] * sched.parts

    def compute(t, offset, part, received):
        block = lax.dynamic_index_in_dim(blocks, (r + offset) % n, keepdims=False)
        acc = jnp.dot(_split_rows(block, sched.parts)[part], w,
                      preferred_element_type=jnp.float32)
        for partial in received:
            acc = acc + partial.astype(jnp.float32)
        if offset == 0:
            result[part] = acc.astype(x.dtype)
        # Partials travel in the input dtype, as XLA's reduce-scatter does.
        return acc.astype(x.dtype)

    _run(sched, axis_name, {}, compute)
    return jnp.concatenate(result, axis=0)


def all_reduce(x: jax.Array, axis_name) -> jax.Array:
    """Ring all-reduce (reduce-scatter then all-gather) from ``ppermute`` steps.

    Args:
      x: any shape; summed elementwise over the ranks of ``axis_name``.

    Returns:
      The sum, same shape and dtype as ``x``, identical on every rank (every
      rank adds the partials in the same ring order).
    """
    n = lax.axis_size(axis_name)
    if n == 1:
        return x
    flat = x.reshape(-1)
    size = flat.shape[0]
    piece = -(-size // n)
    pieces = jnp.pad(flat, (0, piece * n - size)).reshape(n, piece)
    r = lax.axis_index(axis_name)
    fwd = _ring_perm(n, 1)
    # Reduce-scatter: the accumulator of piece b starts at b+1 and ends at b.
    acc = lax.dynamic_index_in_dim(pieces, (r - 1) % n, keepdims=False).astype(jnp.float32)
    for t in range(1, n):
        acc = lax.ppermute(acc.astype(x.dtype), axis_name, fwd).astype(jnp.float32)
        acc = acc + lax.dynamic_index_in_dim(pieces, (r - 1 - t) % n, keepdims=False)
    # All-gather: piece r is complete at rank r; pass it round the ring.
    gathered = [acc.astype(x.dtype)]
    for _ in range(1, n):
        gathered.append(lax.ppermute(gathered[-1], axis_name, fwd))
    # gathered[k] holds piece (r - k) % n.
    stacked = jnp.stack(gathered[::-1])  # stacked[j] holds piece (r + 1 + j) % n
    out = jnp.roll(stacked, shift=r + 1, axis=0)
    return out.reshape(-1)[:size].reshape(x.shape)


def matmul_all_reduce(x: jax.Array, w: jax.Array, axis_name, *,
                      chunk_rows: tuple[int, ...] | None = None) -> jax.Array:
    """GEMM→AllReduce in row chunks of shrinking size.

    Args:
      x: [m, k] (this rank's slice of the contraction).
      w: [k, n_out].
      axis_name: the mesh axis of ``n`` ranks.
      chunk_rows: row counts of the chunks (see
        :func:`.schedule.all_reduce_chunk_rows`); default 4 shrinking chunks.

    Returns:
      y [m, n_out] = psum(x @ w); the all-reduce of chunk ``i`` can overlap
      the GEMM of chunk ``i + 1``, only the last (smallest) is exposed.
    """
    if chunk_rows is None:
        chunk_rows = sched_lib.all_reduce_chunk_rows(x.shape[0], 4)
    outs, start = [], 0
    for rows in chunk_rows:
        part = jnp.dot(x[start:start + rows], w, preferred_element_type=x.dtype)
        outs.append(all_reduce(part, axis_name))
        start += rows
    return jnp.concatenate(outs, axis=0)
