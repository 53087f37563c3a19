"""Reshapes between the public ops' N-D operands and the primitives' 2-D ones,
and the manual-axis bookkeeping their gradients need."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from . import _jax_shim


def rows_first(a: jax.Array, axis: int) -> jax.Array:
    """[..., rows at ``axis``, ..., c] -> 2-D [rows * batch, c], ``axis`` major.

    Making the sharded axis the major one keeps every rank's shard one
    contiguous row range, so the kernels need no strided copies (the layout
    Megatron uses for sequence parallelism, [seq, batch, hidden]).
    """
    return jnp.moveaxis(a, axis, 0).reshape(math.prod(a.shape[:-1]), a.shape[-1])


def rows_restore(a2d: jax.Array, like_shape: tuple[int, ...], axis: int,
                 rows: int) -> jax.Array:
    """Inverse of :func:`rows_first` for an output with ``rows`` at ``axis``.

    Args:
      a2d: [rows * batch, c].
      like_shape: shape of the input whose batch dims the output shares.
      axis: where the row dim goes back.
      rows: the output's size along ``axis``.
    """
    batch = [d for i, d in enumerate(like_shape[:-1]) if i != axis]
    moved = [rows, *batch, a2d.shape[-1]]
    return jnp.moveaxis(a2d.reshape(moved), 0, axis)


def varying(a: jax.Array) -> frozenset:
    """The manual mesh axes over which ``a`` is typed as differing (check_vma)."""
    return _jax_shim.varying_axes(jax.typeof(a))


def match_varying(ct: jax.Array, primal_axes: frozenset) -> jax.Array:
    """Gives a cotangent the manual-axis type of its primal.

    Over an axis where the primal is the same on every rank (invariant) but
    the cotangent varies, the primal was implicitly broadcast into
    rank-varying arithmetic, and the transpose of that broadcast is a sum over
    the axis (e.g. the data-parallel gradient sum of a weight). The reverse
    case only needs the type cast.
    """
    ct_axes = varying(ct)
    extra = tuple(sorted(ct_axes - primal_axes, key=str))
    missing = tuple(sorted(primal_axes - ct_axes, key=str))
    if extra:
        ct = lax.psum(ct, extra)
    if missing:
        ct = lax.pcast(ct, missing, to="varying")
    return ct
