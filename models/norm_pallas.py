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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_flashoverlap.nn import same_variance

from .ssd_pallas import plgpu

__all__ = ["gated_rms_norm", "gated_rms_norm_or", "unsupported_reason"]

# A program's tile holds this many float32 values per array: the backward
# keeps about six such arrays live, which 8 warps hold in registers.
_TILE_VALUES = 8192
_NUM_WARPS = 8


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


def _rows_per_program(group_size: int) -> int:
    return max(1, min(64, _TILE_VALUES // group_size))


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


def _specs(group_size: int, rows: int):
    return dict(tile=pl.BlockSpec((rows, group_size), lambda i, g: (i, g)),
                weight=pl.BlockSpec((group_size,), lambda i, g: (g,)),
                partial=pl.BlockSpec((None, group_size), lambda i, g: (i, g)))


def _as_rows(t, rows: int):
    """[..., dim] -> [blocks·rows, dim], zero rows appended up to whole blocks
    (a zero row normalises to zero and adds nothing to the weight's gradient)."""
    flat = t.reshape(-1, t.shape[-1])
    pad = -flat.shape[0] % rows
    return jnp.pad(flat, ((0, pad), (0, 0))) if pad else flat


def _forward(x, gate, weight, eps, group_size, interpret):
    rows = _rows_per_program(group_size)
    dim = x.shape[-1]
    operands = [_as_rows(x, rows)] + ([] if gate is None else [_as_rows(gate, rows)])
    operands, varying = same_variance(*operands, weight)
    spec = _specs(group_size, rows)
    total = operands[0].shape[0]
    out = pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps, gated=gate is not None),
        grid=(total // rows, dim // group_size),
        in_specs=[spec["tile"]] * (len(operands) - 1) + [spec["weight"]],
        out_specs=spec["tile"],
        out_shape=jax.ShapeDtypeStruct((total, dim), x.dtype, manual_axis_type=varying),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS),
        name="gated_rms_norm",
    )(*operands)
    return out[:x.size // dim].reshape(x.shape)


def _backward(x, gate, weight, dout, eps, group_size, interpret):
    rows = _rows_per_program(group_size)
    dim, count = x.shape[-1], x.size // x.shape[-1]
    tiles = [_as_rows(x, rows)] + ([] if gate is None else [_as_rows(gate, rows)])
    operands, varying = same_variance(*tiles, weight, _as_rows(dout, rows))
    spec = _specs(group_size, rows)
    total = operands[0].shape[0]
    result = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=varying)
    grads = pl.pallas_call(
        functools.partial(_backward_kernel, eps=eps, gated=gate is not None),
        grid=(total // rows, dim // group_size),
        in_specs=[spec["tile"]] * len(tiles) + [spec["weight"], spec["tile"]],
        out_specs=[spec["tile"]] * len(tiles) + [spec["partial"]],
        out_shape=[result((total, dim), t.dtype) for t in (x, gate) if t is not None]
        + [result((total // rows, dim), jnp.float32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS),
        name="gated_rms_norm_backward",
    )(*operands)
    *dtiles, dw_partial = grads
    dx, *dgate = (d[:count].reshape(x.shape) for d in dtiles)
    return dx, (dgate[0] if dgate else None), dw_partial.sum(0).astype(weight.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, gate, weight, eps, group_size, interpret):
    return _forward(x, gate, weight, eps, group_size, interpret)


def _norm_fwd(x, gate, weight, eps, group_size, interpret):
    return _forward(x, gate, weight, eps, group_size, interpret), (x, gate, weight)


def _norm_bwd(eps, group_size, interpret, inputs, dout):
    return _backward(*inputs, dout, eps, group_size, interpret)


_norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_by_platform(x, gate, weight, eps, group_size, reference):
    return _forward_by_platform(x, gate, weight, eps, group_size, reference)


def _forward_by_platform(x, gate, weight, eps, group_size, reference):
    return jax.lax.platform_dependent(
        x, gate, weight,
        cuda=lambda *t: _forward(*t, eps, group_size, False),
        default=lambda *t: reference(*t, eps, group_size))


def _norm_by_platform_fwd(x, gate, weight, eps, group_size, reference):
    return _forward_by_platform(x, gate, weight, eps, group_size, reference), (x, gate, weight)


def _norm_by_platform_bwd(eps, group_size, reference, inputs, dout):
    def by_reference(x, gate, weight, dout):
        return jax.vjp(lambda *t: reference(*t, eps, group_size), x, gate, weight)[1](dout)

    return jax.lax.platform_dependent(
        *inputs, dout, cuda=lambda *t: _backward(*t, eps, group_size, False),
        default=by_reference)


_norm_by_platform.defvjp(_norm_by_platform_fwd, _norm_by_platform_bwd)


def gated_rms_norm(x: jax.Array, gate: jax.Array | None, weight: jax.Array, *, eps: float,
                   group_size: int | None = None, interpret: bool = False) -> jax.Array:
    """``weight · y / rms(y)`` per group, ``y = x · silu(gate)`` (or x),
    differentiable, on the GPU: :func:`models.layers.rms_norm`'s result.

    Args:
      x: [..., dim] (bf16 or float32).
      gate: like x, or None.
      weight: [dim] float32.
      eps: added to the mean square.
      group_size: channels normalised together, a power of two from 16 that
        divides dim; default the whole dim.
      interpret: run the kernels in Pallas's interpreter (any backend; for tests).

    Returns:
      [..., dim] in x's dtype, computed in float32. The gradients are x's,
      the gate's and the weight's dtypes.
    """
    group_size = group_size or x.shape[-1]
    reason = unsupported_reason(x.shape[-1], group_size)
    if reason:
        raise ValueError(f"norm_pallas.gated_rms_norm: {reason}; use "
                         f"norm_backward='autodiff' or 'recompute'.")
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f"norm_pallas.gated_rms_norm runs on CUDA GPUs only (Pallas "
                         f"Triton), and the default backend is {jax.default_backend()!r}; "
                         f"use norm_backward='autodiff' or 'recompute'.")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"norm_pallas.gated_rms_norm: gate {gate.shape} is not x's shape "
                         f"{x.shape}")
    # As conv_pallas does: the weight takes x's variance outside the custom_vjp,
    # so that its gradient is summed over the data shards.
    (x, weight, *gate_list), _ = same_variance(x, weight, *([] if gate is None else [gate]))
    return _norm(x, gate_list[0] if gate_list else None, weight, eps, group_size, interpret)


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
    """
    reason = unsupported_reason(x.shape[-1], group_size)
    if reason:
        raise ValueError(f"norm_pallas.gated_rms_norm_or: {reason}")
    (x, weight, *gate_list), _ = same_variance(x, weight, *([] if gate is None else [gate]))
    return _norm_by_platform(x, gate_list[0] if gate_list else None, weight, eps, group_size,
                             reference)
