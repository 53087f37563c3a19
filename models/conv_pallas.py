"""Mamba-2's causal depthwise convolution and SiLU as one Pallas (Triton) GPU kernel.

``silu(bias + sum_i w[i] x[t - (k-1) + i])`` per channel, forward and
backward. Written with XLA ops, the backward recomputes the convolution in
one pass and reduces the weight's gradient over the sequence in another
(about 15 ms of the 1.4B training step on one H200, scanned layers). Here
one kernel recomputes the pre-activation, writes its gradient and the
weight's and bias's partial sums per block of rows; the input's gradient,
a shifted sum like the forward, stays with XLA.

The input is padded with k-1 zero rows in front (and zeros up to whole
blocks at the end), so that every load starts inside the array: nothing
depends on masked loads before row 0.

Opt-in (``MambaConfig.conv_impl="pallas"``): correct on an H200, but the
1.4B step took 285.9 ms with it against 279.6 with XLA's ops (one process,
docs/results.md), so where its time goes is the next thing to profile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .layers import same_variance
from .pallas_gpu import plgpu, require_runnable

__all__ = ["causal_conv1d_silu", "unsupported_reason"]

_ROWS = 64
_MAX_CHANNELS = 128


def unsupported_reason(channels: int, width: int) -> str | None:
    """Why the kernel cannot run a convolution, or None when it can."""
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    if width & (width - 1):
        return f"conv_width={width} is not a power of two"
    if channels % 16:
        return f"{channels} channels is not a multiple of 16"
    return None


def _channel_block(channels: int) -> int:
    block = _MAX_CHANNELS
    while channels % block:
        block //= 2
    return block


def _pre_activation(xp_ref, w_ref, b_ref, width):
    """This program's [rows, channels] pre-activation in float32, and the k
    shifted tiles of the padded input it summed."""
    row0 = pl.program_id(0) * _ROWS
    tiles = [xp_ref[pl.ds(row0 + i, _ROWS), :].astype(jnp.float32) for i in range(width)]
    pre = b_ref[...].astype(jnp.float32)[None, :] + sum(
        w_ref[i, :].astype(jnp.float32)[None, :] * tile for i, tile in enumerate(tiles))
    return pre, tiles


def _forward_kernel(xp_ref, w_ref, b_ref, y_ref, *, width):
    pre, _ = _pre_activation(xp_ref, w_ref, b_ref, width)
    y_ref[...] = (pre * jax.nn.sigmoid(pre)).astype(y_ref.dtype)


def _backward_kernel(xp_ref, w_ref, b_ref, dy_ref, dpre_ref, dw_ref, db_ref, *, width):
    pre, tiles = _pre_activation(xp_ref, w_ref, b_ref, width)
    gate = jax.nn.sigmoid(pre)
    dpre = dy_ref[...].astype(jnp.float32) * gate * (1.0 + pre * (1.0 - gate))
    dpre_ref[...] = dpre.astype(dpre_ref.dtype)
    db_ref[...] = jnp.sum(dpre, axis=0)
    for i, tile in enumerate(tiles):
        dw_ref[i, :] = jnp.sum(dpre * tile, axis=0)


def _specs(padded_rows: int, channels: int, width: int):
    """BlockSpecs over the grid (row block, batch, channel block), and the
    channel block's width."""
    cb = _channel_block(channels)
    return dict(
        padded=pl.BlockSpec((padded_rows, None, cb), lambda j, b, c: (0, b, c)),
        weight=pl.BlockSpec((width, cb), lambda j, b, c: (0, c)),
        bias=pl.BlockSpec((cb,), lambda j, b, c: (c,)),
        rows=pl.BlockSpec((_ROWS, None, cb), lambda j, b, c: (j, b, c)),
        partial_w=pl.BlockSpec((None, None, width, cb), lambda j, b, c: (j, b, 0, c)),
        partial_b=pl.BlockSpec((None, None, cb), lambda j, b, c: (j, b, c)),
    ), cb


def _padded(x, width):
    """x [s, b, c] -> [blocks·ROWS + width - 1, b, c], k-1 zero rows in front."""
    s = x.shape[0]
    blocks = -(-s // _ROWS)
    return jnp.pad(x, ((width - 1, blocks * _ROWS - s), (0, 0), (0, 0))), blocks


def _forward(x, weight, bias, interpret):
    s, batch, channels = x.shape
    width = weight.shape[0]
    xp, blocks = _padded(x, width)
    spec, cb = _specs(xp.shape[0], channels, width)
    (xp, weight, bias), varying = same_variance(xp, weight, bias)
    y = pl.pallas_call(
        functools.partial(_forward_kernel, width=width),
        grid=(blocks, batch, channels // cb),
        in_specs=[spec["padded"], spec["weight"], spec["bias"]],
        out_specs=spec["rows"],
        out_shape=jax.ShapeDtypeStruct((blocks * _ROWS, batch, channels), x.dtype,
                                       manual_axis_type=varying),
        interpret=interpret,
        name="causal_conv1d_silu",
    )(xp, weight, bias)
    return y[:s]


def _backward(x, weight, bias, dy, interpret):
    s, batch, channels = x.shape
    width = weight.shape[0]
    xp, blocks = _padded(x, width)
    dy = jnp.pad(dy, ((0, blocks * _ROWS - s), (0, 0), (0, 0)))
    spec, cb = _specs(xp.shape[0], channels, width)
    (xp, weight, bias, dy), varying = same_variance(xp, weight, bias, dy)
    result = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    dpre, dw, db = pl.pallas_call(
        functools.partial(_backward_kernel, width=width),
        grid=(blocks, batch, channels // cb),
        in_specs=[spec["padded"], spec["weight"], spec["bias"], spec["rows"]],
        out_specs=[spec["rows"], spec["partial_w"], spec["partial_b"]],
        out_shape=[result((blocks * _ROWS, batch, channels), x.dtype),
                   result((blocks, batch, width, channels), jnp.float32),
                   result((blocks, batch, channels), jnp.float32)],
        interpret=interpret,
        name="causal_conv1d_silu_backward",
    )(xp, weight, bias, dy)
    # dx[t] = sum_i w[i] dpre[t + (k-1) - i]: the transposed convolution.
    dpre = jnp.pad(dpre[:s], ((0, width - 1), (0, 0), (0, 0)))
    dx = sum(weight[i].astype(jnp.float32) * dpre[width - 1 - i:width - 1 - i + s]
             .astype(jnp.float32) for i in range(width))
    return (dx.astype(x.dtype), dw.sum((0, 1)).astype(weight.dtype),
            db.sum((0, 1)).astype(bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_silu(x, weight, bias, interpret):
    return _forward(x, weight, bias, interpret)


def _conv_silu_fwd(x, weight, bias, interpret):
    return _forward(x, weight, bias, interpret), (x, weight, bias)


def _conv_silu_bwd(interpret, residuals, dy):
    return _backward(*residuals, dy, interpret)


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


def causal_conv1d_silu(x: jax.Array, weight: jax.Array, bias: jax.Array, *,
                       interpret: bool = False) -> jax.Array:
    """``silu(models.mamba.causal_conv1d(x, weight, bias))``, differentiable, on the GPU.

    Args:
      x: [s, b, c], the whole sequence (bf16 or float32).
      weight: [k, c], x's dtype; tap k-1 multiplies the current position.
      bias: [c], x's dtype.
      interpret: run the kernels in Pallas's interpreter (any backend; for tests).

    Returns:
      [s, b, c] in x's dtype; sums and the activation in float32.
    """
    require_runnable("conv_pallas.causal_conv1d_silu",
                     unsupported_reason(x.shape[-1], weight.shape[0]), interpret,
                     "use conv_impl='xla'")
    # Inside shard_map the parameters are the same on every data shard while x is
    # not: cast them to x's variance here, outside the custom_vjp, so that JAX
    # transposes the cast into the sum of their gradients over the shards.
    (x, weight, bias), _ = same_variance(x, weight, bias)
    return _conv_silu(x, weight, bias, interpret)
