"""All-reduce (``psum``) with low-latency implementations for small messages."""

from __future__ import annotations

import functools

import jax

from . import _layout, _primitives, _validation

__all__ = ["all_reduce"]

_OP = "all_reduce"


def all_reduce(x: jax.Array, axis_name: str, *, impl: str = "auto") -> jax.Array:
    """Returns ``psum(x, axis_name)``.

    Must be called inside ``jax.shard_map`` with ``axis_name`` bound (or use
    :func:`jax_flashoverlap.sharded.all_reduce`).

    Args:
      x: any shape, float32, bfloat16 or float16.
      axis_name: mesh axis of ``n`` ranks to sum over.
      impl: "xla" (psum), "decomposed" (pure-JAX ring of ppermutes), "cuda"
        (NVLink kernels), or "auto".

    Returns:
      The sum, x's shape and dtype, identical on every rank and typed as such
      (like ``lax.psum``).
    """
    _validation.check_impl(_OP, impl)
    n = _validation.axis_size(_OP, axis_name)
    _validation.check_dtypes(_OP, x=x)
    return _all_reduce(x, (axis_name, n, impl, _layout.varying(x)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_reduce(x, static):
    axis_name, n, impl, _ = static
    return _primitives.bind(_OP, x, axis_name=axis_name, n=n, impl=impl)[0]


def _forward(x, static):
    return _all_reduce(x, static), None


def _backward(static, _, dy):
    axis_name, n, _, x_varying = static
    # Invariant x: every rank added the same value, psum(x) == n * x.
    ct = dy if axis_name in x_varying else dy * n
    return (_layout.match_varying(ct, x_varying),)


_all_reduce.defvjp(_forward, _backward)
