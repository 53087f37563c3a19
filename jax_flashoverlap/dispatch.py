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

__all__ = ["choose_impl", "all_reduce_algorithm", "ALL_REDUCE_ALGORITHMS"]

Shapes = Sequence[tuple[int, ...]]

# op -> predicate(shapes, dtype, n): True where impl="cuda" was measured at
# least 5% faster than impl="xla" (benchmarks/results/collective_matmul_2xh200.json:
# bf16, 2 H200s, DESIGN.md §4 protocol; run-to-run spread is a few percent,
# so smaller wins are not counted). Only what was measured: 2 ranks, 16-bit
# dtypes, and the rows per shard from which the fused op won on every listed
# shape. matmul_reduce_scatter is absent: it won by 5% on one shape only.
# An op missing here runs "xla".
_MIN_ROWS = {"all_gather_matmul": 1024, "matmul_all_reduce": 4096}


def _measured_faster(op: str) -> Callable[[Shapes, np.dtype, int], bool]:
    def faster(shapes: Shapes, dtype: np.dtype, n: int) -> bool:
        return n == 2 and dtype.itemsize == 2 and shapes[0][0] >= _MIN_ROWS[op]
    return faster


_CUDA_IS_FASTER: dict[str, Callable[[Shapes, np.dtype, int], bool]] = {
    op: _measured_faster(op) for op in _MIN_ROWS}


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


# The CUDA all-reduce's kernels; the position is the handler's `algorithm`
# attribute (ffi/src/all_reduce.cu).
ALL_REDUCE_ALGORITHMS = ("one_shot", "two_shot")

# Largest message (bytes per rank) that runs one-shot; two-shot above it.
# A starting guess, TO BE MEASURED with benchmarks/all_reduce.py: one-shot
# has one round of signals, two-shot two, but sums only 1/n of the data.
ONE_SHOT_MAX_BYTES = 256 << 10


def all_reduce_algorithm(nbytes: int) -> str:
    """The CUDA all-reduce kernel for a message of ``nbytes`` bytes per rank.

    Returns:
      "one_shot" up to :data:`ONE_SHOT_MAX_BYTES`, else "two_shot".
    """
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"
