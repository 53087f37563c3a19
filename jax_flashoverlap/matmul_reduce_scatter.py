"""GEMM→ReduceScatter: ``psum_scatter(x @ w)`` with the scatter hidden behind the GEMM."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    _collective_matmul,
    _cuda_limits,
    _layout,
    _primitives,
    _validation,
    cuda_policy,
    decomposed,
    schedule,
    xla_baseline,
)
from ._op_handlers import FFI_TARGETS
from .schedule import Topology

__all__ = ["matmul_reduce_scatter"]

_OP = "matmul_reduce_scatter"


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str, *,
                          scatter_dimension: int = 0, impl: str = "auto",
                          topology: Topology = "ring", chunks: int | None = None) -> jax.Array:
    """Returns ``psum_scatter(x @ w, axis_name, scatter_dimension, tiled=True)``.

    The row-parallel linear layer of sequence parallelism: each rank holds a
    slice of the contraction (``k``), and the summed output leaves sharded
    along the sequence. Must be called inside ``jax.shard_map`` with
    ``axis_name`` bound (or use
    :func:`jax_flashoverlap.sharded.matmul_reduce_scatter`).

    Args:
      x: [..., n * m, ..., k]; ``scatter_dimension`` must divide by the axis
        size ``n``. Other leading dims are batch dims.
      w: [k, n_out].
      axis_name: mesh axis of ``n`` ranks to sum over.
      scatter_dimension: the dim of the result that is scattered (not the
        last). Dim 0 (e.g. [seq, batch, hidden]) needs no transposes.
      impl: "xla" (dot then psum_scatter), "decomposed" (pure-JAX ppermute
        schedule, own block last), "cuda" (fused FFI kernel), or "auto".
      topology: schedule of the "decomposed" path ("ring" or
        "bidirectional"); the CUDA kernel always sends straight to the owner.
      chunks: row chunks per block in the CUDA kernel (each signalled on its
        own, so that work starts on the first rows to arrive); None picks by
        shape (:func:`jax_flashoverlap.cuda_policy.collective_matmul_chunks`).

    Returns:
      [..., m, ..., n_out]: this rank's block of the sum. Its gradient runs
      :func:`~jax_flashoverlap.all_gather_matmul` with the same ``impl``.
    """
    _validation.check_impl(_OP, impl)
    chunks = _validation.check_chunks(_OP, chunks)
    _validation.warn_unused_under_xla(_OP, impl, chunks=chunks)
    n = _validation.axis_size(_OP, axis_name)
    _validation.check_matmul_operands(_OP, x, w)
    scatter_dimension = _validation.normalize_axis(_OP, "scatter_dimension",
                                                   scatter_dimension, x.ndim)
    if x.shape[scatter_dimension] % n:
        raise ValueError(
            f"{_OP}: x {x.shape} has {x.shape[scatter_dimension]} rows along "
            f"scatter_dimension={scatter_dimension}, not divisible by the {n} ranks of "
            f"{axis_name!r}; pad that dim to a multiple of {n}.")
    varying = (_layout.varying(x), _layout.varying(w))
    static = (axis_name, n, impl, scatter_dimension,
              (("topology", topology), ("chunks", chunks)), varying)
    return _matmul_reduce_scatter(x, w, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, static):
    return _forward(x, w, static)[0]


def _forward(x, w, static):
    axis_name, n, impl, dim, opts, _ = static
    x2 = _layout.rows_first(x, dim)
    (y2,) = _primitives.bind(_OP, x2, w, axis_name=axis_name, n=n, impl=impl, **dict(opts))
    return _layout.rows_restore(y2, x.shape, dim, x.shape[dim] // n), (x2, w)


def _backward(static, residuals, dy):
    axis_name, n, impl, dim, opts, (x_varying, w_varying) = static
    x2, w = residuals
    # The transpose of reduce-scatter is all-gather: dx = all_gather(dy) @ w.T,
    # and the gathered dy it produces on the way is what dw needs.
    dx2, dyg2 = _primitives.bind("all_gather_matmul", _layout.rows_first(dy, dim), w.T,
                                 axis_name=axis_name, n=n, impl=impl, gathered=True,
                                 **dict(opts))
    dx = _layout.rows_restore(dx2, dy.shape, dim, n * dy.shape[dim])
    dw = jnp.dot(x2.T, dyg2, preferred_element_type=w.dtype)
    return _layout.match_varying(dx, x_varying), _layout.match_varying(dw, w_varying)


_matmul_reduce_scatter.defvjp(_forward, _backward)


# The op's definition: how its primitive is typed and lowered.


def _out_shapes(x_shape: tuple[int, int], w_shape: tuple[int, int], n: int,
                opts: dict) -> tuple[tuple[int, int]]:
    """This rank's block [m / n, n_out] of x [m, k] @ w [k, n_out]."""
    del opts
    return ((x_shape[0] // n, w_shape[1]),)


def _cuda_options(ctx, n: int, opts: dict) -> dict:
    """The choices the collective matmuls share (_collective_matmul), and
    where the peers' partials are added (cuda_policy.REDUCE_SCATTER_FOLD)."""
    opts = _collective_matmul.cuda_options(_OP, "REDUCE_SCATTER_GEMM", ctx, n, opts)
    opts["fold"] = _cuda_limits.policy_choice("REDUCE_SCATTER_FOLD",
                                              cuda_policy.REDUCE_SCATTER_FOLDS)
    return opts


def _cuda_attrs(n: int, opts: dict) -> dict[str, np.ndarray | np.int32]:
    """The handler's attributes after the transport's: the blocks' order,
    chunks per block, the fold, where waits run, the GEMM."""
    sched = schedule.reduce_scatter_schedule(n, "direct", opts.get("chunks", 1))
    return _collective_matmul.cuda_attrs(sched, opts,
                                         add_after=np.int32(opts["fold"] == "add_after"))


_DEFINITION = _primitives.define(_primitives.OpDef(
    name=_OP, ffi_target=FFI_TARGETS[_OP], out_shapes=_out_shapes, reduces=False,
    xla=_primitives.as_tuple(_primitives.baseline(xla_baseline.matmul_reduce_scatter)),
    decomposed=_primitives.as_tuple(
        _primitives.decomposed_with(decomposed.matmul_reduce_scatter, "topology")),
    cuda_attrs=_cuda_attrs, single_rank=_primitives.as_tuple(_primitives.local_dot),
    cuda_options=_cuda_options))
