"""AllGather→GEMM: ``all_gather(x) @ w`` with the gather hidden behind the GEMM."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    _collective_matmul,
    _layout,
    _primitives,
    _validation,
    decomposed,
    schedule,
    xla_baseline,
)
from ._op_handlers import FFI_TARGETS
from .schedule import Topology

__all__ = ["all_gather_matmul"]

_OP = "all_gather_matmul"


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: str, *,
                      gather_axis: int = 0, impl: str = "auto",
                      topology: Topology = "ring", chunks: int | None = None) -> jax.Array:
    """Returns ``all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w``.

    The column-parallel linear layer of sequence parallelism: activations
    arrive sharded along the sequence, weights are sharded along their output
    columns. Must be called inside ``jax.shard_map`` with ``axis_name`` bound
    (or use :func:`jax_flashoverlap.sharded.all_gather_matmul` on global
    arrays).

    Args:
      x: [..., m_local, ..., k], this rank's shard along ``gather_axis``; any
        other leading dims are batch dims.
      w: [k, n_out], this rank's weight columns.
      axis_name: mesh axis of ``n`` ranks that ``x`` is sharded over.
      gather_axis: the dim of ``x`` that is sharded (not the last). Dim 0
        (e.g. [seq, batch, hidden]) needs no transposes.
      impl: "xla" (all_gather then dot), "decomposed" (pure-JAX ppermute
        schedule, local shard first), "cuda" (fused FFI kernel), or "auto".
      topology: schedule of the "decomposed" path ("ring" or
        "bidirectional"); the CUDA kernel always sends straight to each peer.
      chunks: row chunks per shard in the CUDA kernel (each signalled on its
        own, so that work starts on the first rows to arrive); None picks by
        shape (:func:`jax_flashoverlap.cuda_policy.collective_matmul_chunks`).

    Returns:
      [..., n * m_local, ..., n_out]: x's shape with ``gather_axis`` grown n
      times and the last dim ``n_out``. Its gradient runs
      :func:`~jax_flashoverlap.matmul_reduce_scatter` with the same ``impl``.
    """
    _validation.check_impl(_OP, impl)
    chunks = _validation.check_chunks(_OP, chunks)
    _validation.warn_unused_under_xla(_OP, impl, chunks=chunks)
    n = _validation.axis_size(_OP, axis_name)
    _validation.check_matmul_operands(_OP, x, w)
    gather_axis = _validation.normalize_axis(_OP, "gather_axis", gather_axis, x.ndim)
    varying = (_layout.varying(x), _layout.varying(w))
    static = (axis_name, n, impl, gather_axis, (("topology", topology), ("chunks", chunks)),
              varying)
    return _all_gather_matmul(x, w, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, static):
    return _apply(x, w, static, gathered=False)[0]


def _apply(x, w, static, *, gathered):
    """Runs the op; ``gathered``: also return all_gather(x) [n*m*batch, k]."""
    axis_name, n, impl, gather_axis, opts, _ = static
    y2, xg2 = _primitives.bind(_OP, _layout.rows_first(x, gather_axis), w,
                               axis_name=axis_name, n=n, impl=impl, gathered=gathered,
                               **dict(opts))
    return _layout.rows_restore(y2, x.shape, gather_axis, n * x.shape[gather_axis]), xg2


def _forward(x, w, static):
    y, xg2 = _apply(x, w, static, gathered=True)
    return y, (xg2, w)


def _backward(static, residuals, dy):
    axis_name, n, impl, gather_axis, opts, (x_varying, w_varying) = static
    xg2, w = residuals
    dy2 = _layout.rows_first(dy, gather_axis)
    # d(all_gather(x)) is the reduce-scatter of dy @ w.T: the mirrored op.
    (dx2,) = _primitives.bind("matmul_reduce_scatter", dy2, w.T, axis_name=axis_name,
                              n=n, impl=impl, **dict(opts))
    dx = _layout.rows_restore(dx2, dy.shape, gather_axis, dy.shape[gather_axis] // n)
    dw = jnp.dot(xg2.T, dy2, preferred_element_type=w.dtype)
    return _layout.match_varying(dx, x_varying), _layout.match_varying(dw, w_varying)


_all_gather_matmul.defvjp(_forward, _backward)


# The op's definition: how its primitive is typed and lowered.

_GEMM_POLICY = "ALL_GATHER_GEMM"


def _out_shapes(x_shape: tuple[int, int], w_shape: tuple[int, int], n: int,
                opts: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """y [n*m, n_out], and x_gathered [n*m, k] (the backward's residual),
    [0, k] unless asked for; x [m, k], w [k, n_out]."""
    return ((n * x_shape[0], w_shape[1]),
            (n * x_shape[0] if opts.get("gathered") else 0, x_shape[1]))


def _single_rank(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """On an axis of one rank: x @ w, and x is all that gathers."""
    return _primitives.local_dot(x, w), x


def _cuda_options(ctx, n: int, opts: dict) -> dict:
    """The choices the collective matmuls share (_collective_matmul), and
    that the tile-signalled GEMM gathers on 2 ranks only."""
    opts = _collective_matmul.cuda_options(_OP, _GEMM_POLICY, ctx, n, opts)
    if opts["gemm"] == "tile_signalled" and n != 2:
        raise ValueError(f"the tile-signalled GEMM (cuda_policy.{_GEMM_POLICY}) runs on an "
                         f"axis of 2 devices, got {n}; set cuda_policy.{_GEMM_POLICY} = "
                         f"'row_blocks'")
    return opts


def _cuda_attrs(n: int, opts: dict) -> dict[str, np.ndarray | np.int32]:
    """The handler's attributes after the transport's: the shards' order, chunks
    per shard, where waits run, the GEMM."""
    sched = schedule.all_gather_schedule(n, "direct", opts.get("chunks", 1))
    return _collective_matmul.cuda_attrs(sched, opts)


_DEFINITION = _primitives.define(_primitives.OpDef(
    name=_OP, ffi_target=FFI_TARGETS[_OP], out_shapes=_out_shapes, reduces=False,
    xla=_primitives.as_tuple(_primitives.baseline(xla_baseline.all_gather_matmul)),
    decomposed=_primitives.as_tuple(
        _primitives.decomposed_with(decomposed.all_gather_matmul, "topology")),
    cuda_attrs=_cuda_attrs, single_rank=_single_rank, cuda_options=_cuda_options))
