"""Flax NNX tensor-parallel linear layers on the overlap ops.

The layers hold *global* parameters annotated with their sharding
(``out_sharding`` metadata), so creating a model under ``jax.set_mesh(mesh)``
places every weight on the mesh without hand work, and ``jax.jit`` keeps it
there. Their ``__call__`` runs per device, inside ``jax.shard_map`` with the
tensor axis bound, where each parameter is this rank's shard;
:func:`shard_map_apply` runs a module that way, taking each parameter's
in_spec from its metadata::

    with jax.set_mesh(mesh):                       # axes ("data", "tensor")
        up = ColumnParallelLinear(512, 2048, rngs=nnx.Rngs(0))
        down = RowParallelLinear(2048, 512, rngs=nnx.Rngs(1))
        mlp = nnx.List([up, down])
        f = lambda m, x: m[1](jax.nn.gelu(m[0](x)))  # x: [seq/tp, batch/dp, 512]
        y = shard_map_apply(f, mlp, x, in_specs=(P("tensor", "data"),),
                            out_specs=P("tensor", "data"))

Under sequence parallelism (the default) activations between layers are
sharded along the sequence (dim 0, the Megatron [seq, batch, hidden] layout):
the column-parallel layer gathers the sequence inside its GEMM
(:func:`~jax_flashoverlap.all_gather_matmul`) and the row-parallel layer
scatters it back inside its GEMM
(:func:`~jax_flashoverlap.matmul_reduce_scatter`). Without it, activations are
replicated over the tensor axis: the column-parallel GEMM needs no
communication and the row-parallel one ends in an all-reduce
(:func:`~jax_flashoverlap.matmul_all_reduce`).

Decoding one token at a time has no sequence to split: each layer's
``decode`` form takes the replicated activations of a few rows, and the
row-parallel one sums its partial products with
:func:`~jax_flashoverlap.all_reduce`, whose low-latency kernels serve those
small messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ._jax_shim import same_variance
from .all_gather_matmul import all_gather_matmul
from .all_reduce import all_reduce
from .decode_matmul import decode_matmul
from .matmul_all_reduce import matmul_all_reduce
from .matmul_reduce_scatter import matmul_reduce_scatter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_map_apply", "same_variance"]

Initializer = Callable[..., jax.Array]
# Fan-in scaled normal over the global kernel shape, as nnx.Linear's default.
DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()


class _ParallelLinear(nnx.Module):
    """A bias-free ``[in_features, out_features]`` kernel split over one mesh axis."""

    # Which dim of the [in_features, out_features] kernel is split over the axis.
    _sharded_dim: int

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tensor",
                 sequence_parallel: bool = True, sequence_axis: int = 0, impl: str = "auto",
                 decode_impl: str = "xla", dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = DEFAULT_KERNEL_INIT,
                 rngs: nnx.Rngs):
        sharding = tuple(axis_name if i == self._sharded_dim else None for i in range(2))
        # The initializer sees the global shape, so fan-in scaling (and hence
        # the parameters) do not depend on the tensor-parallel degree.
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features),
                                            param_dtype), out_sharding=sharding)
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel
        self.sequence_axis = sequence_axis
        self.impl = impl
        self.decode_impl = decode_impl
        self.dtype = dtype

    def _operands(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x and this rank's kernel shard in the compute dtype (the ops need one dtype)."""
        dtype = self.dtype if self.dtype is not None else x.dtype
        return x.astype(dtype), self.kernel[...].astype(dtype)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W`` with W's output features (columns) split over ``axis_name``.

    Call inside ``jax.shard_map`` with ``axis_name`` bound.

    Args:
      in_features: k.
      out_features: N, global; must divide by the axis size n.
      axis_name: the tensor-parallel mesh axis.
      sequence_parallel: whether ``x`` arrives sharded along ``sequence_axis``
        (gathered inside the GEMM) or whole on every rank.
      sequence_axis: the sequence dim of ``x``; 0 ([seq, batch, k]) avoids
        transposes.
      impl: the ops' implementation: "auto", "xla", "decomposed" or "cuda".
      decode_impl: the decoding form's matmul, "xla" or "cuda" (see
        :func:`~jax_flashoverlap.decode_matmul.decode_matmul`).
      dtype: compute dtype (default: that of ``x``); parameters stay in
        ``param_dtype``.
      param_dtype: storage dtype of the kernel.
      kernel_init: initializer of the global [k, N] kernel.
      rngs: supplies the ``params`` key.
    """

    _sharded_dim = 1

    def __call__(self, x: jax.Array) -> jax.Array:
        """Per device.

        Args:
          x: [s/n, ..., k] under sequence parallelism, else [s, ..., k]
            (``s`` at ``sequence_axis``).

        Returns:
          [s, ..., N/n]: the whole sequence, this rank's output features.
        """
        x, w = self._operands(x)
        if not self.sequence_parallel:
            return jnp.dot(x, w)
        return all_gather_matmul(x, w, self.axis_name, gather_axis=self.sequence_axis,
                                 impl=self.impl)

    def decode(self, x: jax.Array) -> jax.Array:
        """Per device, the decoding form: x whole on every rank, no communication.

        Args:
          x: [..., k], identical on every rank of ``axis_name``.

        Returns:
          [..., N/n]: this rank's output features.
        """
        return decode_matmul(*self._operands(x), impl=self.decode_impl)


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W`` with W's input features (rows) split over ``axis_name``.

    The partial products of the ranks are summed: reduce-scattered along the
    sequence under sequence parallelism, all-reduced without it. Call inside
    ``jax.shard_map`` with ``axis_name`` bound.

    Args:
      in_features: K, global; must divide by the axis size n.
      out_features: N.
      axis_name: the tensor-parallel mesh axis.
      sequence_parallel: whether the output leaves sharded along
        ``sequence_axis`` (reduce-scatter) or whole on every rank (all-reduce).
      sequence_axis: the sequence dim of ``x``; 0 avoids transposes.
      impl: the ops' implementation: "auto", "xla", "decomposed" or "cuda".
      decode_impl: the decoding form's matmul, "xla" or "cuda" (see
        :func:`~jax_flashoverlap.decode_matmul.decode_matmul`).
      dtype: compute dtype (default: that of ``x``).
      param_dtype: storage dtype of the kernel.
      kernel_init: initializer of the global [K, N] kernel.
      rngs: supplies the ``params`` key.
    """

    _sharded_dim = 0

    def __call__(self, x: jax.Array) -> jax.Array:
        """Per device.

        Args:
          x: [s, ..., K/n], this rank's input features.

        Returns:
          [s/n, ..., N] under sequence parallelism (this rank's block of the
          sum), else [s, ..., N] (the sum, identical on every rank).
        """
        x, w = self._operands(x)
        if not self.sequence_parallel:
            return matmul_all_reduce(x, w, self.axis_name, impl=self.impl)
        return matmul_reduce_scatter(x, w, self.axis_name,
                                     scatter_dimension=self.sequence_axis, impl=self.impl)

    def decode(self, x: jax.Array) -> jax.Array:
        """Per device, the decoding form: this rank's partial product, all-reduced.

        A GEMM of a few rows is cheap and its sum is a message of a few KiB,
        so nothing is worth overlapping: the dot runs alone, then
        :func:`~jax_flashoverlap.all_reduce` (with ``impl``) sums it, where
        "auto" picks the low-latency kernels that were measured faster than
        ``psum`` at that size.

        Args:
          x: [..., K/n], this rank's input features.

        Returns:
          [..., N]: the sum, identical on every rank.
        """
        return all_reduce(decode_matmul(*self._operands(x), impl=self.decode_impl),
                          self.axis_name, impl=self.impl)


def shard_map_apply(fn: Callable[..., Any], module: nnx.Module, *args: Any,
                    in_specs: tuple, out_specs: Any) -> Any:
    """Calls ``fn(module, *args)`` per device, inside ``jax.shard_map``.

    Manual over every axis of the mesh set by ``jax.set_mesh`` (so a data
    axis is plain per-device batch inside ``fn``). Each variable of
    ``module`` enters as the shard its ``out_sharding`` metadata names
    (replicated without one); gradients with respect to the module come back
    summed over the ranks that share a parameter, as ``jax.shard_map``'s
    transpose does for any replicated input.

    Args:
      fn: ``fn(module, *args) -> outputs``, per device.
      module: an NNX module with global variables.
      *args: global arrays.
      in_specs: one ``PartitionSpec`` per arg.
      out_specs: ``PartitionSpec`` pytree for the outputs.

    Returns:
      The outputs, as global arrays.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError(f"shard_map_apply({type(module).__name__}): no mesh. Run it under "
                         f"`with jax.set_mesh(mesh):`.")
    if mesh.are_all_axes_explicit:
        # Explicit-sharding meshes (jax.make_mesh's default) type every array
        # with its sharding, and shard_map wants args already split as in_specs.
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, in_specs))
    graphdef, state = nnx.split(module)

    def per_device(state, *args):
        return fn(nnx.merge(graphdef, state), *args)

    return jax.shard_map(per_device, in_specs=(nnx.get_partition_spec(state), *in_specs),
                         out_specs=out_specs)(state, *args)
