"""GEMM→AllReduce: ``psum(x @ w)`` with all but a small tail hidden behind the GEMM."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _layout, _primitives, _validation

__all__ = ["matmul_all_reduce"]

_OP = "matmul_all_reduce"
_DEFAULT_CHUNKS = 2


def matmul_all_reduce(x: jax.Array, w: jax.Array, axis_name: str, *,
                      impl: str = "auto", chunks: int = _DEFAULT_CHUNKS) -> jax.Array:
    """Returns ``psum(x @ w, axis_name)``.

    The row-parallel linear layer without sequence parallelism. The rows are
    processed in ``chunks`` chunks of shrinking size so that the all-reduce of
    one chunk runs under the GEMM of the next and only the smallest, last one
    is exposed. Must be called inside ``jax.shard_map`` with ``axis_name``
    bound (or use :func:`jax_flashoverlap.sharded.matmul_all_reduce`).

    Args:
      x: [..., k], this rank's slice of the contraction; leading dims are rows.
      w: [k, n_out].
      axis_name: mesh axis of ``n`` ranks to sum over.
      impl: "xla" (dot then psum), "decomposed" (pure-JAX chunked ring
        all-reduce), "cuda" (the fused FFI kernel; for a result of at most
        :data:`jax_flashoverlap.cuda_policy.MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES`
        per rank, XLA's dot then the one-kernel all-reduce), or "auto".
      chunks: number of row chunks of the fused kernel and the "decomposed"
        path (see :func:`jax_flashoverlap.schedule.all_reduce_chunk_rows`);
        every chunk but the first holds a multiple of ``n`` ×
        :data:`jax_flashoverlap.cuda_policy.MATMUL_ALL_REDUCE_PART_ALIGN` rows,
        so there are at most ``rows // (n * MATMUL_ALL_REDUCE_PART_ALIGN)``
        chunks (and at least one).

    Returns:
      [..., n_out], identical on every rank and typed as such (like
      ``lax.psum``): its gradient is ``dy @ w.T``, with no communication.
    """
    _validation.check_impl(_OP, impl)
    chunks = _validation.check_chunks(_OP, chunks, picked_by_shape=False)
    _validation.warn_unused_under_xla(_OP, impl,
                                      chunks=None if chunks == _DEFAULT_CHUNKS else chunks)
    n = _validation.axis_size(_OP, axis_name)
    _validation.check_matmul_operands(_OP, x, w)
    varying = (_layout.varying(x), _layout.varying(w))
    return _matmul_all_reduce(x, w, (axis_name, n, impl, chunks, varying))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, static):
    return _forward(x, w, static)[0]


def _forward(x, w, static):
    axis_name, n, impl, chunks, _ = static
    x2 = _layout.rows_first(x, 0)
    (y2,) = _primitives.bind(_OP, x2, w, axis_name=axis_name, n=n, impl=impl, chunks=chunks)
    return y2.reshape(*x.shape[:-1], w.shape[1]), (x2, w)


def _backward(static, residuals, dy):
    axis_name, _, _, _, (x_varying, w_varying) = static
    x2, w = residuals
    dy2 = _layout.rows_first(dy, 0)
    dx = jnp.dot(dy2, w.T, preferred_element_type=x2.dtype).reshape(*dy.shape[:-1], w.shape[0])
    dw = jnp.dot(x2.T, dy2, preferred_element_type=w.dtype)
    return _layout.match_varying(dx, x_varying), _layout.match_varying(dw, w_varying)


_matmul_all_reduce.defvjp(_forward, _backward)
