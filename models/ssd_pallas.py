"""The SSD's intra-chunk product as fused Pallas (Triton) GPU kernels.

Inside each chunk the SSD is attention with a decay mask (see
:func:`models.mamba.ssd`)::

    y[t] = sum_{u <= t} CB[t, u] * exp(cum[t] - cum[u]) * dt[u] * x[u]

per head, where CB = C·B^T is shared by the heads of a B/C group. Written
with einsums, XLA materialises the per-head decay and its product with CB,
[chunks, heads, l, l] in float32 (537 MB a layer at Mamba-2 1.4B's shape,
sequence 8192, chunk 256), and autodiff keeps both for the backward. These
kernels build each [block, block] tile of that product in registers, as
flash attention does its scores: CB comes from one batched GEMM that XLA
runs well, everything per head stays on chip.

Three kernels, each a grid over (chunk, batch, group, ...):

- forward: a row block of one head's output, looping over the column blocks
  on or before the diagonal;
- backward by columns: a column block of one head, looping over the row
  blocks on or after the diagonal; gives dx, d(dt) and the column half of
  d(cum);
- backward by rows: a row block of one whole group, looping over column
  blocks and the group's heads; gives d(CB), summed over those heads, and
  the row half of d(cum).

The tiles' products run on the tensor cores in the inputs' dtype (bf16 in
training) with float32 accumulation; decays and sums are float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax 0.11 marks Pallas's Triton backend deprecated: without it, "auto" runs XLA.
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None

__all__ = ["Tiling", "chunk_operands", "intra_chunk", "unsupported_reason"]

_MAX_BLOCK = 64


class Tiling(NamedTuple):
    """How the kernels cut a chunk: [block, block] tiles, ``num_warps`` warps
    per program (None: Triton's default, 4); ``interpret`` runs them in
    Pallas's interpreter."""

    chunk_size: int
    block: int
    num_warps: int | None = None
    interpret: bool = False

    def params(self) -> dict:
        """pallas_call's keyword arguments."""
        return dict(interpret=self.interpret,
                    compiler_params=plgpu.CompilerParams(num_warps=self.num_warps))


def unsupported_reason(chunk_size: int, head_dim: int, heads_per_group: int) -> str | None:
    """Why these kernels cannot run a shape, or None when they can.

    Triton tiles have power-of-two sides, and its tensor-core products need
    at least 16 along each.
    """
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    for name, value in (("chunk_size", chunk_size), ("head_dim", head_dim),
                        ("heads per group", heads_per_group)):
        if value & (value - 1):
            return f"{name}={value} is not a power of two"
    for name, value in (("chunk_size", chunk_size), ("head_dim", head_dim)):
        if value < 16:
            return f"{name}={value} is below 16"
    return None


def _precision(dtype) -> lax.Precision | None:
    # float32 callers ask for float32 results (the reference path's); 16-bit
    # inputs take the tensor cores' native products.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _decay(cum_rows, cum_cols, row0, col0):
    """[rows, cols] exp(cum[t] - cum[u]) for u <= t, else 0 (never exp of a
    positive difference, which may overflow)."""
    t = row0 + lax.broadcasted_iota(jnp.int32, (cum_rows.shape[0], cum_cols.shape[0]), 0)
    u = col0 + lax.broadcasted_iota(jnp.int32, (cum_rows.shape[0], cum_cols.shape[0]), 1)
    return jnp.exp(jnp.where(t >= u, cum_rows[:, None] - cum_cols[None, :], -jnp.inf))


def _forward_kernel(cb_ref, x_ref, dt_ref, cum_ref, y_ref, *, block):
    """One head's rows [t0, t0 + block) of one chunk."""
    row = pl.program_id(4)
    rows = pl.ds(row * block, block)
    cum_rows = cum_ref[rows]
    precision = _precision(x_ref.dtype)

    def column(col, acc):
        cols = pl.ds(col * block, block)
        tile = (cb_ref[:, cols] * _decay(cum_rows, cum_ref[cols], row * block, col * block)
                * dt_ref[cols][None, :])
        return acc + plgpu.dot(tile.astype(x_ref.dtype), x_ref[cols, :], precision=precision)

    y_ref[...] = lax.fori_loop(0, row + 1, column,
                               jnp.zeros(y_ref.shape, jnp.float32)).astype(y_ref.dtype)


def _columns_kernel(cb_ref, x_ref, dt_ref, cum_ref, dy_ref, dx_ref, ddt_ref, dcum_ref, *,
                    block, blocks):
    """One head's columns [u0, u0 + block): dx, d(dt), and -sum over rows of
    d(log decay) for d(cum)."""
    col = pl.program_id(4)
    cols = pl.ds(col * block, block)
    x_cols, dt_cols, cum_cols = x_ref[cols, :], dt_ref[cols], cum_ref[cols]
    precision = _precision(x_ref.dtype)

    def row(r, carry):
        dxs, dcum = carry
        rows = pl.ds(r * block, block)
        dy = dy_ref[rows, :].astype(x_ref.dtype)
        scores = cb_ref[rows, cols] * _decay(cum_ref[rows], cum_cols, r * block, col * block)
        dxs = dxs + plgpu.dot(scores.astype(x_ref.dtype), dy, trans_a=True, precision=precision)
        dy_x = plgpu.dot(dy, x_cols, trans_b=True, precision=precision)   # [t, u]
        return dxs, dcum - jnp.sum(scores * dt_cols[None, :] * dy_x, axis=0)

    dxs, dcum = lax.fori_loop(col, blocks, row,
                              (jnp.zeros(x_cols.shape, jnp.float32),
                               jnp.zeros((block,), jnp.float32)))
    dx_ref[...] = (dxs * dt_cols[:, None]).astype(dx_ref.dtype)
    ddt_ref[...] = jnp.sum(dxs * x_cols.astype(jnp.float32), axis=1)
    dcum_ref[...] = dcum


def _rows_kernel(cb_ref, x_ref, dt_ref, cum_ref, dy_ref, dcb_ref, dcum_ref, *,
                 block, blocks, heads):
    """One group's rows [t0, t0 + block): d(CB) summed over its heads, and
    each head's sum over columns of d(log decay) for d(cum)."""
    row = pl.program_id(3)
    rows = pl.ds(row * block, block)
    precision = _precision(x_ref.dtype)
    head_ids = lax.broadcasted_iota(jnp.int32, (heads, block), 0)

    def column(col, dcum):
        cols = pl.ds(col * block, block)
        cb = cb_ref[:, cols]

        def head(h, carry):
            dcb, dcum = carry
            dy_x = plgpu.dot(dy_ref[rows, h, :].astype(x_ref.dtype), x_ref[cols, h, :],
                          trans_b=True, precision=precision)
            d = (_decay(cum_ref[rows, h], cum_ref[cols, h], row * block, col * block)
                 * dt_ref[cols, h][None, :] * dy_x)
            dcum = dcum + jnp.where(head_ids == h, jnp.sum(cb * d, axis=1)[None, :], 0.0)
            return dcb + d, dcum

        dcb, dcum = lax.fori_loop(0, heads, head, (jnp.zeros(cb.shape, jnp.float32), dcum))
        dcb_ref[:, cols] = dcb
        return dcum

    dcum_ref[...] = lax.fori_loop(0, row + 1, column, jnp.zeros((heads, block), jnp.float32))

    def above_diagonal(col, carry):
        dcb_ref[:, pl.ds(col * block, block)] = jnp.zeros((block, block), jnp.float32)
        return carry

    lax.fori_loop(row + 1, blocks, above_diagonal, None)


def _same_variance(*arrays):
    """The arrays made to vary over the same manual mesh axes (the union of
    theirs; inside ``shard_map`` a kernel's operands and results must agree),
    and that manual axis type, for the results."""
    union = frozenset().union(*(jax.typeof(t).manual_axis_type.varying for t in arrays))
    arrays = [lax.pcast(t, tuple(sorted(union - jax.typeof(t).manual_axis_type.varying)),
                        to="varying") for t in arrays]
    return arrays, jax.typeof(arrays[0]).manual_axis_type


def _grid_and_specs(x, tiling: Tiling):
    s, batch, groups, heads, p = x.shape
    chunk_size, block = tiling.chunk_size, tiling.block
    chunks, blocks = s // chunk_size, chunk_size // block
    per_head = dict(
        whole_chunk=pl.BlockSpec((chunk_size, None, None, None, p),
                                 lambda c, b, g, h, i: (c, b, g, h, 0)),
        scalars=pl.BlockSpec((chunk_size, None, None, None),
                             lambda c, b, g, h, i: (c, b, g, h)),
        block_rows=pl.BlockSpec((block, None, None, None, p),
                                lambda c, b, g, h, i: (c * blocks + i, b, g, h, 0)),
        block_scalars=pl.BlockSpec((block, None, None, None),
                                   lambda c, b, g, h, i: (c * blocks + i, b, g, h)),
        cb_rows=pl.BlockSpec((None, None, None, block, chunk_size),
                             lambda c, b, g, h, i: (b, g, c, i, 0)),
        cb_whole=pl.BlockSpec((None, None, None, chunk_size, chunk_size),
                              lambda c, b, g, h, i: (b, g, c, 0, 0)),
    )
    return (chunks, batch, groups, heads, blocks), block, blocks, per_head


def _forward(cb, x, dt, cum, tiling: Tiling):
    grid, block, _, spec = _grid_and_specs(x, tiling)
    (cb, x, dt, cum), varying = _same_variance(cb, x, dt, cum)
    return pl.pallas_call(
        functools.partial(_forward_kernel, block=block),
        grid=grid,
        in_specs=[spec["cb_rows"], spec["whole_chunk"], spec["scalars"], spec["scalars"]],
        out_specs=spec["block_rows"],
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32, manual_axis_type=varying),
        **tiling.params(),
        name="ssd_intra_chunk_forward",
    )(cb, x, dt, cum)


def _backward(cb, x, dt, cum, dy, tiling: Tiling):
    grid, block, blocks, spec = _grid_and_specs(x, tiling)
    chunk_size = tiling.chunk_size
    s, batch, groups, heads, p = x.shape
    (cb, x, dt, cum, dy), varying = _same_variance(cb, x, dt, cum, dy)
    result = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    dx, ddt, dcum_columns = pl.pallas_call(
        functools.partial(_columns_kernel, block=block, blocks=blocks),
        grid=grid,
        in_specs=[spec["cb_whole"], spec["whole_chunk"], spec["scalars"], spec["scalars"],
                  spec["whole_chunk"]],
        out_specs=[spec["block_rows"], spec["block_scalars"], spec["block_scalars"]],
        out_shape=[result(x.shape, x.dtype), result(dt.shape, jnp.float32),
                   result(cum.shape, jnp.float32)],
        **tiling.params(),
        name="ssd_intra_chunk_backward_columns",
    )(cb, x, dt, cum, dy)
    group_grid = (grid[0], batch, groups, blocks)
    whole_group = pl.BlockSpec((chunk_size, None, None, heads, p),
                               lambda c, b, g, i: (c, b, g, 0, 0))
    group_scalars = pl.BlockSpec((chunk_size, None, None, heads),
                                 lambda c, b, g, i: (c, b, g, 0))
    cb_rows = pl.BlockSpec((None, None, None, block, chunk_size),
                           lambda c, b, g, i: (b, g, c, i, 0))
    dcb, dcum_rows = pl.pallas_call(
        functools.partial(_rows_kernel, block=block, blocks=blocks, heads=heads),
        grid=group_grid,
        in_specs=[cb_rows, whole_group, group_scalars, group_scalars, whole_group],
        out_specs=[cb_rows,
                   pl.BlockSpec((None, None, heads, block),
                                lambda c, b, g, i: (b, g, 0, c * blocks + i))],
        out_shape=[result(cb.shape, jnp.float32),
                   result((batch, groups, heads, s), jnp.float32)],
        **tiling.params(),
        name="ssd_intra_chunk_backward_rows",
    )(cb, x, dt, cum, dy)
    dcum = dcum_columns + jnp.moveaxis(dcum_rows, -1, 0)
    return dcb.astype(cb.dtype), dx, ddt.astype(dt.dtype), dcum.astype(cum.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _intra_chunk(cb, x, dt, cum, tiling):
    return _forward(cb, x, dt, cum, tiling)


def _intra_chunk_fwd(cb, x, dt, cum, tiling):
    return _forward(cb, x, dt, cum, tiling), (cb, x, dt, cum)


def _intra_chunk_bwd(tiling, residuals, dy):
    return _backward(*residuals, dy, tiling)


_intra_chunk.defvjp(_intra_chunk_fwd, _intra_chunk_bwd)


def chunk_operands(x: jax.Array, dt: jax.Array, cum: jax.Array, b: jax.Array,
                   c: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`intra_chunk`'s operands from the SSD's chunked inputs.

    Args:
      x: [chunks, l, batch, g, heads, p].
      dt, cum: [chunks, l, batch, g, heads] float32.
      b, c: [chunks, l, batch, g, n].

    Returns:
      (cb [batch, g, chunks, l, l] float32 from one batched GEMM, and x, dt,
      cum with their chunks merged into the sequence).
    """
    cb = jnp.einsum("ctbgn,cubgn->bgctu", c, b, preferred_element_type=jnp.float32)
    return (cb, *(t.reshape(-1, *t.shape[2:]) for t in (x, dt, cum)))


def intra_chunk(cb: jax.Array, x: jax.Array, dt: jax.Array, cum: jax.Array, *,
                chunk_size: int, block: int | None = None, num_warps: int | None = None,
                interpret: bool = False) -> jax.Array:
    """The SSD's intra-chunk output, differentiable, on the GPU.

    Args:
      cb: [batch, g, chunks, l, l] float32, ``C[t]·B[u]`` within each chunk.
      x: [s, batch, g, heads, p] (bf16 or float32), s = chunks · l.
      dt: [s, batch, g, heads] float32, the step sizes.
      cum: [s, batch, g, heads] float32, the cumulative sum of ``dt·a``
        within each chunk.
      chunk_size: l.
      block: the tiles' side, a power of two from 16 dividing l (default
        min(l, 64)).
      num_warps: warps per kernel program (default Triton's, 4).
      interpret: run the kernels in Pallas's interpreter (any backend; for tests).

    Returns:
      [s, batch, g, heads, p] float32.
    """
    s, _, _, heads, p = x.shape
    reason = unsupported_reason(chunk_size, p, heads)
    if reason:
        raise ValueError(f"ssd_pallas.intra_chunk: {reason}; use the XLA SSD (ssd_impl='xla').")
    if s % chunk_size:
        raise ValueError(f"ssd_pallas.intra_chunk: sequence length {s} is not a multiple "
                         f"of chunk_size={chunk_size}")
    block = min(chunk_size, _MAX_BLOCK) if block is None else block
    if block < 16 or block & (block - 1) or chunk_size % block:
        raise ValueError(f"ssd_pallas.intra_chunk: block={block} must be a power of two "
                         f"from 16 that divides chunk_size={chunk_size}")
    return _intra_chunk(cb, x, dt, cum, Tiling(chunk_size, block, num_warps, interpret))
