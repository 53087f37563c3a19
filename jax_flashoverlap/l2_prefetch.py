"""Fetching the next GEMM's weights into L2 while latency-bound kernels run.

A decode step reads every weight once, so its GEMMs run at HBM bandwidth;
between them run kernels bound by latency (norms, rotary embeddings,
attention over a short cache, the all-reduce of tensor parallelism) during
which HBM idles. :func:`prefetch_to_l2` passes an activation through
unchanged and, on the way, starts bulk L2 prefetches of the leading bytes of
the weights named: placed right before such a stretch, HBM fetches the next
GEMM's weights during it, and the GEMM reads them from L2.

On Hopper and newer GPUs the FFI kernel ``jfo_prefetch_to_l2``
(``ffi/src/l2_prefetch.cu``) has one warp on every SM issue bulk L2
prefetches (the TMA units fetch), on a side stream forked from XLA's at the
call: XLA's next kernels run meanwhile, and nothing waits for the fetches.
Elsewhere (other platforms, older GPUs, a build without CUDA) the call is
``x`` alone: a prefetch is a hint, and its result is the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax

from . import _extension, _jax_shim

__all__ = ["prefetch_to_l2"]

_TARGET = "jfo_prefetch_to_l2"
MAX_ARRAYS = 8  # what the kernel takes in one call


def prefetch_to_l2(x: jax.Array, arrays: Sequence[jax.Array], *, max_bytes: int) -> jax.Array:
    """``x``, with the leading bytes of ``arrays`` fetched into L2 meanwhile.

    The fetch starts where ``x`` is computed and the result is ready: every
    consumer of the result runs after it is issued. Put it on the activation
    that feeds the latency-bound stretch before the GEMM that reads
    ``arrays``. Forward only (decoding); its derivative is the identity.

    Args:
      x: any array, per device (inside ``jax.shard_map``) or whole.
      arrays: at most :data:`MAX_ARRAYS` arrays (weights), fetched in order
        from each one's start.
      max_bytes: bytes fetched over all ``arrays`` together, at most: what L2
        holds until the GEMM reads them (an H200's L2 is 50 MB).

    Returns:
      ``x`` itself (the same buffer, aliased).
    """
    if not isinstance(max_bytes, (int, np.integer)) or max_bytes < 0:
        raise ValueError(f"prefetch_to_l2: max_bytes must be an int >= 0, got {max_bytes!r}")
    arrays = list(arrays)
    if len(arrays) > MAX_ARRAYS:
        raise ValueError(f"prefetch_to_l2: at most {MAX_ARRAYS} arrays per call, got "
                         f"{len(arrays)}; split them over several calls")
    if not arrays or max_bytes == 0 or not _extension.cuda_ops_available(_TARGET):
        return x
    return _prefetch(x, tuple(arrays), int(max_bytes))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _prefetch(x: jax.Array, arrays: tuple, max_bytes: int) -> jax.Array:
    """The kernel in programs for CUDA GPUs, ``x`` elsewhere."""
    return lax.platform_dependent(x, *arrays, default=lambda x, *_: x,
                                  cuda=functools.partial(_ffi_prefetch, max_bytes=max_bytes))


@_prefetch.defjvp
def _prefetch_jvp(max_bytes, primals, tangents):
    return _prefetch(*primals, max_bytes), tangents[0]


def _ffi_prefetch(x: jax.Array, *arrays: jax.Array, max_bytes: int) -> jax.Array:
    (x, *arrays), varying = _jax_shim.same_variance(x, *arrays)
    result = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding,
                                  manual_axis_type=varying)
    return jax.ffi.ffi_call(_TARGET, result, input_output_aliases={0: 0})(
        x, *arrays, max_bytes=np.int64(max_bytes))
