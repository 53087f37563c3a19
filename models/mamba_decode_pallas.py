"""One decode step of Mamba-2's mixer between its two projections, as one
Pallas (Triton) GPU kernel.

From in_proj's output to the SSD's y, a decode step is the convolution over
the last k positions, its SiLU, the step size's softplus, the SSM state's
update and its product with C, and the skip. XLA runs that as about seven
kernels a layer of 1-2.5 µs each, a third of the 1.4B model's time per token
on one H200 (a profile of the decode loop), while the state
it reads and writes is 2 MiB a layer at batch 1, well under a microsecond
of HBM. Here one kernel does it all: each program takes one (batch row,
head, block of the head's channels), reads its channels of in_proj's output
and of the convolution state where they lie (no slices materialised
between the two), updates its part of the SSM state in place, and writes
y with the skip added and its channels of the next convolution state.

Opt-in (``MambaConfig.decode_mixer="pallas"``): correct on an H200, but
slower than XLA's fusions of the same step. 48 layers' steps at batch 1,
states carried and donated: XLA 3.79 µs a layer, the kernel 4.10 with 16
channels a program, 4.40 with 64; in the 1.4B model's decode loop the
first version lost 3-8% a token.

The convolution state is a ring of k rows, position t's input in row
t mod k, updated in place: a step reads the k-1 rows before its own and
writes its input over the row of position t-k, which no program reads. (A
shift of k-1 rows would make the program that writes a group's shared B
and C rows race the others reading them.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_flashoverlap.nn import same_variance

from .pallas_gpu import plgpu, require_runnable

__all__ = ["Layout", "mixer_step", "mixer_step_xla", "unsupported_reason"]

# Programs a call aims for: a head's channels are split into blocks (down to
# 16) until there are this many, so that batch 1 does not leave most SMs
# idle while a few stream the whole state.
_MIN_PROGRAMS = 512
_MIN_CHANNELS = 16
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
    if not (_is_pow2(p) and p >= _MIN_CHANNELS):
        return f"head_dim={p} is not a power of two from {_MIN_CHANNELS}"
    if not (_is_pow2(n) and n >= 16):
        return f"state_dim={n} is not a power of two from 16"
    if (hpg * p) % n:
        return (f"a group's x channels ({hpg}x{p}) are not a multiple of state_dim={n}, "
                f"so B and C do not start on a block")
    return None


def _channels(head_dim: int, whole_head_programs: int) -> int:
    """A head's channels per program: the whole head, halved while there
    are fewer than _MIN_PROGRAMS programs (``whole_head_programs`` with a
    program per head: batch × heads)."""
    channels = head_dim
    while channels > _MIN_CHANNELS and whole_head_programs * head_dim // channels < _MIN_PROGRAMS:
        channels //= 2
    return channels


def _kernel(pos_ref, x_new_ref, b_new_ref, c_new_ref, dt_ref, w_x_ref, w_b_ref, w_c_ref,
            bias_x_ref, bias_b_ref, bias_c_ref, dt_bias_ref, a_log_ref, skip_ref, conv_ref,
            h_ref, y_ref, conv_out_ref, h_out_ref, *, layout: Layout, width: int):
    hpg, p, n = layout
    # The state first: its load is the long one, and the rest does not need it.
    h = h_ref[...]                                                            # [channels, n]
    channels = x_new_ref.shape[-1]
    head_in_group = pl.program_id(1) % hpg
    block = pl.program_id(2)
    pos = pos_ref[()]
    x_at = head_in_group * p + block * channels
    # The ring's rows of positions pos-k+1 .. pos-1, oldest first, and pos's own.
    window_rows = [(pos + 1 + i) % width for i in range(width - 1)]
    own_row = pl.ds(pos % width, 1)

    def activated(start, size, new_ref, w_ref, b_ref):
        """silu(bias + sum_i w[i] window[i]) of ``size`` channels from ``start``, in float32."""
        rows = [conv_ref[pl.ds(r, 1), pl.ds(start, size)].reshape(size) for r in window_rows]
        rows.append(new_ref[...])
        pre = b_ref[...].astype(jnp.float32) + sum(
            w_ref[i].astype(jnp.float32) * row.astype(jnp.float32) for i, row in enumerate(rows))
        return pre * jax.nn.sigmoid(pre)

    x = activated(x_at, channels, x_new_ref, w_x_ref, bias_x_ref)            # [channels]
    b = activated(hpg * p, n, b_new_ref, w_b_ref, bias_b_ref)                 # [n]
    c = activated(hpg * p + n, n, c_new_ref, w_c_ref, bias_c_ref)

    dt = jax.nn.softplus(dt_ref[...].astype(jnp.float32) + dt_bias_ref[...])   # [1]
    decay = jnp.exp(-dt * jnp.exp(a_log_ref[...]))
    h = decay[:, None] * h + (dt * x)[:, None] * b[None, :]
    h_out_ref[...] = h
    y = jnp.sum(h * c[None, :], axis=1) + skip_ref[...] * x
    y_ref[...] = y.astype(y_ref.dtype)

    # This position's inputs, before the convolution, into its ring row.
    # (conv_out_ref is conv_ref's buffer: XLA aliases them.)
    conv_out_ref[own_row, pl.ds(x_at, channels)] = (
        x_new_ref[...][None, :].astype(conv_out_ref.dtype))

    @pl.when((head_in_group == 0) & (block == 0))
    def _():
        for start, new_ref in ((hpg * p, b_new_ref), (hpg * p + n, c_new_ref)):
            conv_out_ref[own_row, pl.ds(start, n)] = (
                new_ref[...][None, :].astype(conv_out_ref.dtype))


def mixer_step(zxbcdt: jax.Array, conv: jax.Array, conv_weight: jax.Array,
               conv_bias: jax.Array, dt_bias: jax.Array, a_log: jax.Array,
               d_skip: jax.Array, ssm: jax.Array, pos: jax.Array, layout: Layout, *,
               channels: int | None = None, num_warps: int = _NUM_WARPS,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One position of the mixer between in_proj and the gated norm.

    With ``x, B, C = silu(conv1d(window))`` of the new position, split per
    group, ``dt = softplus(dt + dt_bias)`` and ``a = -exp(a_log)``:
    ``h' = exp(dt·a) h + dt x ⊗ B``, ``y = h'·C + d_skip x``, in float32.

    Args:
      zxbcdt: [b, g, width], in_proj's output for the new position, per group
        ``[z, x, B, C, dt]`` (see :class:`Layout`).
      conv: [k, b, g·c], the convolution's inputs as a ring: position t's in
        row t mod k (c = a group's x, B and C channels); rows of positions
        pos-k+1 .. pos-1 filled (zeros before the sequence). Updated in
        place where the caller donates it.
      conv_weight: [k, g·c], tap k-1 multiplies the new position.
      conv_bias: [g·c].
      dt_bias, a_log, d_skip: [g·heads_per_group] float32.
      ssm: [b, g, heads_per_group, head_dim, state_dim] float32, the state
        before this position; updated in place where the caller donates it.
      pos: int32 scalar, the new position.
      layout: the per-group widths.
      channels: a head's channels per program (a power of two dividing
        head_dim; default: the whole head, fewer where that makes under
        512 programs). A tuning knob.
      num_warps: per program. A tuning knob.
      interpret: run the kernel in Pallas's interpreter (any backend; for tests).

    Returns:
      (y [b, g, heads_per_group, head_dim] in zxbcdt's dtype, the SSM state
      after this position, the ring with this position's inputs in row
      pos mod k).
    """
    require_runnable("mamba_decode_pallas.mixer_step", unsupported_reason(layout), interpret,
                     "use decode_mixer='xla'")
    hpg, p, n = layout
    batch, groups, _ = zxbcdt.shape
    width = conv_weight.shape[0]
    c = hpg * p + 2 * n
    heads = groups * hpg
    want = {"conv": (conv, (width, batch, groups * c)), "conv_bias": (conv_bias, (groups * c,)),
            "conv_weight": (conv_weight, (width, groups * c)),
            "zxbcdt": (zxbcdt, (batch, groups, 2 * hpg * p + 2 * n + hpg)),
            "ssm": (ssm, (batch, groups, hpg, p, n))}
    want.update({name: (t, (heads,)) for name, t in
                 (("dt_bias", dt_bias), ("a_log", a_log), ("d_skip", d_skip))})
    for name, (t, shape) in want.items():
        if t.shape != shape:
            raise ValueError(f"mamba_decode_pallas.mixer_step: {name} is {t.shape}, expected "
                             f"{shape} for zxbcdt {zxbcdt.shape} and {layout}")
    ch = channels or _channels(p, batch * heads)
    if not (_is_pow2(ch) and ch <= p):
        raise ValueError(f"mamba_decode_pallas.mixer_step: channels={ch} must be a power of "
                         f"two up to head_dim={p}")
    x_blocks, n_at = p // ch, hpg * p // n           # blocks of a head; B's block in n units
    conv = conv.reshape(width, batch, groups, c)
    conv_weight, conv_bias = conv_weight.reshape(width, groups, c), conv_bias.reshape(groups, c)
    ssm = ssm.reshape(batch, heads, p, n)
    args, varying = same_variance(jnp.asarray(pos, jnp.int32), zxbcdt, conv_weight, conv_bias,
                                  dt_bias, a_log, d_skip, conv, ssm)
    pos, zxbcdt, conv_weight, conv_bias, dt_bias, a_log, d_skip, conv, ssm = args

    def group_of(hd):
        return hd // hpg

    def x_block(hd, blk):  # in units of ch, within a group's conv channels
        return (hd % hpg) * x_blocks + blk

    new = [  # in_proj's x, B, C and dt of this program's head
        pl.BlockSpec((None, None, ch),
                     lambda bi, hd, blk: (bi, group_of(hd), hpg * x_blocks + x_block(hd, blk))),
        pl.BlockSpec((None, None, n), lambda bi, hd, blk: (bi, group_of(hd), 2 * n_at)),
        pl.BlockSpec((None, None, n), lambda bi, hd, blk: (bi, group_of(hd), 2 * n_at + 1)),
        pl.BlockSpec((None, None, 1), lambda bi, hd, blk: (
            bi, group_of(hd), 2 * hpg * p + 2 * n + hd % hpg))]
    weight = [
        pl.BlockSpec((width, None, ch), lambda bi, hd, blk: (0, group_of(hd), x_block(hd, blk))),
        pl.BlockSpec((width, None, n), lambda bi, hd, blk: (0, group_of(hd), n_at)),
        pl.BlockSpec((width, None, n), lambda bi, hd, blk: (0, group_of(hd), n_at + 1))]
    bias = [
        pl.BlockSpec((None, ch), lambda bi, hd, blk: (group_of(hd), x_block(hd, blk))),
        pl.BlockSpec((None, n), lambda bi, hd, blk: (group_of(hd), n_at)),
        pl.BlockSpec((None, n), lambda bi, hd, blk: (group_of(hd), n_at + 1))]
    per_head = pl.BlockSpec((1,), lambda bi, hd, blk: (hd,))
    # The group's whole ring (one operand, so that XLA can alias it): the
    # kernel reads and writes its channels at offsets.
    ring = pl.BlockSpec((width, None, None, c), lambda bi, hd, blk: (0, bi, group_of(hd), 0))
    state = pl.BlockSpec((None, None, ch, n), lambda bi, hd, blk: (bi, hd, blk, 0))
    out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    y, conv, ssm = pl.pallas_call(
        functools.partial(_kernel, layout=layout, width=width),
        grid=(batch, heads, x_blocks),
        in_specs=[pl.BlockSpec((), lambda bi, hd, blk: ()), *new, *weight, *bias,
                  per_head, per_head, per_head, ring, state],
        out_specs=[pl.BlockSpec((None, None, ch), lambda bi, hd, blk: (bi, hd, blk)), ring,
                   state],
        out_shape=[out((batch, heads, p), zxbcdt.dtype), out(conv.shape, conv.dtype),
                   out(ssm.shape, ssm.dtype)],
        input_output_aliases={14: 1, 15: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="mamba_decode_mixer",
    )(pos, zxbcdt, zxbcdt, zxbcdt, zxbcdt, conv_weight, conv_weight, conv_weight, conv_bias,
      conv_bias, conv_bias, dt_bias, a_log, d_skip, conv, ssm)
    return (y.reshape(batch, groups, hpg, p), ssm.reshape(batch, groups, hpg, p, n),
            conv.reshape(width, batch, groups * c))


def mixer_step_xla(zxbcdt: jax.Array, conv: jax.Array, conv_weight: jax.Array,
                   conv_bias: jax.Array, dt_bias: jax.Array, a_log: jax.Array,
                   d_skip: jax.Array, ssm: jax.Array, pos: jax.Array,
                   layout: Layout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`mixer_step` in XLA's ops, on any backend: its contract, for
    tests of the model's use of the kernel and as the baseline it is timed
    against (scripts/mamba_decode_mixer_probe.py). Same arguments and results."""
    hpg, p, n = layout
    batch, groups, _ = zxbcdt.shape
    width = conv.shape[0]
    f32 = jnp.float32
    xbc = zxbcdt[..., hpg * p:2 * hpg * p + 2 * n].reshape(batch, -1)      # [b, g·c]
    older = jnp.take(conv, (pos + 1 + jnp.arange(width - 1)) % width, axis=0)
    window = jnp.concatenate([older, xbc[None]]).astype(f32)               # oldest first
    pre = conv_bias.astype(f32) + sum(conv_weight[i].astype(f32) * window[i]
                                      for i in range(width))
    act = jax.nn.silu(pre).reshape(batch, groups, -1)
    x = act[..., :hpg * p].reshape(batch, groups, hpg, p)
    b, c = act[..., hpg * p:hpg * p + n], act[..., hpg * p + n:]
    dt = jax.nn.softplus(zxbcdt[..., -hpg:].astype(f32) + dt_bias.reshape(groups, hpg))
    decay = jnp.exp(-dt * jnp.exp(a_log.reshape(groups, hpg)))
    state = (decay[..., None, None] * ssm
             + (dt[..., None] * x)[..., None] * b[:, :, None, None, :])
    y = jnp.einsum("bghpn,bgn->bghp", state, c) + d_skip.reshape(groups, hpg, 1) * x
    conv = jax.lax.dynamic_update_slice(conv, xbc[None].astype(conv.dtype), (pos % width, 0, 0))
    return y.astype(zxbcdt.dtype), state, conv
