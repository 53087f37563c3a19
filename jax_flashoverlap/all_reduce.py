"""All-reduce (``psum``) with low-latency implementations for small messages."""

from __future__ import annotations

import functools

import jax

from . import _layout, _primitives, _validation, cuda_policy

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
