"""The ops on global arrays, for ``jax.jit``/pjit code that holds no shard_map.

Each function places a ``jax.shard_map`` that is manual over ``axis_name``
only; every other mesh axis (say, a data axis) stays under the compiler's
automatic partitioning, so these compose with ordinary sharded code::

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: sharded.all_gather_matmul(x, w, axis_name="tensor"))(x, w)

The shardings below are those of tensor/sequence-parallel layers; inputs
sharded otherwise are resharded by XLA first.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

# The functions, not `from . import all_reduce`: the package binds these names
# to the functions, so the submodules are not reachable as its attributes.
from .all_gather_matmul import all_gather_matmul as _all_gather_matmul
from .all_reduce import all_reduce as _all_reduce
from .matmul_all_reduce import matmul_all_reduce as _matmul_all_reduce
from .matmul_reduce_scatter import matmul_reduce_scatter as _matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce"]


def _spec(ndim: int, dim: int, axis_name: str) -> P:
    return P(*[axis_name if i == dim else None for i in range(ndim)])


def _mesh(mesh, op: str):
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError(f"sharded.{op}: no mesh. Pass mesh=jax.make_mesh(...) or call it "
                         f"under `with jax.set_mesh(mesh):`.")
    return mesh


def _shard_map(fn, mesh, axis_name, in_specs, out_specs):
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh axes are {mesh.axis_names}; there is no {axis_name!r}")
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names={axis_name})


def all_gather_matmul(x: jax.Array, w: jax.Array, *, axis_name: str, mesh=None,
                      gather_axis: int = 0, **kwargs) -> jax.Array:
    """Global form of :func:`jax_flashoverlap.all_gather_matmul`.

    Args:
      x: [..., M, ..., k] global, sharded along ``gather_axis`` over ``axis_name``.
      w: [k, N] global, columns sharded over ``axis_name``.
      axis_name: the mesh axis to gather over.
      mesh: a ``jax.sharding.Mesh``; default the one set by ``jax.set_mesh``.
      gather_axis: the sharded dim of ``x``.
      **kwargs: ``impl``, ``topology``, ``chunks``.

    Returns:
      x @ w: [..., M, ..., N], last dim sharded over ``axis_name``.
    """
    mesh = _mesh(mesh, "all_gather_matmul")
    fn = functools.partial(_all_gather_matmul, axis_name=axis_name,
                           gather_axis=gather_axis, **kwargs)
    return _shard_map(fn, mesh, axis_name,
                      (_spec(x.ndim, gather_axis % x.ndim, axis_name), P(None, axis_name)),
                      _spec(x.ndim, x.ndim - 1, axis_name))(x, w)


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, *, axis_name: str, mesh=None,
                          scatter_dimension: int = 0, **kwargs) -> jax.Array:
    """Global form of :func:`jax_flashoverlap.matmul_reduce_scatter`.

    Args:
      x: [..., M, ..., K] global, last dim sharded over ``axis_name``.
      w: [K, N] global, rows sharded over ``axis_name``.
      axis_name: the mesh axis to sum over.
      mesh: a ``jax.sharding.Mesh``; default the one set by ``jax.set_mesh``.
      scatter_dimension: the dim of the result sharded over ``axis_name``.
      **kwargs: ``impl``, ``topology``, ``chunks``.

    Returns:
      x @ w: [..., M, ..., N], sharded along ``scatter_dimension``.
    """
    mesh = _mesh(mesh, "matmul_reduce_scatter")
    fn = functools.partial(_matmul_reduce_scatter, axis_name=axis_name,
                           scatter_dimension=scatter_dimension, **kwargs)
    return _shard_map(fn, mesh, axis_name,
                      (_spec(x.ndim, x.ndim - 1, axis_name), P(axis_name, None)),
                      _spec(x.ndim, scatter_dimension % x.ndim, axis_name))(x, w)


def matmul_all_reduce(x: jax.Array, w: jax.Array, *, axis_name: str, mesh=None,
                      **kwargs) -> jax.Array:
    """Global form of :func:`jax_flashoverlap.matmul_all_reduce`.

    Args:
      x: [..., K] global, last dim sharded over ``axis_name``.
      w: [K, N] global, rows sharded over ``axis_name``.
      axis_name: the mesh axis to sum over.
      mesh: a ``jax.sharding.Mesh``; default the one set by ``jax.set_mesh``.
      **kwargs: ``impl``, ``chunks``.

    Returns:
      x @ w: [..., N], replicated over ``axis_name``.
    """
    mesh = _mesh(mesh, "matmul_all_reduce")
    fn = functools.partial(_matmul_all_reduce, axis_name=axis_name, **kwargs)
    return _shard_map(fn, mesh, axis_name,
                      (_spec(x.ndim, x.ndim - 1, axis_name), P(axis_name, None)),
                      P())(x, w)


def all_reduce(x: jax.Array, *, axis_name: str, mesh=None, **kwargs) -> jax.Array:
    """Global form of :func:`jax_flashoverlap.all_reduce`.

    Args:
      x: [n, ...] global: one contribution per rank of ``axis_name``, dim 0
        sharded over it.
      axis_name: the mesh axis to sum over.
      mesh: a ``jax.sharding.Mesh``; default the one set by ``jax.set_mesh``.
      **kwargs: ``impl``.

    Returns:
      ``x.sum(0)``: [...], replicated over ``axis_name``.
    """
    mesh = _mesh(mesh, "all_reduce")
    fn = lambda xs: _all_reduce(xs[0], axis_name, **kwargs)  # noqa: E731
    return _shard_map(fn, mesh, axis_name, (_spec(x.ndim, 0, axis_name),), P())(x)
