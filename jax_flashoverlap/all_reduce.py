"""All-reduce (``psum``) with low-latency implementations for small messages."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.interpreters import mlir

from . import (
    _cuda_limits,
    _extension,
    _layout,
    _primitives,
    _validation,
    cuda_policy,
    decomposed,
    dispatch,
    xla_baseline,
)
from ._op_handlers import FFI_TARGETS

__all__ = ["all_reduce"]

_OP = "all_reduce"


def all_reduce(x: jax.Array, axis_name: str, *, impl: str = "auto",
               algorithm: str | None = None) -> jax.Array:
    """Returns ``psum(x, axis_name)``.

    Must be called inside ``jax.shard_map`` with ``axis_name`` bound (or use
    :func:`jax_flashoverlap.sharded.all_reduce`).

    Args:
      x: any shape, float32, bfloat16 or float16.
      axis_name: mesh axis of ``n`` ranks to sum over.
      impl: "xla" (psum), "decomposed" (pure-JAX ring of ppermutes), "cuda"
        (NVLink kernels), or "auto".
      algorithm: the CUDA kernel: "one_shot" (every rank sums all ranks'
        data), "two_shot" (reduce-scatter, then all-gather), "lamport" (the
        one-shot without flags, for messages up to
        :func:`~jax_flashoverlap.cuda_policy.lamport_max_bytes` per rank (2 MiB
        with 2 CUDA devices in the process); it
        sends -0.0 as +0.0, and in float32 one denormal, -4.6e-41, as -0.0),
        "copy_engine" (a two-shot whose transfers run on the GPUs' copy
        engines, for large messages: up to one receive slot of the
        transport, :func:`~jax_flashoverlap.cuda_policy.transport_capacity`;
        it records CUDA events, so XLA does not capture it in command
        buffers; not yet measured, so None never picks it),
        or None to pick by message size and rank count
        (:func:`jax_flashoverlap.cuda_policy.all_reduce_algorithm`: "lamport"
        up to 2 MiB of a 16-bit dtype on 2 ranks, where it was measured
        fastest).
        The other implementations ignore it.

    Returns:
      The sum, x's shape and dtype, identical on every rank and typed as such
      (like ``lax.psum``). impl="cuda" sums in rank order in float32, so every
      rank gets the same bits.
    """
    _validation.check_impl(_OP, impl)
    if algorithm is not None and algorithm not in cuda_policy.ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"{_OP}: algorithm must be None (chosen by message size) or one "
                         f"of {cuda_policy.ALL_REDUCE_ALGORITHMS}, got {algorithm!r}")
    _validation.warn_unused_under_xla(_OP, impl, algorithm=algorithm)
    n = _validation.axis_size(_OP, axis_name)
    _validation.check_dtypes(_OP, x=x)
    _validation.check_not_empty(_OP, x=x)
    return _all_reduce(x, (axis_name, n, impl, algorithm, _layout.varying(x)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_reduce(x, static):
    axis_name, n, impl, algorithm, _ = static
    return _primitives.bind(_OP, x, axis_name=axis_name, n=n, impl=impl,
                            algorithm=algorithm)[0]


def _forward(x, static):
    return _all_reduce(x, static), None


def _backward(static, _, dy):
    axis_name, n, _, _, x_varying = static
    # Invariant x: every rank added the same value, psum(x) == n * x.
    ct = dy if axis_name in x_varying else dy * n
    return (_layout.match_varying(ct, x_varying),)


_all_reduce.defvjp(_forward, _backward)


# The op's definition: how its primitive is typed and lowered.

# algorithm="copy_engine" runs a handler of its own; the other algorithms are
# kernels of FFI_TARGETS["all_reduce"].
_COPY_ENGINE_TARGET = "jfo_all_reduce_copy_engine"


def _out_shapes(x_shape: tuple[int, ...], n: int, opts: dict) -> tuple[tuple[int, ...]]:
    """The sum has x's shape (any: this op's primitive takes x as it comes)."""
    del n, opts
    return (x_shape,)


def kernel_attrs(n: int, opts: dict) -> dict[str, np.int32]:
    """The kernels' attributes after the transport's: ``algorithm``, the
    kernel's index in cuda_policy.ALL_REDUCE_KERNELS (matmul_all_reduce's
    small results run them too)."""
    del n
    return {"algorithm": np.int32(cuda_policy.ALL_REDUCE_KERNELS.index(opts["algorithm"]))}


def _cuda_options(ctx, n: int, opts: dict) -> dict:
    """algorithm=None picked by message size, decided here with the impl."""
    aval = ctx.avals_in[0]
    if opts["algorithm"] is None:
        opts["algorithm"] = cuda_policy.all_reduce_algorithm(
            math.prod(aval.shape) * aval.dtype.itemsize, n, aval.dtype)
    _cuda_limits.check_lamport_size(aval, opts["algorithm"])
    return opts


def _cuda_lowering(ctx, args, transport: dict, n: int, opts: dict):
    """algorithm="copy_engine": its own handler, the message within one
    receive slot of the transport; the kernels: None (jfo_all_reduce)."""
    del n
    if opts["algorithm"] != "copy_engine":
        return None
    _cuda_limits.check_copy_engine_size(ctx.avals_in[0])
    _extension.require_cuda_ops(_OP, _COPY_ENGINE_TARGET)
    return jax.ffi.ffi_lowering(_COPY_ENGINE_TARGET)(
        ctx, *args, **transport, chunks=np.int32(cuda_policy.COPY_ENGINE_ALL_REDUCE_CHUNKS))


def _across_processes(ctx, args, impl: str, n: int, opts: dict):
    """Over an axis of one GPU per process: NVSHMEM's hierarchical all-reduce
    where dispatch.all_reduce_across_processes picks it (with this process's
    NVSHMEM state), else None (psum)."""
    from . import distributed, nvshmem  # only an axis across processes needs them

    aval = ctx.avals_in[0]
    capacity = nvshmem.max_message_bytes() if nvshmem.is_initialized() else None
    nbytes = math.prod(aval.shape) * aval.dtype.itemsize
    if dispatch.all_reduce_across_processes(nbytes, aval.dtype, impl, capacity, processes=n,
                                            node_size=distributed.node_size()) != "nvshmem":
        return None
    timeout = int(opts.get("timeout_ms", _primitives.timeout_ms()))
    return mlir.lower_fun(lambda x: [nvshmem.ffi_all_reduce(x, timeout_ms=timeout)],
                          multiple_results=True)(ctx, *args)


_DEFINITION = _primitives.define(_primitives.OpDef(
    name=_OP, ffi_target=FFI_TARGETS[_OP], out_shapes=_out_shapes, reduces=True,
    xla=_primitives.as_tuple(_primitives.baseline(xla_baseline.all_reduce)),
    decomposed=_primitives.as_tuple(_primitives.decomposed_with(decomposed.all_reduce)),
    cuda_attrs=kernel_attrs, single_rank=lambda x: (x,), cuda_options=_cuda_options,
    cuda_lowering=_cuda_lowering, across_processes=_across_processes))
