"""One decode step of Mamba-2's mixer between its two projections, as one
Pallas (Triton) GPU kernel.

From in_proj's output to the SSD's y, a decode step is the convolution over
the last k positions, its SiLU, the step size's softplus, the SSM state's
update and its product with C, and the skip. XLA runs that as about seven
kernels a layer of 1-2.5 µs each, a third of the 1.4B model's time per token
on one H200 (docs/measurements.md, session 28's profile), while the state
it reads and writes is 2 MiB a layer at batch 1, well under a microsecond
of HBM. Here one kernel does it all: each program takes one (batch row,
head, block of the head's channels), reads its channels of in_proj's output
and of the convolution state where they lie (no slices materialised
between the two), updates its part of the SSM state in place, and writes
y with the skip added and its channels of the next convolution state.

The convolution state is written to a new array, not in place: the heads
of a group share B and C, and one program writes the group's shifted B and
C rows while the others read the old ones.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_flashoverlap.nn import same_variance

from .pallas_gpu import plgpu, require_runnable

__all__ = ["Layout", "mixer_step", "unsupported_reason"]

# Channels of a head a program takes: the whole head up to this, so that
# batch 1 still spreads over about as many programs as the GPU has SMs.
_MAX_CHANNELS = 64
_NUM_WARPS = 4


class Layout(NamedTuple):
    """How in_proj's output and the convolution's channels are laid out per
    group (``models.mamba.Mamba2Mixer``): in_proj gives ``[z, x, B, C, dt]``
    of widths ``heads_per_group·head_dim``, the same, ``state_dim`` twice
    and ``heads_per_group``; the convolution's channels are ``[x, B, C]``."""

    heads_per_group: int
    head_dim: int
    state_dim: int


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def unsupported_reason(layout: Layout) -> str | None:
    """Why the kernel cannot run this layout, or None when it can."""
    hpg, p, n = layout
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    if not (_is_pow2(p) and p >= 16):
        return f"head_dim={p} is not a power of two from 16"
    if not (_is_pow2(n) and n >= 16):
        return f"state_dim={n} is not a power of two from 16"
    if (hpg * p) % n:
        return (f"a group's x channels ({hpg}x{p}) are not a multiple of state_dim={n}, "
                f"so B and C do not start on a block")
    return None


def _channels(p: int) -> int:
    return min(p, _MAX_CHANNELS)


def _conv(rows_ref, new, w_ref, b_ref, width):
    """bias + sum_i w[i] * window[i] over the k-1 stored rows and the new
    one, in float32: ([channels] pre-activation, the window's rows)."""
    rows = [rows_ref[i].astype(jnp.float32) for i in range(width - 1)] + [new]
    pre = b_ref[...].astype(jnp.float32) + sum(
        w_ref[i].astype(jnp.float32) * row for i, row in enumerate(rows))
    return pre, rows


def _kernel(x_new_ref, b_new_ref, c_new_ref, dt_ref, conv_x_ref, conv_b_ref, conv_c_ref,
            w_x_ref, w_b_ref, w_c_ref, bias_x_ref, bias_b_ref, bias_c_ref, dt_bias_ref,
            a_log_ref, skip_ref, h_ref, y_ref, h_out_ref, conv_out_ref, *, layout: Layout,
            width: int):
    hpg, p, n = layout
    channels = x_new_ref.shape[-1]
    head_in_group = pl.program_id(1) % hpg
    block = pl.program_id(2)

    def activated(rows_ref, new_ref, w_ref, b_ref):
        pre, rows = _conv(rows_ref, new_ref[...].astype(jnp.float32), w_ref, b_ref, width)
        return pre * jax.nn.sigmoid(pre), rows

    x, x_rows = activated(conv_x_ref, x_new_ref, w_x_ref, bias_x_ref)       # [channels]
    b, _ = activated(conv_b_ref, b_new_ref, w_b_ref, bias_b_ref)            # [n]
    c, _ = activated(conv_c_ref, c_new_ref, w_c_ref, bias_c_ref)

    dt = jax.nn.softplus(dt_ref[...].astype(jnp.float32) + dt_bias_ref[...])   # [1]
    decay = jnp.exp(-dt * jnp.exp(a_log_ref[...]))
    h = (decay[:, None] * h_ref[...]
         + (dt * x)[:, None] * b[None, :])                                    # [channels, n]
    h_out_ref[...] = h
    y = jnp.sum(h * c[None, :], axis=1) + skip_ref[...] * x
    y_ref[...] = y.astype(y_ref.dtype)

    # The next state: the window's last k-1 inputs, before the convolution.
    x_at = pl.ds(head_in_group * p + block * channels, channels)
    for i in range(width - 1):
        conv_out_ref[i, x_at] = x_rows[i + 1].astype(conv_out_ref.dtype)

    @pl.when((head_in_group == 0) & (block == 0))
    def _():
        for start, rows_ref, new_ref in ((hpg * p, conv_b_ref, b_new_ref),
                                         (hpg * p + n, conv_c_ref, c_new_ref)):
            at = pl.ds(start, n)
            for i in range(width - 2):
                conv_out_ref[i, at] = rows_ref[i + 1]
            conv_out_ref[width - 2, at] = new_ref[...].astype(conv_out_ref.dtype)


def mixer_step(zxbcdt: jax.Array, conv: jax.Array, conv_weight: jax.Array,
               conv_bias: jax.Array, dt_bias: jax.Array, a_log: jax.Array,
               d_skip: jax.Array, ssm: jax.Array, layout: Layout, *,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One position of the mixer between in_proj and the gated norm.

    With ``x, B, C = silu(conv1d([conv; xBC]))[-1]`` split per group,
    ``dt = softplus(dt + dt_bias)`` and ``a = -exp(a_log)``:
    ``h' = exp(dt·a) h + dt x ⊗ B``, ``y = h'·C + d_skip x``, in float32.

    Args:
      zxbcdt: [b, g, width], in_proj's output for the new position, per group
        ``[z, x, B, C, dt]`` (see :class:`Layout`).
      conv: [k-1, b, g·c], the convolution's last k-1 inputs, c = the
        group's x, B and C channels.
      conv_weight: [k, g·c], tap k-1 multiplies the new position.
      conv_bias: [g·c].
      dt_bias, a_log, d_skip: [g·heads_per_group] float32.
      ssm: [b, g, heads_per_group, head_dim, state_dim] float32, the state
        before this position; updated in place where the caller donates it.
      layout: the per-group widths.
      interpret: run the kernel in Pallas's interpreter (any backend; for tests).

    Returns:
      (y [b, g, heads_per_group, head_dim] in zxbcdt's dtype, the SSM state
      after this position, the convolution state [k-1, b, g·c] after it).
    """
    require_runnable("mamba_decode_pallas.mixer_step", unsupported_reason(layout), interpret,
                     "use decode_mixer='xla'")
    hpg, p, n = layout
    batch, groups, _ = zxbcdt.shape
    width = conv_weight.shape[0]
    c = hpg * p + 2 * n
    heads = groups * hpg
    want = {"conv": (conv, (width - 1, batch, groups * c)), "conv_bias": (conv_bias, (groups * c,)),
            "conv_weight": (conv_weight, (width, groups * c)),
            "zxbcdt": (zxbcdt, (batch, groups, 2 * hpg * p + 2 * n + hpg)),
            "ssm": (ssm, (batch, groups, hpg, p, n))}
    want.update({name: (t, (heads,)) for name, t in
                 (("dt_bias", dt_bias), ("a_log", a_log), ("d_skip", d_skip))})
    for name, (t, shape) in want.items():
        if t.shape != shape:
            raise ValueError(f"mamba_decode_pallas.mixer_step: {name} is {t.shape}, expected "
                             f"{shape} for zxbcdt {zxbcdt.shape} and {layout}")
    ch = _channels(p)
    x_blocks, n_at = p // ch, hpg * p // n           # blocks of a head; B's block in n units
    conv = conv.reshape(width - 1, batch, groups, c)
    conv_weight, conv_bias = conv_weight.reshape(width, groups, c), conv_bias.reshape(groups, c)
    ssm = ssm.reshape(batch, heads, p, n)
    args, varying = same_variance(zxbcdt, conv, conv_weight, conv_bias, dt_bias, a_log,
                                  d_skip, ssm)

    def group_of(hd):
        return hd // hpg

    def x_block(hd, blk):  # in units of ch, within a group's conv channels
        return (hd % hpg) * x_blocks + blk

    new = dict(
        x=pl.BlockSpec((None, None, ch),
                       lambda bi, hd, blk: (bi, group_of(hd), hpg * x_blocks + x_block(hd, blk))),
        b=pl.BlockSpec((None, None, n), lambda bi, hd, blk: (bi, group_of(hd), 2 * n_at)),
        c=pl.BlockSpec((None, None, n), lambda bi, hd, blk: (bi, group_of(hd), 2 * n_at + 1)),
        dt=pl.BlockSpec((None, None, 1), lambda bi, hd, blk: (
            bi, group_of(hd), 2 * hpg * p + 2 * n + hd % hpg)))
    state = dict(
        x=pl.BlockSpec((width - 1, None, None, ch),
                       lambda bi, hd, blk: (0, bi, group_of(hd), x_block(hd, blk))),
        b=pl.BlockSpec((width - 1, None, None, n),
                       lambda bi, hd, blk: (0, bi, group_of(hd), n_at)),
        c=pl.BlockSpec((width - 1, None, None, n),
                       lambda bi, hd, blk: (0, bi, group_of(hd), n_at + 1)))
    weight = dict(
        x=pl.BlockSpec((width, None, ch), lambda bi, hd, blk: (0, group_of(hd), x_block(hd, blk))),
        b=pl.BlockSpec((width, None, n), lambda bi, hd, blk: (0, group_of(hd), n_at)),
        c=pl.BlockSpec((width, None, n), lambda bi, hd, blk: (0, group_of(hd), n_at + 1)))
    bias = dict(
        x=pl.BlockSpec((None, ch), lambda bi, hd, blk: (group_of(hd), x_block(hd, blk))),
        b=pl.BlockSpec((None, n), lambda bi, hd, blk: (group_of(hd), n_at)),
        c=pl.BlockSpec((None, n), lambda bi, hd, blk: (group_of(hd), n_at + 1)))
    per_head = pl.BlockSpec((1,), lambda bi, hd, blk: (hd,))
    state_block = pl.BlockSpec((None, None, ch, n), lambda bi, hd, blk: (bi, hd, blk, 0))
    zxbcdt, conv, conv_weight, conv_bias, dt_bias, a_log, d_skip, ssm = args
    out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    y, ssm, conv = pl.pallas_call(
        functools.partial(_kernel, layout=layout, width=width),
        grid=(batch, heads, x_blocks),
        in_specs=[new["x"], new["b"], new["c"], new["dt"], state["x"], state["b"], state["c"],
                  weight["x"], weight["b"], weight["c"], bias["x"], bias["b"], bias["c"],
                  per_head, per_head, per_head, state_block],
        out_specs=[pl.BlockSpec((None, None, ch), lambda bi, hd, blk: (bi, hd, blk)),
                   state_block,
                   pl.BlockSpec((width - 1, None, None, c),
                                lambda bi, hd, blk: (0, bi, group_of(hd), 0))],
        out_shape=[out((batch, heads, p), zxbcdt.dtype), out(ssm.shape, ssm.dtype),
                   out(conv.shape, conv.dtype)],
        input_output_aliases={16: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
        name="mamba_decode_mixer",
    )(zxbcdt, zxbcdt, zxbcdt, zxbcdt, conv, conv, conv, conv_weight, conv_weight,
      conv_weight, conv_bias, conv_bias, conv_bias, dt_bias, a_log, d_skip, ssm)
    return (y.reshape(batch, groups, hpg, p), ssm.reshape(batch, groups, hpg, p, n),
            conv.reshape(width - 1, batch, groups * c))
