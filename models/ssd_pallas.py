"""The SSD's chunk work as fused Pallas (Triton) GPU kernels.

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
  on or before the diagonal, and adding the state entering the chunk (step
  4 of the SSD, ``exp(cum[t]) · c[t] · S^T``);
- backward by columns: a column block of one head, looping over the row
  blocks on or after the diagonal; gives dx, d(dt) and the column half of
  d(cum);
- backward by rows: a row block of one whole group, looping over column
  blocks and the group's heads; gives d(CB), summed over those heads, and
  the row half of d(cum).

The tiles' products run on the tensor cores in the inputs' dtype (bf16 in
training) with float32 accumulation; decays and sums are float32.

:func:`chunk_states` (:mod:`.ssd_state_pallas`) gives each chunk's state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .layers import same_variance
from .pallas_gpu import plgpu
from .ssd_state_pallas import chunk_states, state_group, state_outer
from .ssd_tiles import Tiling, precision_of, tiling_of, unsupported_reason

__all__ = ["Tiling", "chunk_operands", "chunk_output", "chunk_states", "unsupported_reason"]

def _decay(cum_rows, cum_cols, row0, col0):
    """[rows, cols] exp(cum[t] - cum[u]) for u <= t, else 0 (never exp of a
    positive difference, which may overflow)."""
    t = row0 + lax.broadcasted_iota(jnp.int32, (cum_rows.shape[0], cum_cols.shape[0]), 0)
    u = col0 + lax.broadcasted_iota(jnp.int32, (cum_rows.shape[0], cum_cols.shape[0]), 1)
    return jnp.exp(jnp.where(t >= u, cum_rows[:, None] - cum_cols[None, :], -jnp.inf))


def _decay_below(cum_rows, cum_cols, cum_last):
    """[rows, cols] exp(cum[t] - cum[u]) for a tile wholly below the
    diagonal (every t after every u), as the outer product of
    exp(cum[t] - cum[v]) and exp(cum[v] - cum[u]), v the tile's last column
    (``cum_last``, [1]): rows + cols exponentials instead of rows · cols.
    cum is monotonic along a head (every dt·a has a's sign), so both factors
    are on the product's side of 1: neither overflows where it does not."""
    return (jnp.exp(cum_rows - cum_last)[:, None]
            * jnp.exp(cum_last - cum_cols)[None, :])


def _last_column(col, cols):
    """Column tile ``col``'s last column, as an index of one: the v of
    :func:`_decay_below`."""
    return pl.ds(col * cols + cols - 1, 1)


def _wholly_below(row, block, cols):
    """How many column tiles of side ``cols`` end before row block ``row``
    (of side ``block``) starts: those wholly below the diagonal."""
    return lax.div(row * block, cols)


def _first_wholly_below(col, block, cols):
    """The first row block (of side ``block``) that starts after column tile
    ``col`` (of side ``cols``) ends."""
    return lax.div((col + 1) * cols + block - 1, block)


def _to_diagonal(row, block, cols):
    """How many column tiles of side ``cols`` start before the end of row
    block ``row`` (of side ``block``): those on or below the diagonal."""
    if cols == block:  # square tiles keep the instructions measured before rectangles
        return row + 1
    return lax.div(row * block + block + cols - 1, cols)


def _forward_kernel(cb_ref, x_ref, dt_ref, cum_ref, c_ref, state_ref, *refs, block, cols):
    """One head's rows [t0, t0 + block) of one chunk: from inside the chunk,
    plus the entering state's ``exp(cum[t]) · c[t] · S^T``; with a skip
    (refs = skip, y), also ``skip[t] · x[t]``. y in its ref's dtype."""
    *skip_ref, y_ref = refs
    row = pl.program_id(4)
    rows = pl.ds(row * block, block)
    cum_rows = cum_ref[rows]
    precision = precision_of(x_ref.dtype)

    def column(col, acc, *, below):
        tile_cols = pl.ds(col * cols, cols)
        cum_cols = cum_ref[tile_cols]
        decay = (_decay_below(cum_rows, cum_cols, cum_ref[_last_column(col, cols)])
                 if below else _decay(cum_rows, cum_cols, row * block, col * cols))
        tile = cb_ref[:, tile_cols] * decay * dt_ref[tile_cols][None, :]
        return acc + plgpu.dot(tile.astype(x_ref.dtype), x_ref[tile_cols, :],
                               precision=precision)

    entering = plgpu.dot(c_ref[...], state_ref[...].astype(c_ref.dtype), trans_b=True,
                         precision=precision)
    below = _wholly_below(row, block, cols)
    y = lax.fori_loop(0, below, functools.partial(column, below=True),
                      jnp.exp(cum_rows)[:, None] * entering)
    y = lax.fori_loop(below, _to_diagonal(row, block, cols),
                      functools.partial(column, below=False), y)
    if skip_ref:
        y = y + skip_ref[0][rows][:, None] * x_ref[rows, :].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)


def _columns_kernel(cb_ref, x_ref, dt_ref, cum_ref, dy_ref, dx_ref, ddt_ref, dcum_ref, *,
                    block, cols, blocks):
    """One head's columns [u0, u0 + cols): dx, d(dt), and -sum over rows of
    d(log decay) for d(cum), from its ``blocks`` row blocks of ``block`` rows
    on or after the diagonal."""
    col = pl.program_id(4)
    tile_cols = pl.ds(col * cols, cols)
    x_cols, dt_cols, cum_cols = x_ref[tile_cols, :], dt_ref[tile_cols], cum_ref[tile_cols]
    precision = precision_of(x_ref.dtype)

    cum_last = cum_ref[_last_column(col, cols)]

    def row(r, carry, *, below):
        dxs, dcum = carry
        rows = pl.ds(r * block, block)
        dy = dy_ref[rows, :].astype(x_ref.dtype)
        decay = (_decay_below(cum_ref[rows], cum_cols, cum_last) if below
                 else _decay(cum_ref[rows], cum_cols, r * block, col * cols))
        scores = cb_ref[rows, tile_cols] * decay
        dxs = dxs + plgpu.dot(scores.astype(x_ref.dtype), dy, trans_a=True, precision=precision)
        dy_x = plgpu.dot(dy, x_cols, trans_b=True, precision=precision)   # [t, u]
        return dxs, dcum - jnp.sum(scores * dt_cols[None, :] * dy_x, axis=0)

    diagonal = col if cols == block else lax.div(col * cols, block)
    below = _first_wholly_below(col, block, cols)
    carry = lax.fori_loop(diagonal, below, functools.partial(row, below=False),
                          (jnp.zeros(x_cols.shape, jnp.float32),
                           jnp.zeros((cols,), jnp.float32)))
    dxs, dcum = lax.fori_loop(below, blocks, functools.partial(row, below=True), carry)
    dx_ref[...] = (dxs * dt_cols[:, None]).astype(dx_ref.dtype)
    ddt_ref[...] = jnp.sum(dxs * x_cols.astype(jnp.float32), axis=1)
    dcum_ref[...] = dcum


def _rows_kernel(cb_ref, x_ref, dt_ref, cum_ref, dy_ref, dcb_ref, dcum_ref, *,
                 block, cols, col_blocks, heads):
    """One group's rows [t0, t0 + block): d(CB) summed over its heads, and
    each head's sum over columns of d(log decay) for d(cum), over the
    chunk's ``col_blocks`` column tiles of ``cols``."""
    row = pl.program_id(3)
    rows = pl.ds(row * block, block)
    precision = precision_of(x_ref.dtype)
    head_ids = lax.broadcasted_iota(jnp.int32, (heads, block), 0)

    def column(col, dcum, *, below):
        tile_cols = pl.ds(col * cols, cols)
        cb = cb_ref[:, tile_cols]

        def head(h, carry):
            dcb, dcum = carry
            dy_x = plgpu.dot(dy_ref[rows, h, :].astype(x_ref.dtype), x_ref[tile_cols, h, :],
                             trans_b=True, precision=precision)
            cum_rows, cum_cols = cum_ref[rows, h], cum_ref[tile_cols, h]
            decay = (_decay_below(cum_rows, cum_cols, cum_ref[_last_column(col, cols), h])
                     if below else _decay(cum_rows, cum_cols, row * block, col * cols))
            d = decay * dt_ref[tile_cols, h][None, :] * dy_x
            dcum = dcum + jnp.where(head_ids == h, jnp.sum(cb * d, axis=1)[None, :], 0.0)
            return dcb + d, dcum

        dcb, dcum = lax.fori_loop(0, heads, head, (jnp.zeros(cb.shape, jnp.float32), dcum))
        dcb_ref[:, tile_cols] = dcb.astype(dcb_ref.dtype)
        return dcum

    on_diagonal, below = _to_diagonal(row, block, cols), _wholly_below(row, block, cols)
    dcum = lax.fori_loop(0, below, functools.partial(column, below=True),
                         jnp.zeros((heads, block), jnp.float32))
    dcum_ref[...] = lax.fori_loop(below, on_diagonal, functools.partial(column, below=False),
                                  dcum)

    def above_diagonal(col, carry):
        dcb_ref[:, pl.ds(col * cols, cols)] = jnp.zeros((block, cols), dcb_ref.dtype)
        return carry

    lax.fori_loop(on_diagonal, col_blocks, above_diagonal, None)


def _grid_and_specs(x, tiling: Tiling, block: int):
    """The grid (chunk, batch, group, head, block of ``block`` rows) and
    its BlockSpecs."""
    s, batch, groups, heads, p = x.shape
    chunk_size = tiling.chunk_size
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


def _forward(cb, x, dt, cum, c, state, skip, tiling: Tiling, out_dtype):
    grid, block, blocks, spec = _grid_and_specs(x, tiling, tiling.block)
    n, p = c.shape[-1], x.shape[-1]
    # The rows of c and the state entering this head's chunk.
    c_rows = pl.BlockSpec((block, None, None, n), lambda c, b, g, h, i: (c * blocks + i, b, g, 0))
    state_spec = pl.BlockSpec((None, None, None, None, p, n),
                              lambda c, b, g, h, i: (b, g, h, c, 0, 0))
    operands, varying = same_variance(cb, x, dt, cum, c, state,
                                      *([] if skip is None else [skip]))
    return pl.pallas_call(
        functools.partial(_forward_kernel, block=block, cols=tiling.cols),
        grid=grid,
        in_specs=[spec["cb_rows"], spec["whole_chunk"], spec["scalars"], spec["scalars"],
                  c_rows, state_spec] + ([] if skip is None else [spec["scalars"]]),
        out_specs=spec["block_rows"],
        out_shape=jax.ShapeDtypeStruct(x.shape, out_dtype, manual_axis_type=varying),
        **tiling.params(),
        name="ssd_chunk_output",
    )(*operands)


def _backward(cb, x, dt, cum, dy, tiling: Tiling):
    block, cols, chunk_size = tiling.block, tiling.cols, tiling.chunk_size
    grid, _, col_blocks, spec = _grid_and_specs(x, tiling, cols)
    blocks = chunk_size // block
    s, batch, groups, heads, p = x.shape
    (cb, x, dt, cum, dy), varying = same_variance(cb, x, dt, cum, dy)
    result = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    dx, ddt, dcum_columns = pl.pallas_call(
        functools.partial(_columns_kernel, block=block, cols=cols, blocks=blocks),
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
        functools.partial(_rows_kernel, block=block, cols=cols, col_blocks=col_blocks,
                          heads=heads),
        grid=group_grid,
        in_specs=[cb_rows, whole_group, group_scalars, group_scalars, whole_group],
        out_specs=[cb_rows,
                   pl.BlockSpec((None, None, heads, block),
                                lambda c, b, g, i: (b, g, 0, c * blocks + i))],
        out_shape=[result(cb.shape, cb.dtype),
                   result((batch, groups, heads, s), jnp.float32)],
        **tiling.params(),
        name="ssd_intra_chunk_backward_rows",
    )(cb, x, dt, cum, dy)
    dcum = dcum_columns + jnp.moveaxis(dcum_rows, -1, 0)
    return dcb, dx, ddt.astype(dt.dtype), dcum.astype(cum.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _chunk_output(cb, x, dt, cum, c, state, skip, tiling, out_dtype):
    return _forward(cb, x, dt, cum, c, state, skip, tiling, out_dtype)


def _chunk_output_fwd(cb, x, dt, cum, c, state, skip, tiling, out_dtype):
    return (_forward(cb, x, dt, cum, c, state, skip, tiling, out_dtype),
            (cb, x, dt, cum, c, state, skip))


def _chunk_output_bwd(tiling, out_dtype, residuals, dy):
    del out_dtype
    cb, x, dt, cum, c, state, skip = residuals
    dcb, dx, ddt, dcum = _backward(cb, x, dt, cum, dy, tiling)
    dskip = None
    if skip is not None:  # y += skip · x
        dy32 = dy.astype(jnp.float32)
        dx = (dx.astype(jnp.float32) + skip[..., None] * dy32).astype(x.dtype)
        dskip = jnp.sum(dy32 * x.astype(jnp.float32), axis=-1)
    # The entering state's part, exp(cum[t]) · c[t] · S^T: with dy weighted
    # by exp(cum), S's gradient is a chunk state of it, c's the heads' sum of
    # dy_h · S_h, and cum's the row sums of c times that product.
    weighted = (dy * jnp.exp(cum)[..., None]).astype(x.dtype)
    d_state = state_outer(weighted, c, tiling).astype(state.dtype)
    dc, dcum_entering = state_group(weighted, state, tiling, row_sums_with=c)
    dcum = dcum + jnp.moveaxis(dcum_entering, -1, 0)
    return dcb, dx, ddt, dcum, dc.astype(c.dtype), d_state, dskip


_chunk_output.defvjp(_chunk_output_fwd, _chunk_output_bwd)


def chunk_operands(x: jax.Array, dt: jax.Array, cum: jax.Array, b: jax.Array,
                   c: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`chunk_output`'s operands, but the state, from the SSD's chunked inputs.

    Args:
      x: [chunks, l, batch, g, heads, p].
      dt, cum: [chunks, l, batch, g, heads] float32.
      b, c: [chunks, l, batch, g, n].

    Returns:
      (cb [batch, g, chunks, l, l] in x's dtype, from one batched GEMM
      accumulating in float32, and x, dt, cum and c with their chunks merged
      into the sequence).
    """
    # In x's dtype: the kernels read CB once per head and row block (bf16 in
    # training halves those bytes), and round its products with the decays
    # to x's dtype for the tensor cores anyway.
    cb = jnp.einsum("ctbgn,cubgn->bgctu", c, b,
                    preferred_element_type=jnp.float32).astype(x.dtype)
    return (cb, *(t.reshape(-1, *t.shape[2:]) for t in (x, dt, cum, c)))


def chunk_output(cb: jax.Array, x: jax.Array, dt: jax.Array, cum: jax.Array, c: jax.Array,
                 state: jax.Array, *, chunk_size: int, skip: jax.Array | None = None,
                 block: int | None = None, block_cols: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 interpret: bool = False) -> jax.Array:
    """The SSD's output, from inside each chunk and from the state entering
    it, differentiable, on the GPU.

    Args:
      cb: [batch, g, chunks, l, l], ``C[t]·B[u]`` within each chunk, float32
        or x's dtype (its gradient is cb's dtype).
      x: [s, batch, g, heads, p] (bf16 or float32), s = chunks · l.
      dt: [s, batch, g, heads] float32, the step sizes.
      cum: [s, batch, g, heads] float32, the cumulative sum of ``dt·a``
        within each chunk.
      c: [s, batch, g, n], x's dtype.
      state: [batch, g, heads, chunks, p, n] float32 or c's dtype, the
        state entering each chunk; its product with c runs in c's dtype.
      chunk_size: l.
      skip: [s, batch, g, heads] float32, or None. With it the kernel also
        adds ``skip[t] · x[t]`` (Mamba-2's D skip) and writes y in x's dtype,
        so no float32 y goes through memory.
      block: the tiles' side, a power of two from 16 dividing l (default
        min(l, 64)).
      block_cols: the intra-chunk tiles' columns, the same kind of number
        (default ``block``: square tiles).
      num_warps: warps per kernel program (default Triton's, 4).
      num_stages: software-pipeline stages of the kernels' loops (default
        Pallas's, 3).
      interpret: run the kernels in Pallas's interpreter (any backend; for tests).

    Returns:
      [s, batch, g, heads, p]: ``sum_{u <= t} CB[t, u] exp(cum[t] - cum[u])
      dt[u] x[u] + exp(cum[t]) c[t] · S^T`` (``+ skip[t] · x[t]``), float32
      (x's dtype with ``skip``).
    """
    s, _, _, heads, p = x.shape
    n, chunks = c.shape[-1], state.shape[3]
    tiling = tiling_of("chunk_output", s, chunk_size,
                     unsupported_reason(chunk_size, p, heads, n), block, num_warps, interpret,
                     num_stages, block_cols)
    if s != chunks * chunk_size:
        raise ValueError(f"ssd_pallas.chunk_output: {chunks} chunks of state for a sequence "
                         f"of {s} = {s // chunk_size} chunks")
    out_dtype = jnp.float32 if skip is None else x.dtype
    if skip is not None:  # made to vary like x outside the custom_vjp (see same_variance)
        skip = same_variance(x, skip)[0][1]
    return _chunk_output(cb, x, dt, cum, c, state, skip, tiling, out_dtype)


