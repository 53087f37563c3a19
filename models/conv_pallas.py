"""Mamba-2's causal depthwise convolution, and in_proj's split around it,
with a backward that is one Pallas (Triton) GPU kernel.

In a Mamba-2 mixer in_proj's output holds, per B/C group, ``[z, x, B, C,
dt]``; x, B and C go through the causal convolution and its SiLU. Written
with XLA ops, the backward of that split, the three convolutions and their
SiLU takes several passes over the sequence: the SiLU's gradient of each
part, the weight's and bias's sums over the sequence (a two-stage
reduction), and the transposed convolution fused with the concatenation of
in_proj's output gradient. At Mamba-2 1.4B's shape (sequence 8192, one
H200) those passes cost about 22 ms of a 243 ms training step, moving the
data at 1.1-1.9 TB/s.

Here the forward stays XLA's (one convolution per part, each fused into
its consumers), and the backward is one kernel: each program takes a few
tiles of rows of one part's channels, recomputes the SiLU's gradient at the
k shifts the transposed convolution needs, and writes in_proj's output
gradient whole, with z's and dt's gradients copied into it, plus the
weight's and bias's partial sums (kept elementwise across its tiles,
summed once). At that shape the step took 241.1 ms with it against 247.3
with XLA's ops: ``conv_impl="auto"``,
the default, runs it on CUDA GPUs.

Each program reads only rows at and after its block's (the shifts the
transposed convolution and the weight's sums need both look ahead), masked
past the sequence's end.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from .layers import same_variance
from .mamba_config import CONV_IMPLS
from .pallas_gpu import plgpu, require_runnable

__all__ = ["CONV_NAME", "Layout", "causal_conv1d", "split_conv_silu", "unsupported_reason"]

# The checkpoint name of the convolutions' outputs before their SiLU: the
# backward needs them, and a block's jax.checkpoint policy keeps them.
CONV_NAME = "mamba_conv"
_BLOCK_ROWS = 16
_AUTO_MIN_ROWS = 16
_STEPS = 4
_MAX_CHANNELS = 128


class Layout(NamedTuple):
    """The columns of one B/C group in in_proj's output: ``heads · head_dim``
    of z, as many of x, ``state`` of B and of C, and ``heads`` of dt."""

    heads: int
    head_dim: int
    state: int

    @property
    def inner(self) -> int:
        """z's (and x's) columns."""
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: x, B and C."""
        return self.inner + 2 * self.state

    @property
    def width(self) -> int:
        """All of a group's columns."""
        return 2 * self.inner + 2 * self.state + self.heads

    def split(self, zxbcdt: jax.Array) -> list[jax.Array]:
        """[..., width] -> z [..., inner], the convolution's input [...,
        conv_channels] and dt [..., heads]."""
        return jnp.split(zxbcdt, [self.inner, self.inner + self.conv_channels], axis=-1)

    def parts(self, xbc: jax.Array) -> list[jax.Array]:
        """[..., conv_channels] -> x [..., inner], B and C [..., state]."""
        return jnp.split(xbc, [self.inner, self.inner + self.state], axis=-1)


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """Depthwise causal convolution along the sequence.

    Args:
      x: [s, b, *channels], the whole sequence.
      weight: [k, *channels]; tap k-1 multiplies the current position.
      bias: [*channels].

    Returns:
      [s, b, *channels]: ``y[t] = bias + sum_i weight[i] * x[t - (k-1) + i]``.
    """
    k, s = weight.shape[0], x.shape[0]
    padded = jnp.pad(x, ((k - 1, 0),) + ((0, 0),) * (x.ndim - 1))
    # k is small (4): k shifted multiply-adds that XLA fuses into one pass.
    return bias + sum(weight[i] * padded[i:i + s] for i in range(k))


def unsupported_reason(layout: Layout, width: int) -> str | None:
    """Why the backward kernel cannot run a layout and convolution width, or
    None when it can: Triton tiles have power-of-two sides."""
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    for name, value in (("conv_width", width), ("heads per group", layout.heads),
                        ("heads per group x head_dim", layout.inner),
                        ("state_dim", layout.state)):
        if value & (value - 1):
            return f"{name}={value} is not a power of two"
    if min(layout.inner, layout.state) < 16:
        return f"{min(layout.inner, layout.state)} channels per part is below 16"
    return None


def _forward(zxbcdt, weight, bias, layout: Layout):
    """(z, SiLU(x), SiLU(B), SiLU(C), dt) and the three pre-activations."""
    z, xbc, dt = layout.split(zxbcdt)
    groups = zxbcdt.shape[2]
    # One convolution per part, each written where its consumer reads it: a
    # convolution over all channels made XLA copy x, B and C out of its
    # output.
    pre = [checkpoint_name(causal_conv1d(*part), CONV_NAME) for part in zip(
        layout.parts(xbc), layout.parts(weight.reshape(-1, groups, layout.conv_channels)),
        layout.parts(bias.reshape(groups, layout.conv_channels)))]
    return (z, *map(jax.nn.silu, pre), dt), pre


def _silu_grad_at(pre_ref, dact_ref, rows, local, channels: int, s: int, approx: bool):
    """[rows, channels] float32 gradient of the pre-activation at the
    contiguous ``rows`` (a pl.ds), zero past the sequence. ``approx``: the
    sigmoid through the GPU's one-instruction tanh (relative error about
    2^-11, below a 16-bit pre-activation's own rounding)."""
    valid = (rows.start + lax.broadcasted_iota(jnp.int32, (rows.size,), 0) < s)[:, None]
    cols = pl.ds(local, channels)
    pre = plgpu.load(pre_ref.at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
    dact = plgpu.load(dact_ref.at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
    gate = 0.5 + 0.5 * plgpu.approx_tanh(0.5 * pre) if approx else jax.nn.sigmoid(pre)
    return dact * gate * (1.0 + pre * (1.0 - gate))


def _backward_kernel(zx_ref, w_ref, pre_x_ref, pre_b_ref, pre_c_ref, dz_ref, dx_ref, db_ref,
                     dc_ref, ddt_ref, out_ref, dw_ref, dbias_ref, *, layout: Layout,
                     block_rows: int, steps: int, channels: int, width: int, s: int,
                     approx: bool):
    """``steps`` blocks of ``block_rows`` rows, and ``channels`` convolution
    channels of one group: in_proj's output gradient there, and the weight's
    and bias's sums over those rows."""
    program_row = pl.program_id(0) * block_rows * steps
    first = pl.program_id(3) * channels  # among the group's convolution channels
    inner, state = layout.inner, layout.state
    tile = (block_rows, channels)

    def part(pre_ref, dact_ref, local):
        # Only rows at and after the block's are read (a load starting
        # before row 0 would shift in Pallas's interpreter): with u = t-(k-1)+i,
        #   dx[u] = sum_j w[k-1-j] · dpre[u + j],
        #   dw[k-1-j] = sum_u x[u] · dpre[u + j].
        taps = [w_ref[width - 1 - shift, pl.ds(first, channels)].astype(jnp.float32)[None, :]
                for shift in range(width)]

        def block(step, sums):
            row = step * block_rows
            x = zx_ref[pl.ds(program_row + row, block_rows), pl.ds(inner + first, channels)]
            x = x.astype(jnp.float32)
            dxbc = jnp.zeros(tile, jnp.float32)
            sums = list(sums)
            for shift in range(width):
                dpre = _silu_grad_at(pre_ref, dact_ref, pl.ds(program_row + row + shift,
                                                              block_rows),
                                     local, channels, s, approx)
                dxbc += taps[shift] * dpre
                sums[shift] += x * dpre
                if shift == 0:
                    sums[width] += dpre
            out_ref[pl.ds(row, block_rows), pl.ds(inner + first, channels)] = (
                dxbc.astype(out_ref.dtype))
            return tuple(sums)

        # Summed elementwise over the blocks, across rows once at the end.
        sums = lax.fori_loop(0, steps, block, (jnp.zeros(tile, jnp.float32),) * (width + 1))
        for shift in range(width):
            dw_ref[width - 1 - shift, :] = jnp.sum(sums[shift], axis=0)
        dbias_ref[...] = jnp.sum(sums[width], axis=0)

    @pl.when(first < inner)
    def _x():
        part(pre_x_ref, dx_ref, first)
        out_ref[:, pl.ds(first, channels)] = dz_ref[:, pl.ds(first, channels)]

    @pl.when((first >= inner) & (first < inner + state))
    def _b():
        part(pre_b_ref, db_ref, first - inner)

    @pl.when(first == inner)  # B's first channel block also copies dt's gradient
    def _dt():
        out_ref[:, pl.ds(inner + layout.conv_channels, layout.heads)] = (
            ddt_ref[...].astype(out_ref.dtype))

    @pl.when(first >= inner + state)
    def _c():
        part(pre_c_ref, dc_ref, first - inner - state)


def _channel_block(layout: Layout) -> int:
    block = _MAX_CHANNELS
    while layout.inner % block or layout.state % block:
        block //= 2
    return block


class _Kernel(NamedTuple):
    """The backward kernel's static settings (see :func:`split_conv_silu`)."""

    layout: Layout
    interpret: bool = False
    block_rows: int | None = None
    num_warps: int | None = None
    steps: int | None = None
    by_platform: bool = False  # the kernel on CUDA GPUs, XLA's ops elsewhere


def _kernel_backward(kernel: _Kernel, residuals, cotangents):
    layout = kernel.layout
    zxbcdt, weight, bias, *pre = residuals
    s, batch, groups, _ = zxbcdt.shape
    width = weight.shape[0]
    channels = _channel_block(layout)
    # The largest power of two dividing s, at most the asked rows.
    block_rows = min(kernel.block_rows or _BLOCK_ROWS, s & -s)
    # Tiles per program: a power of two dividing the tiles, so that a
    # program's rows (its z and dt copies) are a power of two too.
    steps = min(kernel.steps or _STEPS, (s // block_rows) & -(s // block_rows))
    program_rows = block_rows * steps
    blocks, conv_blocks = s // program_rows, layout.conv_channels // channels
    operands, varying = same_variance(zxbcdt, weight, *pre, *cotangents)

    def sequence(cols):
        return pl.BlockSpec((s, None, None, cols), lambda r, b, g, c: (0, b, g, 0))

    def row_block(cols):
        return pl.BlockSpec((program_rows, None, None, cols), lambda r, b, g, c: (r, b, g, 0))

    result = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    d_zxbcdt, dw, dbias = pl.pallas_call(
        functools.partial(_backward_kernel, layout=layout, block_rows=block_rows, steps=steps,
                          channels=channels, width=width, s=s,
                          approx=not kernel.interpret and jnp.dtype(pre[0].dtype).itemsize < 4),
        grid=(blocks, batch, groups, conv_blocks),
        in_specs=[sequence(layout.width),
                  pl.BlockSpec((width, layout.conv_channels), lambda r, b, g, c: (0, g)),
                  sequence(layout.inner), sequence(layout.state), sequence(layout.state),
                  row_block(layout.inner), sequence(layout.inner), sequence(layout.state),
                  sequence(layout.state), row_block(layout.heads)],
        out_specs=[row_block(layout.width),
                   pl.BlockSpec((None, None, width, channels),
                                lambda r, b, g, c: (r, b, 0, g * conv_blocks + c)),
                   pl.BlockSpec((None, None, channels),
                                lambda r, b, g, c: (r, b, g * conv_blocks + c))],
        out_shape=[result(zxbcdt.shape, zxbcdt.dtype),
                   result((blocks, batch, width, groups * layout.conv_channels), jnp.float32),
                   result((blocks, batch, groups * layout.conv_channels), jnp.float32)],
        interpret=kernel.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=kernel.num_warps),
        name="mamba_conv_backward",
    )(*operands)
    return d_zxbcdt, dw.sum((0, 1)).astype(weight.dtype), dbias.sum((0, 1)).astype(bias.dtype)


def _backward(kernel: _Kernel, residuals, cotangents):
    if not kernel.by_platform:
        return _kernel_backward(kernel, residuals, cotangents)

    def by_xla(*t):
        inputs, cts = t[:3], t[len(residuals):]
        return jax.vjp(lambda *u: _forward(*u, kernel.layout)[0], *inputs)[1](cts)

    return jax.lax.platform_dependent(
        *residuals, *cotangents, default=by_xla,
        cuda=lambda *t: _kernel_backward(kernel, t[:len(residuals)], t[len(residuals):]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _split_conv_silu(zxbcdt, weight, bias, kernel: _Kernel):
    return _forward(zxbcdt, weight, bias, kernel.layout)[0]


def _split_conv_silu_fwd(zxbcdt, weight, bias, kernel: _Kernel):
    out, pre = _forward(zxbcdt, weight, bias, kernel.layout)
    return out, (zxbcdt, weight, bias, *pre)


_split_conv_silu.defvjp(_split_conv_silu_fwd, _backward)


def split_conv_silu(zxbcdt: jax.Array, weight: jax.Array, bias: jax.Array, layout: Layout, *,
                    impl: str = "pallas", block_rows: int | None = None,
                    steps: int | None = None, num_warps: int | None = None,
                    interpret: bool = False) -> tuple[jax.Array, ...]:
    """in_proj's output split, with SiLU of the causal convolution of x, B and
    C; differentiable.

    Args:
      zxbcdt: [s, b, g, layout.width], in_proj's output by B/C group.
      weight: [k, g · layout.conv_channels], zxbcdt's dtype; per group x's,
        B's and C's channels, tap k-1 multiplying the current position.
      bias: [g · layout.conv_channels], zxbcdt's dtype.
      layout: the group's columns.
      impl: the backward: "pallas", the GPU kernel; "xla", XLA's ops
        (autodiff of the same forward); or "auto", the kernel where it can
        run the layout, compiled for a CUDA GPU, else XLA's ops.
      block_rows: the kernel's rows per tile, a power of two (default 16;
        at most the largest power of two dividing s).
      steps: tiles per program, one after the other, a power of two
        (default 4; at most the largest power of two dividing the
        sequence's tiles).
      num_warps: the kernel's warps per program (default Triton's, 4).
      interpret: run the backward kernel in Pallas's interpreter (any
        backend; for tests).

    Returns:
      z [s, b, g, inner], SiLU(conv(x)) [s, b, g, inner], SiLU(conv(B)) and
      SiLU(conv(C)) [s, b, g, state], dt [s, b, g, heads], all in zxbcdt's
      dtype. The convolutions' outputs before the SiLU are named
      :data:`CONV_NAME` for a block's checkpoint policy.
    """
    if zxbcdt.shape[-1] != layout.width:
        raise ValueError(f"conv_pallas.split_conv_silu: zxbcdt has {zxbcdt.shape[-1]} columns "
                         f"per group, and the layout {layout} has {layout.width}")
    if impl not in CONV_IMPLS:
        raise ValueError(f"conv_pallas.split_conv_silu: impl must be one of {CONV_IMPLS}, "
                         f"got {impl!r}")
    reason = unsupported_reason(layout, weight.shape[0])
    s = zxbcdt.shape[0]
    # "auto" leaves sequences to XLA that only split into tiles of fewer than
    # 16 rows (where the kernel is not measured), as every op does an empty one.
    if impl == "xla" or s == 0 or (impl == "auto" and (reason or s & -s < _AUTO_MIN_ROWS)):
        return _forward(zxbcdt, weight, bias, layout)[0]
    if impl == "pallas":
        require_runnable("conv_pallas.split_conv_silu", reason, interpret, "use conv_impl='xla'")
    # Inside shard_map the parameters are the same on every data shard while
    # zxbcdt is not: cast them to its variance here, outside the custom_vjp,
    # so that JAX transposes the cast into the sum of their gradients.
    (zxbcdt, weight, bias), _ = same_variance(zxbcdt, weight, bias)
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
        raise ValueError(f"conv_pallas.split_conv_silu: block_rows={block_rows} is not a "
                         f"power of two")
    if steps is not None and (steps < 1 or steps & (steps - 1)):
        raise ValueError(f"conv_pallas.split_conv_silu: steps={steps} is not a power of two")
    return _split_conv_silu(zxbcdt, weight, bias, _Kernel(layout, interpret, block_rows,
                                                          num_warps, steps, impl == "auto"))
