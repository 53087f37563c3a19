"""``impl="xla"``: the plain XLA collectives users write today.

The baseline every other implementation is measured and tested against. Each
function takes the same 2-D operands as its :mod:`.decomposed` twin and must
run inside ``jax.shard_map`` with ``axis_name`` bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce"]


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
    """x [m, k], w [k, n_out] -> (all_gather(x) @ w [n*m, n_out], all_gather(x) [n*m, k])."""
    xg = lax.all_gather(x, axis_name, axis=0, tiled=True)
    return jnp.dot(xg, w, preferred_element_type=x.dtype), xg


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name) -> jax.Array:
    """x [n*m, k], w [k, n_out] -> this rank's [m, n_out] block of psum(x @ w)."""
    y = jnp.dot(x, w, preferred_element_type=x.dtype)
    return lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)


def matmul_all_reduce(x: jax.Array, w: jax.Array, axis_name) -> jax.Array:
    """x [m, k], w [k, n_out] -> psum(x @ w) [m, n_out]."""
    return lax.psum(jnp.dot(x, w, preferred_element_type=x.dtype), axis_name)


def all_reduce(x: jax.Array, axis_name) -> jax.Array:
    """psum(x)."""
    return lax.psum(x, axis_name)
