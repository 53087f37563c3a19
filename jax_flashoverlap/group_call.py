"""An FFI call of a CUDA kernel that works with the other GPUs of its group.

The library's collectives learn the CUDA ordinals of their group along a
mesh axis when they are lowered (the device mesh is not known while
tracing under ``jax.jit``). A kernel of one's own that loads or stores its
peers' memory needs the same: :func:`group_ffi_call` is
``jax.ffi.ffi_call`` whose handler also receives

* ``group_ordinals``: int32 [groups * n], the CUDA ordinals of every group
  along ``axis_name`` whose devices are all in this process, each group
  ordered by rank: the handler finds the group that holds its own ordinal,
  and its rank is its position there;
* ``n``: int32, the axis size.

It lowers as ``ffi_call`` does, on every platform, so a target registered
for CUDA only fails to compile elsewhere: give it a portable branch with
``jax.lax.platform_dependent``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _jax_shim
from ._groups import group_ids

__all__ = ["group_ffi_call"]


def group_ffi_call(target_name: str, result_shape_dtypes: Sequence[jax.ShapeDtypeStruct],
                   *args: jax.Array, axis_name: str,
                   input_output_aliases: dict[int, int] | None = None,
                   **attributes: Any) -> list[jax.Array]:
    """Calls FFI target ``target_name`` inside ``jax.shard_map``, its handler
    told its group along ``axis_name`` (see the module's doc).

    Args:
      target_name: a registered FFI target.
      result_shape_dtypes: the per-device results; each may carry
        ``manual_axis_type`` (the mesh axes it varies over), else it varies
        over the union of the operands' axes.
      *args: the per-device operands.
      axis_name: the mesh axis of the group; bound by the enclosing shard_map.
      input_output_aliases: operand index -> result index, as ffi_call's.
      **attributes: the handler's other attributes (numpy scalars or arrays).

    Returns:
      The results, a list.
    """
    if not args:
        raise ValueError(f"group_ffi_call({target_name!r}): needs at least one operand")
    n = jax.lax.axis_size(axis_name)
    operands_varying = frozenset().union(
        *(_jax_shim.varying_axes(jax.typeof(a)) for a in args))
    results = tuple(
        (tuple(r.shape), np.dtype(r.dtype),
         _jax_shim.varying_axes(r) if getattr(r, "manual_axis_type", None) is not None
         else operands_varying)
        for r in result_shape_dtypes)
    frozen = tuple(sorted((k, _hashable(v)) for k, v in attributes.items()))
    return _GROUP_FFI_CALL.bind(
        *args, target_name=target_name, results=results, axis_name=axis_name, n=int(n),
        aliases=tuple(sorted((input_output_aliases or {}).items())), attributes=frozen)


def _hashable(value: Any) -> Any:
    """Primitive parameters are hashed: arrays travel as (dtype, shape, values)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, tuple(value.ravel().tolist()))
    return value


def _attribute(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] == "array":
        _, dtype, shape, values = value
        return np.asarray(values, np.dtype(dtype)).reshape(shape)
    return value


def _abstract_eval(*avals, target_name, results, axis_name, n, aliases, attributes):
    del target_name, axis_name, n, aliases, attributes
    return [_jax_shim.with_varying_axes(avals[0], shape, varying).update(dtype=dtype)
            for shape, dtype, varying in results]


def _lower(ctx, *args, target_name, results, axis_name, n, aliases, attributes):
    del results
    try:
        groups = group_ids(ctx, target_name, axis_name, n, across_processes=False)
    except ValueError as e:
        raise ValueError(
            f"group_ffi_call({target_name!r}): the devices of each group along "
            f"{axis_name!r} must be known when it is lowered (a concrete jax.sharding.Mesh, "
            f"set with jax.set_mesh or given to jax.shard_map) and be in this process") from e
    return jax.ffi.ffi_lowering(target_name, operand_output_aliases=dict(aliases))(
        ctx, *args, group_ordinals=groups, n=np.int32(n),
        **{k: _attribute(v) for k, v in attributes})


_GROUP_FFI_CALL = Primitive("jax_flashoverlap_group_ffi_call")
_GROUP_FFI_CALL.multiple_results = True
_GROUP_FFI_CALL.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_GROUP_FFI_CALL, _lower)
