"""The ops on global arrays, for ``jax.jit``/pjit code that holds no shard_map.

Each function places a ``jax.shard_map`` that is manual over ``axis_name``,
so these compose with ordinary sharded code::

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: sharded.all_gather_matmul(x, w, axis_name="tensor"))(x, w)

The other mesh axes keep their type. Explicit ones (``jax.make_mesh``'s
default) are manual in the shard_map too: an operand's batch dims keep the
sharding its type gives them (say, batch over "data"), and so does the
result. Auto ones stay with the compiler's partitioner. The shardings below
are those of tensor/sequence-parallel layers; operands sharded otherwise are
resharded first.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

# The functions, not `from . import all_reduce`: the package binds these names
# to the functions, so the submodules are not reachable as its attributes.
from . import _validation
from .all_gather_matmul import all_gather_matmul as _all_gather_matmul
from .all_reduce import all_reduce as _all_reduce
from .matmul_all_reduce import matmul_all_reduce as _matmul_all_reduce
from .matmul_reduce_scatter import matmul_reduce_scatter as _matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce"]


def _mesh(mesh, op: str):
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError(f"sharded.{op}: no mesh. Pass mesh=jax.make_mesh(...) or call it "
                         f"under `with jax.set_mesh(mesh):`.")
    return mesh


def _check_axis(mesh, axis_name: str, op: str) -> None:
    if axis_name not in mesh.axis_names:
        raise ValueError(f"sharded.{op}: mesh axes are {mesh.axis_names}; there is no "
                         f"{axis_name!r}")


def _check_divisible(op: str, args, in_specs, mesh) -> None:
    """A clear error for a dim its mesh axes do not divide (jit's own names
    no op and no fix)."""
    for name, a, spec in zip(("x", "w"), args, in_specs):
        if a.ndim != len(spec):
            continue  # jax names the rank mismatch
        for dim, entry in enumerate(spec):
            axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
            ranks = math.prod(mesh.shape[axis] for axis in axes)
            if a.shape[dim] % ranks:
                raise ValueError(
                    f"sharded.{op}: {name} {tuple(a.shape)} has {a.shape[dim]} along dim "
                    f"{dim}, not divisible by the {ranks} ranks of {axes}; pad that dim to "
                    f"a multiple of {ranks}.")


def _explicit_axes(mesh, axis_name: str | None = None) -> frozenset[str]:
    """The mesh axes other than ``axis_name`` whose sharding is in the types."""
    return frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                     if kind == AxisType.Explicit and name != axis_name)


def _typed_spec(a: jax.Array, explicit: frozenset[str]) -> list:
    """``a``'s sharding over the ``explicit`` axes, one entry per dim."""
    spec = list(jax.typeof(a).sharding.spec) if explicit else []
    spec += [None] * (a.ndim - len(spec))

    def keep(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(n for n in names if n in explicit)
        return names[0] if len(names) == 1 else (names or None)

    return [keep(entry) for entry in spec]


def _placed(a: jax.Array, spec: list, mesh) -> jax.Array:
    """``a`` resharded to ``spec`` over the mesh's Explicit axes (shard_map
    takes explicitly sharded operands only as their types say)."""
    explicit = _explicit_axes(mesh)
    if not explicit:
        return a
    want = P(*(entry if entry in explicit else None for entry in spec))
    have = _typed_spec(a, explicit)
    return a if P(*have) == want else jax.sharding.reshard(a, want)


def _shard_map(op: str, fn, mesh, axis_name: str, explicit: frozenset[str], in_specs,
               out_specs):
    """``fn`` over the operands in a shard_map manual over ``axis_name`` and
    the ``explicit`` axes, operand i laid out as ``in_specs[i]``.

    Axes of type Explicit are manual too: the specs carry the operands'
    typed batch sharding through, and the ops inside see no sharding in their
    types. Auto axes stay with the compiler's partitioner.
    """
    _check_axis(mesh, axis_name, op)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=tuple(P(*s) for s in in_specs),
                           out_specs=P(*out_specs), axis_names={axis_name, *explicit})

    def call(*args):
        _check_divisible(op, args, in_specs, mesh)
        return mapped(*(_placed(a, s, mesh) for a, s in zip(args, in_specs)))
    return call


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
    explicit = _explicit_axes(mesh, axis_name)
    dim = _validation.normalize_axis("all_gather_matmul", "gather_axis", gather_axis, x.ndim)
    x_spec = _typed_spec(x, explicit)
    out_spec = [*x_spec[:-1], axis_name]
    x_spec[dim], x_spec[-1] = axis_name, None
    out_spec[dim] = None
    return _shard_map("all_gather_matmul", fn, mesh, axis_name, explicit,
                      (x_spec, (None, axis_name)), out_spec)(x, w)


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
    explicit = _explicit_axes(mesh, axis_name)
    dim = _validation.normalize_axis("matmul_reduce_scatter", "scatter_dimension",
                                     scatter_dimension, x.ndim)
    x_spec = _typed_spec(x, explicit)
    x_spec[dim], x_spec[-1] = None, axis_name
    out_spec = [*x_spec[:-1], None]
    out_spec[dim] = axis_name
    return _shard_map("matmul_reduce_scatter", fn, mesh, axis_name, explicit,
                      (x_spec, (axis_name, None)), out_spec)(x, w)


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
    explicit = _explicit_axes(mesh, axis_name)
    x_spec = _typed_spec(x, explicit)
    out_spec = [*x_spec[:-1], None]
    x_spec[-1] = axis_name
    return _shard_map("matmul_all_reduce", fn, mesh, axis_name, explicit,
                      (x_spec, (axis_name, None)), out_spec)(x, w)


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
    _check_axis(mesh, axis_name, "all_reduce")
    n = mesh.shape[axis_name]
    if x.ndim < 1 or x.shape[0] != n:
        raise ValueError(
            f"sharded.all_reduce: x has shape {x.shape}, but dim 0 must be the {n} ranks "
            f"of {axis_name!r}, one contribution each: stack the contributions along a "
            f"new dim 0 of size {n}.")
    fn = lambda xs: _all_reduce(xs[0], axis_name, **kwargs)  # noqa: E731
    explicit = _explicit_axes(mesh, axis_name)
    x_spec = _typed_spec(x, explicit)
    x_spec[0] = axis_name
    return _shard_map("all_reduce", fn, mesh, axis_name, explicit, (x_spec,), x_spec[1:])(x)
