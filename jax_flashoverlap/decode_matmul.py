"""``x @ w`` for a decode step's few rows.

A decode step multiplies one row per sequence by every weight matrix, so its
GEMMs are reads of the weights, and their time is the weights' bytes over
the memory bandwidth. :func:`decode_matmul` runs them as XLA's dot, or as
``jfo_decode_matmul`` (``ffi/src/decode_matmul.cu``): one kernel that
streams each weight once in 16-byte loads, its CTAs splitting the inner
dimension in thread-block clusters that sum their parts on chip.

The kernel is an experiment, off by default: on one H200 the 1B
Transformer's 64 decode matmuls took 0.82-0.97 ms with it at one row against
0.70-0.72 ms as XLA's GEMMs, which also take in the neighbouring residual
adds and activations.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _extension, _jax_shim

__all__ = ["decode_matmul", "DECODE_MATMUL_IMPLS", "MAX_KERNEL_ROWS", "ONE_ROW_PAD_BELOW"]

DECODE_MATMUL_IMPLS = ("xla", "cuda")
MAX_KERNEL_ROWS = 8
_TARGET = "jfo_decode_matmul"
# Columns of w each CTA streams (each row's 2 * TILE contiguous bytes):
# what the kernel is compiled for, and its default.
TILE_COLUMNS = (64, 128, 256)
_DEFAULT_TILE_COLUMNS = 64


def decode_matmul(x: jax.Array, w: jax.Array, *, impl: str = "xla") -> jax.Array:
    """``x @ w`` where x holds a few rows, per device.

    Args:
      x: [..., k].
      w: [k, n], x's dtype (a floating-point one).
      impl: "xla", XLA's dot; or "cuda", the kernel wherever it applies:
        bfloat16 operands, at most :data:`MAX_KERNEL_ROWS` rows in x's
        leading dims, n a multiple of 8, and a program compiled for a CUDA
        GPU. Elsewhere (other shapes, dtypes or platforms) "cuda" runs XLA's
        dot too. Both are differentiable.

    Returns:
      [..., n] in x's dtype (float32 accumulation).
    """
    if impl not in DECODE_MATMUL_IMPLS:
        raise ValueError(f"decode_matmul: impl={impl!r} is not one of {DECODE_MATMUL_IMPLS}")
    if w.ndim != 2 or x.shape[-1] != w.shape[0] or x.dtype != w.dtype:
        raise ValueError(f"decode_matmul: needs x [..., k] and w [k, n] of one dtype; got "
                         f"x {x.dtype}{list(x.shape)} and w {w.dtype}{list(w.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"decode_matmul: takes floating-point operands (float32, bfloat16, "
                        f"float16), got {x.dtype}")
    if impl == "cuda":
        _extension.require_cuda_ops("decode_matmul", _TARGET)
    rows = math.prod(x.shape[:-1])
    if impl == "xla" or not _kernel_applies(rows, w):
        return _xla_dot(x, w)
    y = _kernel_dot(x.reshape(rows, -1), w, _DEFAULT_TILE_COLUMNS)
    return y.reshape(*x.shape[:-1], w.shape[1])


def _kernel_applies(rows: int, w: jax.Array) -> bool:
    return 1 <= rows <= MAX_KERNEL_ROWS and w.dtype == jnp.bfloat16 and w.shape[1] % 8 == 0


# One-row products with a weight of fewer elements than this are padded to
# two rows (see _xla_dot). Read where a dot is traced.
ONE_ROW_PAD_BELOW = 12_000_000


def _xla_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.dot(x, w)``, kept a GEMM when x has a single row.

    XLA on GPUs rewrites a dot whose left side is one row (a vector), with
    fewer than 10M elements in the row and w together, into a multiply and a
    reduction ("dot strength reduction"); for decoding's weight dots it
    materialised the product of the row with the whole weight matrix,
    several times slower than the GEMM. A zero row added below keeps it a
    GEMM (the weight is read once either way), and the barrier keeps XLA
    from slicing the row back off before the dot. Larger weights stay GEMMs
    unpadded, with no padded copy of the row written first: with jax
    0.11.2 on an H200, [2048, 4096] and smaller weights were reduced
    unpadded, [8192, 2048] and [2048, 16384] stayed GEMMs, and the 1B
    Transformer's decode step was 1.015x faster padding only the smaller
    ones than padding all.
    """
    if math.prod(x.shape[:-1]) != 1 or w.size >= ONE_ROW_PAD_BELOW:
        return jnp.dot(x, w)
    y = lax.optimization_barrier(jnp.dot(jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0))), w))
    return y[:1].reshape(*x.shape[:-1], w.shape[-1])


def _ffi_dot(x: jax.Array, w: jax.Array, tile_columns: int = _DEFAULT_TILE_COLUMNS) -> jax.Array:
    _extension.cuda_ops_available(_TARGET)  # registers the handlers with XLA, once
    (x, w), varying = _jax_shim.same_variance(x, w)
    # The result varies like its operands, on x's (manual) mesh.
    result = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype,
                                  sharding=jax.typeof(x).sharding, manual_axis_type=varying)
    return jax.ffi.ffi_call(_TARGET, result)(x, w, tile_columns=np.int32(tile_columns))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _kernel_dot(x: jax.Array, w: jax.Array, tile_columns: int) -> jax.Array:
    """[rows, k] @ [k, n]: the kernel (``tile_columns`` of :data:`TILE_COLUMNS`)
    in programs for CUDA GPUs, XLA's dot elsewhere."""
    return lax.platform_dependent(x, w, cuda=functools.partial(_ffi_dot,
                                                               tile_columns=tile_columns),
                                  default=_xla_dot)


@_kernel_dot.defjvp
def _kernel_dot_jvp(tile_columns, primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return _kernel_dot(x, w, tile_columns), jnp.dot(dx, w) + jnp.dot(x, dw)
