"""Each chunk's SSD state as Pallas (Triton) GPU kernels: :func:`chunk_states`
(``sum_u x[u]^T b[u]`` per head), and the two products that are its
transposes, which the backward of :mod:`.ssd_pallas`'s chunk output uses
too. They read x, b and c where the model keeps them, sequence-major, and
keep the states as [batch, g, heads, chunks, p, n], the layout the
recurrence across chunks multiplies in: written as einsums, XLA transposes
[chunks, l, batch, g, heads, p] float32 blocks around each product and its
transpose (about 50 ms of a 1.4B training step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .layers import same_variance
from .pallas_gpu import plgpu
from .ssd_tiles import Tiling, precision_of, tiling_of, unsupported_reason

__all__ = ["chunk_states", "state_outer", "state_rows", "state_group"]


# The state products. Per (chunk, batch, group, head), with S that head's
# [p, n] state of the chunk:
#   state_outer:  S = sum_u x[u]^T b[u]            (x [l, p], b [l, n])
#   state_rows:   out[t] = c[t] · S^T              (c [l, n] -> [l, p])
#   state_group:  out[t] = sum_heads x_h[t] · S_h  (x [l, heads, p] -> [l, n])
#                 and, if asked, each head's sum_n c[t, n] (x_h[t] · S_h)[n]
# Each is the transpose of the other two. chunk_states is state_outer, its
# backward the other two; ssd_pallas.chunk_output's forward kernel computes
# the entering state's c[t] · S^T inline, its backward state_outer and
# state_group.

def _outer_kernel(x_ref, b_ref, s_ref, *, block, blocks):
    precision = precision_of(x_ref.dtype)

    def rows(i, acc):
        r = pl.ds(i * block, block)
        return acc + plgpu.dot(x_ref[r, :], b_ref[r, :], trans_a=True, precision=precision)

    s_ref[...] = lax.fori_loop(0, blocks, rows, jnp.zeros(s_ref.shape, jnp.float32))


def _rows_of_state_kernel(c_ref, s_ref, o_ref, *, block, blocks):
    state = s_ref[...].astype(c_ref.dtype)
    precision = precision_of(c_ref.dtype)

    def rows(i, carry):
        r = pl.ds(i * block, block)
        o_ref[r, :] = plgpu.dot(c_ref[r, :], state, trans_b=True, precision=precision)
        return carry

    lax.fori_loop(0, blocks, rows, None)


def _group_kernel(*refs, heads, row_sums):
    if row_sums:
        x_ref, s_ref, c_ref, o_ref, sums_ref = refs
        c = c_ref[...].astype(jnp.float32)
    else:
        x_ref, s_ref, o_ref = refs
    precision = precision_of(x_ref.dtype)
    head_ids = lax.broadcasted_iota(jnp.int32, (heads, o_ref.shape[0]), 0)

    def head(h, carry):
        acc, sums = carry
        product = plgpu.dot(x_ref[:, h, :], s_ref[h].astype(x_ref.dtype), precision=precision)
        if row_sums:
            sums = sums + jnp.where(head_ids == h, jnp.sum(c * product, axis=1)[None, :], 0.0)
        return acc + product, sums

    acc, sums = lax.fori_loop(0, heads, head, (jnp.zeros(o_ref.shape, jnp.float32),
                                               jnp.zeros(head_ids.shape, jnp.float32)))
    o_ref[...] = acc
    if row_sums:
        sums_ref[...] = sums


def _state_specs(x_shape, n: int, tiling: Tiling):
    """BlockSpecs over the grid (chunk, batch, group, head) and, for
    ``_group``, (chunk, batch, group, row block)."""
    _, _, _, heads, p = x_shape
    chunk_size, block = tiling.chunk_size, tiling.block
    blocks = chunk_size // block
    return dict(
        x=pl.BlockSpec((chunk_size, None, None, None, p), lambda c, b, g, h: (c, b, g, h, 0)),
        bc=pl.BlockSpec((chunk_size, None, None, n), lambda c, b, g, h: (c, b, g, 0)),
        state=pl.BlockSpec((None, None, None, None, p, n), lambda c, b, g, h: (b, g, h, c, 0, 0)),
        group_x=pl.BlockSpec((block, None, None, heads, p),
                             lambda c, b, g, i: (c * blocks + i, b, g, 0, 0)),
        group_state=pl.BlockSpec((None, None, heads, None, p, n),
                                 lambda c, b, g, i: (b, g, 0, c, 0, 0)),
        group_out=pl.BlockSpec((block, None, None, n),
                               lambda c, b, g, i: (c * blocks + i, b, g, 0)),
    )


def state_outer(x, b, tiling: Tiling):
    """[s, batch, g, heads, p], [s, batch, g, n] -> [batch, g, heads, chunks, p, n] float32."""
    s, batch, groups, heads, p = x.shape
    n, chunks = b.shape[-1], s // tiling.chunk_size
    spec = _state_specs(x.shape, n, tiling)
    (x, b), varying = same_variance(x, b)
    return pl.pallas_call(
        functools.partial(_outer_kernel, block=tiling.block,
                          blocks=tiling.chunk_size // tiling.block),
        grid=(chunks, batch, groups, heads),
        in_specs=[spec["x"], spec["bc"]],
        out_specs=spec["state"],
        out_shape=jax.ShapeDtypeStruct((batch, groups, heads, chunks, p, n), jnp.float32,
                                       manual_axis_type=varying),
        **tiling.params(),
        name="ssd_chunk_states",
    )(x, b)


def state_rows(c, state, tiling: Tiling):
    """[s, batch, g, n], [batch, g, heads, chunks, p, n] -> [s, batch, g, heads, p] float32."""
    s, batch, groups, n = c.shape
    heads, p = state.shape[2], state.shape[4]
    x_shape = (s, batch, groups, heads, p)
    spec = _state_specs(x_shape, n, tiling)
    (c, state), varying = same_variance(c, state)
    return pl.pallas_call(
        functools.partial(_rows_of_state_kernel, block=tiling.block,
                          blocks=tiling.chunk_size // tiling.block),
        grid=(s // tiling.chunk_size, batch, groups, heads),
        in_specs=[spec["bc"], spec["state"]],
        out_specs=spec["x"],
        out_shape=jax.ShapeDtypeStruct(x_shape, jnp.float32, manual_axis_type=varying),
        **tiling.params(),
        name="ssd_state_rows",
    )(c, state)


def state_group(x, state, tiling: Tiling, row_sums_with=None):
    """[s, batch, g, heads, p], [batch, g, heads, chunks, p, n] -> [s, batch, g, n] float32;
    with ``row_sums_with`` c [s, batch, g, n] also [batch, g, heads, s] float32, each
    head's ``sum_n c[t, n] (x_h[t] · S_h)[n]``."""
    s, batch, groups, heads, _ = x.shape
    n, blocks = state.shape[-1], tiling.chunk_size // tiling.block
    spec = _state_specs(x.shape, n, tiling)
    operands = (x, state) if row_sums_with is None else (x, state, row_sums_with)
    operands, varying = same_variance(*operands)
    result = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    in_specs, out_specs = [spec["group_x"], spec["group_state"]], [spec["group_out"]]
    out_shape = [result((s, batch, groups, n), jnp.float32)]
    if row_sums_with is not None:
        in_specs.append(spec["group_out"])
        out_specs.append(pl.BlockSpec((None, None, heads, tiling.block),
                                      lambda c, b, g, i: (b, g, 0, c * blocks + i)))
        out_shape.append(result((batch, groups, heads, s), jnp.float32))
    out = pl.pallas_call(
        functools.partial(_group_kernel, heads=heads, row_sums=row_sums_with is not None),
        grid=(s // tiling.chunk_size, batch, groups, blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        **tiling.params(),
        name="ssd_state_group_rows",
    )(*operands)
    return out[0] if row_sums_with is None else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _chunk_states(x, b, tiling):
    return state_outer(x, b, tiling)


def _chunk_states_fwd(x, b, tiling):
    return state_outer(x, b, tiling), (x, b)


def _chunk_states_bwd(tiling, residuals, d_state):
    x, b = residuals
    d_state = d_state.astype(x.dtype)
    return (state_rows(b, d_state, tiling).astype(x.dtype),
            state_group(x, d_state, tiling).astype(b.dtype))


_chunk_states.defvjp(_chunk_states_fwd, _chunk_states_bwd)


def chunk_states(x: jax.Array, b: jax.Array, *, chunk_size: int, block: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 interpret: bool = False) -> jax.Array:
    """Each chunk's ``sum_u x[u]^T b[u]`` per head, differentiable, on the GPU.

    With x already weighted by ``dt[u]·exp(cum[l-1] - cum[u])``, the state
    each chunk of the SSD leaves.

    Args:
      x: [s, batch, g, heads, p] (bf16 or float32), s = chunks · l.
      b: [s, batch, g, n], the same dtype.
      chunk_size: l.
      block, num_warps, num_stages, interpret: as :func:`chunk_output`'s.

    Returns:
      [batch, g, heads, chunks, p, n] float32.
    """
    s, _, _, heads, p = x.shape
    tiling = tiling_of("chunk_states", s, chunk_size,
                     unsupported_reason(chunk_size, p, heads, b.shape[-1]), block, num_warps,
                     interpret, num_stages)
    return _chunk_states(x, b, tiling)
