"""The gated grouped RMSNorm as Pallas (Triton) GPU kernels, forward and backward.

``weight · y / rms(y)`` with ``y = x · silu(gate)``, each group of channels
normalised on its own (Mamba-2's norm before out_proj; see
:func:`models.layers.rms_norm`). Written with XLA ops, the backward splits at
the group reductions: XLA writes float32 intermediates of the whole
activation between its fusions ([8192, 4096] float32 per layer at Mamba-2
1.4B's shape, sequence 8192) and reads them back, and recomputes the
forward's product for the backward. Here one program holds a block of rows
of one group in registers: the forward reads x and the gate once and writes
the output, the backward reads x, the gate and the output's gradient once
and writes both inputs' gradients and the weight's partial sums per block of
rows. Only the inputs are kept for the backward.

Each program's tile is [rows, group_size], so the group size must be a power
of two (a Triton tile's sides are).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_flashoverlap.nn import same_variance

from .pallas_gpu import plgpu, require_runnable

__all__ = ["AUTO_MIN_ROWS", "Tiling", "gated_rms_norm", "gated_rms_norm_or",
           "unsupported_reason"]

# Rows (tokens) from which norm_backward="auto" runs the kernels: training and
# prefill, with thousands, gained; a decode
# step's few rows keep XLA's ops, which fuse the norm with its neighbours, as
# they ran when the decode loop was measured. The crossover is not measured.
AUTO_MIN_ROWS = 1024

# Rows of a group per program and warps, by default: of rows 4-32 x 4 or 8
# warps at Mamba-2 1.4B's gated norm (groups of 512) on one H200, 4 rows
# with 8 warps had the fastest forward + backward in two sweeps, about 8%
# faster than 16 rows.
_ROWS = 4
_NUM_WARPS = 8


class Tiling(NamedTuple):
    """How the kernels cut the rows: ``rows`` rows of one group per program,
    ``num_warps`` warps each; ``interpret`` runs them in Pallas's interpreter."""

    group_size: int
    rows: int
    num_warps: int
    interpret: bool = False


def unsupported_reason(dim: int, group_size: int) -> str | None:
    """Why the kernels cannot normalise groups of ``group_size`` out of
    ``dim`` channels, or None when they can."""
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    if group_size & (group_size - 1) or group_size < 16:
        return f"group size {group_size} is not a power of two from 16"
    if dim % group_size:
        return f"dim={dim} is not a multiple of the group size {group_size}"
    return None


def _tiling(group_size: int, rows: int | None, num_warps: int | None,
            interpret: bool) -> Tiling:
    """The Tiling of :func:`gated_rms_norm`'s arguments, or a ValueError naming them."""
    rows = _ROWS if rows is None else rows
    num_warps = _NUM_WARPS if num_warps is None else num_warps
    for name, value in (("rows", rows), ("num_warps", num_warps)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"norm_pallas.gated_rms_norm: {name}={value!r} must be a power "
                             f"of two from 1")
    return Tiling(group_size, rows, num_warps, interpret)


def _normalized(x_ref, gate_ref, eps):
    """The tile's float32 x, gate, gated y and y's inverse rms [rows, 1]."""
    x = x_ref[...].astype(jnp.float32)
    if gate_ref is None:
        gate, y = None, x
    else:
        gate = gate_ref[...].astype(jnp.float32)
        y = x * gate * jax.nn.sigmoid(gate)
    inv_rms = jax.lax.rsqrt(jnp.mean(y * y, axis=1, keepdims=True) + eps)
    return x, gate, y, inv_rms


def _forward_kernel(*refs, eps, gated):
    x_ref, *gate_ref, w_ref, out_ref = refs
    _, _, y, inv_rms = _normalized(x_ref, gate_ref[0] if gated else None, eps)
    out_ref[...] = (y * inv_rms * w_ref[...][None, :]).astype(out_ref.dtype)


def _backward_kernel(*refs, eps, gated):
    if gated:
        x_ref, gate_ref, w_ref, dout_ref, dx_ref, dgate_ref, dw_ref = refs
    else:
        (x_ref, w_ref, dout_ref, dx_ref, dw_ref), gate_ref = refs, None
    x, gate, y, inv_rms = _normalized(x_ref, gate_ref, eps)
    normalized = y * inv_rms
    dout = dout_ref[...].astype(jnp.float32)
    dw_ref[...] = jnp.sum(dout * normalized, axis=0)
    dnormalized = dout * w_ref[...][None, :]
    # d/dy of y / rms(y) over the group: (dn - n · mean(dn · n)) / rms.
    dy = inv_rms * (dnormalized - normalized * jnp.mean(dnormalized * normalized, axis=1,
                                                        keepdims=True))
    if not gated:
        dx_ref[...] = dy.astype(dx_ref.dtype)
        return
    sigmoid = jax.nn.sigmoid(gate)
    dx_ref[...] = (dy * gate * sigmoid).astype(dx_ref.dtype)
    dgate_ref[...] = (dy * x * sigmoid * (1.0 + gate * (1.0 - sigmoid))).astype(dgate_ref.dtype)


def _as_rows(t, rows: int):
    """[..., dim] -> [blocks·rows, dim], zero rows appended up to whole blocks
    (a zero row normalises to zero and adds nothing to the weight's gradient)."""
    flat = t.reshape(-1, t.shape[-1])
    pad = -flat.shape[0] % rows
    return jnp.pad(flat, ((0, pad), (0, 0))) if pad else flat


def _call(kernel, operands, tiles: int, outputs, tiling: Tiling, name: str):
    """pallas_call of ``kernel`` over (row block, group): ``operands`` are
    ``tiles`` [total, dim] arrays, the weight and, for the backward, the
    output's gradient; ``outputs`` (dtype, per_block) the results, [total,
    dim] or, per_block, a [dim] row per row block."""
    (operands, varying) = same_variance(*operands)
    total, dim = operands[0].shape
    rows, group_size = tiling.rows, tiling.group_size
    tile = pl.BlockSpec((rows, group_size), lambda i, g: (i, g))
    row_of_block = pl.BlockSpec((None, group_size), lambda i, g: (i, g))
    weight = pl.BlockSpec((group_size,), lambda i, g: (g,))
    return pl.pallas_call(
        kernel,
        grid=(total // rows, dim // group_size),
        in_specs=[tile] * tiles + [weight] + [tile] * (len(operands) - tiles - 1),
        out_specs=[row_of_block if per_block else tile for _, per_block in outputs],
        out_shape=[jax.ShapeDtypeStruct((total // rows if per_block else total, dim), dtype,
                                        manual_axis_type=varying)
                   for dtype, per_block in outputs],
        interpret=tiling.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps),
        name=name,
    )(*operands)


def _forward(x, gate, weight, eps, tiling: Tiling):
    inputs = [t for t in (x, gate) if t is not None]
    (out,) = _call(functools.partial(_forward_kernel, eps=eps, gated=gate is not None),
                   [_as_rows(t, tiling.rows) for t in inputs] + [weight], len(inputs),
                   [(x.dtype, False)], tiling, "gated_rms_norm")
    return out[:x.size // x.shape[-1]].reshape(x.shape)


def _backward(x, gate, weight, dout, eps, tiling: Tiling):
    inputs = [t for t in (x, gate) if t is not None]
    *grads, dw_partial = _call(
        functools.partial(_backward_kernel, eps=eps, gated=gate is not None),
        [_as_rows(t, tiling.rows) for t in inputs] + [weight, _as_rows(dout, tiling.rows)],
        len(inputs), [(t.dtype, False) for t in inputs] + [(jnp.float32, True)], tiling,
        "gated_rms_norm_backward")
    dx, *dgate = (d[:x.size // x.shape[-1]].reshape(x.shape) for d in grads)
    return dx, (dgate[0] if dgate else None), dw_partial.sum(0).astype(weight.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, gate, weight, eps, tiling):
    return _forward(x, gate, weight, eps, tiling)


def _norm_fwd(x, gate, weight, eps, tiling):
    return _forward(x, gate, weight, eps, tiling), (x, gate, weight)


def _norm_bwd(eps, tiling, inputs, dout):
    return _backward(*inputs, dout, eps, tiling)


_norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_by_platform(x, gate, weight, eps, tiling, reference):
    return _forward_by_platform(x, gate, weight, eps, tiling, reference)


def _forward_by_platform(x, gate, weight, eps, tiling, reference):
    return jax.lax.platform_dependent(
        x, gate, weight,
        cuda=lambda *t: _forward(*t, eps, tiling),
        default=lambda *t: reference(*t, eps, tiling.group_size))


def _norm_by_platform_fwd(x, gate, weight, eps, tiling, reference):
    return _forward_by_platform(x, gate, weight, eps, tiling, reference), (x, gate, weight)


def _norm_by_platform_bwd(eps, tiling, reference, inputs, dout):
    def by_reference(x, gate, weight, dout):
        return jax.vjp(lambda *t: reference(*t, eps, tiling.group_size), x, gate, weight)[1](dout)

    return jax.lax.platform_dependent(
        *inputs, dout, cuda=lambda *t: _backward(*t, eps, tiling), default=by_reference)


_norm_by_platform.defvjp(_norm_by_platform_fwd, _norm_by_platform_bwd)


def gated_rms_norm(x: jax.Array, gate: jax.Array | None, weight: jax.Array, *, eps: float,
                   group_size: int | None = None, rows: int | None = None,
                   num_warps: int | None = None, interpret: bool = False) -> jax.Array:
    """``weight · y / rms(y)`` per group, ``y = x · silu(gate)`` (or x),
    differentiable, on the GPU: :func:`models.layers.rms_norm`'s result.

    Args:
      x: [..., dim] (bf16 or float32).
      gate: like x, or None.
      weight: [dim] float32.
      eps: added to the mean square.
      group_size: channels normalised together, a power of two from 16 that
        divides dim; default the whole dim.
      rows: rows of one group per kernel program, a power of two (default 4).
      num_warps: warps per program, a power of two (default 8).
      interpret: run the kernels in Pallas's interpreter (any backend; for tests).

    Returns:
      [..., dim] in x's dtype, computed in float32. The gradients are x's,
      the gate's and the weight's dtypes.
    """
    group_size = group_size or x.shape[-1]
    require_runnable("norm_pallas.gated_rms_norm",
                     unsupported_reason(x.shape[-1], group_size), interpret,
                     "use norm_backward='autodiff' or 'recompute'")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"norm_pallas.gated_rms_norm: gate {gate.shape} is not x's shape "
                         f"{x.shape}")
    # As conv_pallas does: the weight takes x's variance outside the custom_vjp,
    # so that its gradient is summed over the data shards.
    (x, weight, gate), _ = same_variance(x, weight, gate)
    return _norm(x, gate, weight, eps, _tiling(group_size, rows, num_warps, interpret))


def gated_rms_norm_or(reference, x: jax.Array, gate: jax.Array | None, weight: jax.Array, *,
                      eps: float, group_size: int) -> jax.Array:
    """:func:`gated_rms_norm` on CUDA GPUs, ``reference`` on other platforms
    (chosen where the program is lowered, as the SSD's "auto" is), keeping
    only the inputs for the backward either way.

    Args:
      reference: ``(x, gate, weight, eps, group_size) -> [..., dim]`` in XLA
        ops, differentiable; a module-level function (it keys the custom_vjp).
      x, gate, weight, eps, group_size: as :func:`gated_rms_norm`'s; the
        shape must be one the kernels take (:func:`unsupported_reason`).

    Returns:
      [..., dim] in x's dtype, as :func:`gated_rms_norm`'s.
    """
    reason = unsupported_reason(x.shape[-1], group_size)
    if reason:
        raise ValueError(f"norm_pallas.gated_rms_norm_or: {reason}")
    (x, weight, gate), _ = same_variance(x, weight, gate)
    return _norm_by_platform(x, gate, weight, eps, _tiling(group_size, None, None, False),
                             reference)
