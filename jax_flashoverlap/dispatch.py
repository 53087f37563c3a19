"""``impl="auto"``: which implementation runs, per platform, op and shape.

Resolved when a program is lowered for CUDA (on every other platform "auto"
is "xla"). The rule is measured, not assumed: "cuda" is picked only for the
ops and shapes where the benchmark on the GPU machine found it faster than
XLA, so "auto" never picks a slower path than the one users have today.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from . import _extension

__all__ = ["choose_impl"]

Shapes = Sequence[tuple[int, ...]]

# op -> predicate(shapes, dtype, n): True where impl="cuda" measured faster
# than impl="xla" (benchmarks/results/). An op missing here runs "xla".
_CUDA_IS_FASTER: dict[str, Callable[[Shapes, np.dtype, int], bool]] = {}


def choose_impl(op: str, ffi_target: str, shapes: Shapes, dtype, n: int) -> str:
    """The implementation "auto" runs on a CUDA GPU.

    Args:
      op: public op name.
      ffi_target: the op's CUDA handler.
      shapes: shapes of the 2-D operands, per device.
      dtype: operand dtype.
      n: ranks along the axis.

    Returns:
      "cuda" where it is built and measured faster, else "xla".
    """
    faster = _CUDA_IS_FASTER.get(op)
    if n > 1 and faster is not None and _extension.cuda_ops_available(ffi_target):
        if faster(shapes, np.dtype(dtype), n):
            return "cuda"
    return "xla"


def resolved_impl(op: str, ffi_target: str, shapes: Shapes, dtype, n: int,
                  platform: str | None = None) -> str:
    """What ``impl="auto"`` becomes on ``platform`` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return choose_impl(op, ffi_target, shapes, dtype, n) if platform in ("gpu", "cuda") else "xla"
