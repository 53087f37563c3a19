"""The few places where JAX offers no public way, kept in one small shim.

* Manual-axis typing (``check_vma``): a primitive's abstract evaluation must
  say over which mesh axes its result varies. The all-reduce ops return a
  value that is identical on every rank, exactly like ``lax.psum``, and must be
  typed so (otherwise ``out_specs=P()`` after them is rejected and gradients
  pick the wrong transpose). JAX exposes no public constructor for that type.
* The device mesh at lowering time: the CUDA kernels need the CUDA ordinals of
  each group of the mesh axis; XLA's own collectives read them from the
  lowering context's axis context, which is not public either.
* Whether JAX's backends are started: an environment variable that CUDA
  reads at start-up (``_module_loading``) can only be set before.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["varying_axes", "with_varying_axes", "same_variance", "lowering_mesh",
           "backends_initialized"]


def varying_axes(aval: Any) -> frozenset:
    """Mesh axes over which values of ``aval`` differ between devices."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def with_varying_axes(aval: Any, shape: tuple[int, ...], varying: frozenset) -> Any:
    """``aval`` with a new shape and the given set of varying manual axes."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None or getattr(aval.sharding, "mesh", None) is None or not (
            varying or mat.varying):
        return jax.core.ShapedArray(shape, aval.dtype)
    new_mat = type(mat)(varying=varying, unreduced=mat.unreduced, reduced=mat.reduced,
                        unreduced_kind=mat.unreduced_kind)
    return aval.update(shape=shape, manual_axis_type=new_mat)


def same_variance(*arrays: jax.Array | None) -> tuple[list[jax.Array | None], Any]:
    """The arrays made to vary over the same manual mesh axes (the union of
    theirs), and that manual axis type; a None (an optional operand left
    out) stays None.

    Inside ``shard_map`` the operands of an FFI call or a Pallas kernel must
    agree, and a custom_vjp's backward must return each gradient of its
    input's type. A parameter (the same on every data shard) cast here to
    vary like the activations, before a custom_vjp, gets its gradient summed
    over the shards by the cast's transpose.
    """
    present = [t for t in arrays if t is not None]
    union = frozenset().union(*(jax.typeof(t).manual_axis_type.varying for t in present))
    arrays = [None if t is None else
              jax.lax.pcast(t, tuple(sorted(union - jax.typeof(t).manual_axis_type.varying)),
                            to="varying") for t in arrays]
    return arrays, jax.typeof(next(t for t in arrays if t is not None)).manual_axis_type


def lowering_mesh(ctx: Any) -> Any | None:
    """The concrete ``jax.sharding.Mesh`` a lowering runs under, if known."""
    mesh = getattr(getattr(ctx.module_context, "axis_context", None), "mesh", None)
    return mesh if isinstance(mesh, jax.sharding.Mesh) else None


def backends_initialized() -> bool:
    """Whether JAX has started its backends (CUDA has read its environment)."""
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()
