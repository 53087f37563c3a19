"""GEMM→AllReduce: ``psum(x @ w)`` with all but a small tail hidden behind the GEMM."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from . import (
    _cuda_limits,
    _extension,
    _layout,
    _primitives,
    _validation,
    cuda_policy,
    decomposed,
    schedule,
    xla_baseline,
)
from ._op_handlers import FFI_TARGETS
from .all_reduce import kernel_attrs as _all_reduce_attrs

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


# The op's definition: how its primitive is typed and lowered.


def _out_shapes(x_shape: tuple[int, int], w_shape: tuple[int, int], n: int,
                opts: dict) -> tuple[tuple[int, int]]:
    """x [m, k] @ w [k, n_out], summed: [m, n_out]."""
    del n, opts
    return ((x_shape[0], w_shape[1]),)


def _options(ctx, n: int, opts: dict) -> dict:
    """The row chunks of ``chunks`` (every impl): shrinking, each rank's part
    of every chunk but the first a multiple of MATMUL_ALL_REDUCE_PART_ALIGN rows."""
    rows = ctx.avals_in[0].shape[0]
    opts["chunk_rows"] = schedule.all_reduce_chunk_rows(
        rows, opts.pop("chunks"), align=n * cuda_policy.MATMUL_ALL_REDUCE_PART_ALIGN)
    return opts


def _cuda_options(ctx, n: int, opts: dict) -> dict:
    """The kernel by result size (the one place the lowering picks it), and
    the fused kernel's GEMM (checked)."""
    del n
    out = ctx.avals_out[0]
    opts["kernel"] = cuda_policy.matmul_all_reduce_kernel(math.prod(out.shape) * out.dtype.itemsize)
    opts["gemm"] = _cuda_limits.policy_choice("MATMUL_ALL_REDUCE_GEMM",
                                              cuda_policy.MATMUL_ALL_REDUCE_GEMMS)
    if opts["kernel"] == "fused" and opts["gemm"] == "tile_signalled":
        _cuda_limits.check_tile_signalled(*ctx.avals_in, policy="MATMUL_ALL_REDUCE_GEMM")
    return opts


def _cuda_attrs(n: int, opts: dict) -> dict[str, np.ndarray | np.int32]:
    """The fused handler's attributes after the transport's: the rows of each
    chunk [chunks], and the GEMM."""
    del n
    return {"chunk_rows": np.asarray(opts["chunk_rows"], np.int32),
            "tile_signalled": np.int32(opts["gemm"] == "tile_signalled")}


def _cuda_lowering(ctx, args, transport: dict, n: int, opts: dict):
    """XLA's dot and the all-reduce kernel for small results; else the fused
    kernel (None), within its event budget."""
    if opts["kernel"] == "gemm_then_all_reduce":
        return _lower_gemm_then_all_reduce(ctx, *args, transport=transport)
    _cuda_limits.check_event_budget(len(opts["chunk_rows"]), n)
    return None


def _lower_gemm_then_all_reduce(ctx, x, w, *, transport: dict):
    """For small messages: XLA's dot of x [m, k] and w [k, n_out], then the
    all-reduce kernel on the same stream (see cuda_policy.matmul_all_reduce_kernel)."""
    target = FFI_TARGETS["all_reduce"]
    _extension.require_cuda_ops(_OP, target)

    def gemm_then_all_reduce(x, w):
        y = jnp.dot(x, w, preferred_element_type=x.dtype)
        nbytes = y.size * y.dtype.itemsize
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(y.shape, y.dtype))
        n = int(transport["n"])
        return [call(y, **transport, **_all_reduce_attrs(
            n, {"algorithm": cuda_policy.all_reduce_algorithm(nbytes, n, y.dtype)}))]

    return mlir.lower_fun(gemm_then_all_reduce, multiple_results=True)(ctx, x, w)


_DEFINITION = _primitives.define(_primitives.OpDef(
    name=_OP, ffi_target=FFI_TARGETS[_OP], out_shapes=_out_shapes, reduces=True,
    xla=_primitives.as_tuple(_primitives.baseline(xla_baseline.matmul_all_reduce)),
    decomposed=_primitives.as_tuple(
        _primitives.decomposed_with(decomposed.matmul_all_reduce, "chunk_rows")),
    cuda_attrs=_cuda_attrs, single_rank=_primitives.as_tuple(_primitives.local_dot),
    options=_options, cuda_options=_cuda_options, cuda_lowering=_cuda_lowering))
