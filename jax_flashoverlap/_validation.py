"""Input checks shared by every op; each error names the fix."""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("auto", "xla", "decomposed", "cuda")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def axis_size(op: str, axis_name: Any) -> int:
    """Size of the mesh axis ``axis_name``; a clear error when it is not bound."""
    if not isinstance(axis_name, str):
        raise TypeError(f"{op}: axis_name must be the name (str) of one mesh axis, "
                        f"got {axis_name!r}")
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"{op}: axis name {axis_name!r} is not bound. Call {op} inside "
            f"jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...) over a mesh that "
            f"has an axis {axis_name!r}, or use jax_flashoverlap.sharded.{op} on "
            f"global arrays under jax.jit.") from e


def check_impl(op: str, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")


_WARNED_UNUSED: set[tuple[str, str]] = set()


def warn_unused_under_xla(op: str, impl: str, **options: Any) -> None:
    """Warns once per op and option when impl="xla" (XLA's own collective,
    which takes none of them) is given an option set away from its default
    (``None`` passed for one left at it)."""
    if impl != "xla":
        return
    for name, value in options.items():
        if value is not None and (op, name) not in _WARNED_UNUSED:
            _WARNED_UNUSED.add((op, name))
            warnings.warn(f"{op}: {name}={value!r} has no effect under impl='xla' (XLA's own "
                          f"collective); it applies to impl='cuda' and 'auto'", stacklevel=3)


# Row chunks the CUDA kernels take per block (CheckCommon, ffi/src/ops_common.cu).
MAX_CHUNKS = 64


def check_chunks(op: str, chunks, *, picked_by_shape: bool = True) -> int | None:
    """Returns ``chunks`` as a Python int (or None where ``picked_by_shape``);
    raises unless it is an integer from 1 to :data:`MAX_CHUNKS`."""
    if chunks is None and picked_by_shape:
        return None
    if (chunks is None or isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral)
            or not 1 <= chunks <= MAX_CHUNKS):
        choices = "None (picked by shape) or an int" if picked_by_shape else "an int"
        raise ValueError(f"{op}: chunks must be {choices} from 1 to {MAX_CHUNKS}, "
                         f"got {chunks!r}")
    return int(chunks)


def check_dtypes(op: str, **arrays: jax.Array) -> None:
    """All operands share one supported floating dtype."""
    dtypes = {name: jnp.dtype(a.dtype) for name, a in arrays.items()}
    for name, dtype in dtypes.items():
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{op}: {name} has dtype {dtype}; supported are "
                f"{[str(d) for d in SUPPORTED_DTYPES]}. Cast it, e.g. "
                f"{name}.astype(jnp.bfloat16).")
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{op}: operands must share one dtype, got {dtypes}; cast them "
                        f"to a common dtype first.")


def check_matmul_operands(op: str, x: jax.Array, w: jax.Array) -> None:
    """x [..., k] (at least 2-D) and w [k, n_out] with matching k."""
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have at least 2 dims ([rows, ..., k]), got shape "
                         f"{x.shape}")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must be 2-D [k, n_out], got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{op}: contraction dims differ: x {x.shape} has k={x.shape[-1]} "
                         f"but w {w.shape} has k={w.shape[0]}; x's last dim must equal "
                         f"w's first.")
    check_dtypes(op, x=x, w=w)
    check_not_empty(op, x=x, w=w)


def check_not_empty(op: str, **arrays: jax.Array) -> None:
    """Every impl refuses zero-size operands alike (XLA's own collectives do
    not compile them, and their gradients cannot go through shard_map)."""
    for name, a in arrays.items():
        if a.size == 0:
            raise ValueError(f"{op}: {name} has shape {a.shape}, with no elements; its "
                             f"result would be empty or all zeros: skip the call for empty "
                             f"operands.")


def normalize_axis(op: str, name: str, axis: int, ndim: int) -> int:
    """``axis`` of an ``ndim``-D operand as a non-negative index, negative
    ones counting from the end as in numpy; it must be a row dim (the last
    dim is the contraction dim k)."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {axis!r}")
    if not (-ndim <= axis < ndim - 1 and axis != -1):
        raise ValueError(f"{op}: {name}={axis} does not name a row dim of x with {ndim} "
                         f"dims: 0 to {ndim - 2}, or {-ndim} to -2 from the end (the last "
                         f"dim, -1, is the contraction dim)")
    return int(axis) % ndim
