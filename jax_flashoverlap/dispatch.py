"""``impl="auto"``: which implementation runs, per platform, op and shape.

Resolved when a program is lowered for CUDA (on every other platform "auto"
is "xla"). The rule is measured, not assumed: "cuda" is picked only for the
ops and shapes where the benchmark on the GPU machine found it faster than
XLA, so "auto" never picks a slower path than the one users have today.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np

from . import _extension

__all__ = ["choose_impl", "all_reduce_algorithm", "all_reduce_region_bytes",
           "all_reduce_across_processes",
           "matmul_all_reduce_kernel", "ALL_REDUCE_ALGORITHMS"]

Shapes = Sequence[tuple[int, ...]]

# op -> predicate(shapes, dtype, n): True where impl="cuda" was measured at
# least 5% faster than impl="xla" (bf16, 2 H200s, DESIGN.md §4 protocol;
# run-to-run spread is a few percent, so smaller wins are not counted). Only
# what was measured: 2 ranks and 16-bit dtypes (fp16 runs the same kernels as
# bf16). An op missing here runs "xla".
#
# Collective matmuls (benchmarks/results/collective_matmul_2xh200.json): the
# rows per shard from which the fused op won on every listed shape.
# matmul_reduce_scatter is absent: it won by 5% on one shape only.
_MIN_ROWS = {"all_gather_matmul": 1024, "matmul_all_reduce": 4096}
# matmul_all_reduce below 4096 rows, where impl="cuda" is XLA's dot + the
# all-reduce kernel (matmul_all_reduce_kernel): from this many rows, if the
# result fits that path. Measured (collective_matmul_mar_2xh200.json) at one
# such shape, 1024x4096x4096: 82.1 us against XLA's 99.0 (1.21x); at 128 rows
# (128x8192x8192) it was 63.7 against 62.2, so not there.
_MIN_ROWS_COMPOSED_MATMUL_ALL_REDUCE = 1024

# all_reduce (benchmarks/results/all_reduce_2xh200.json): the kernel "auto"
# runs (one-shot to 8 MiB, two-shot above) was faster than psum at every size
# from 4 KiB to 256 MiB with unrolled loops (1.22-2.51x), and with one op per
# loop iteration (both bound by XLA's host) at every size but one: 16 KiB,
# one-shot 16.3 us (range 14.0-24.4 over 7 runs) against psum 13.7 us. That
# exception is kept, as noise of a host-bound loop, and is to be re-measured.
# "auto" keeps to messages the all-reduce region holds, so that it never
# fails where psum would not.
_ALL_REDUCE_MEASURED_DEVICES = 2

# all_reduce over an axis of processes, one GPU each
# (benchmarks/results/hierarchical_all_reduce_2xh200.json): the NVSHMEM
# hierarchical all-reduce beat psum across 2 processes, each GPU its own node,
# at every measured size, 4 KiB to 4 MiB of bf16, in both loop modes
# (1.14-4.09x). Other process counts, node sizes and larger messages were not
# measured: "auto" runs psum there.
NVSHMEM_ALL_REDUCE_MEASURED_MAX_BYTES = 4 << 20
_NVSHMEM_MEASURED_PROCESSES = 2
_NVSHMEM_MEASURED_NODE_SIZE = 1


def _measured_faster(op: str) -> Callable[[Shapes, np.dtype, int], bool]:
    def faster(shapes: Shapes, dtype: np.dtype, n: int) -> bool:
        return n == 2 and dtype.itemsize == 2 and shapes[0][0] >= _MIN_ROWS[op]
    return faster


def _all_reduce_faster(shapes: Shapes, dtype: np.dtype, n: int) -> bool:
    nbytes = math.prod(shapes[0]) * dtype.itemsize
    return (n == _ALL_REDUCE_MEASURED_DEVICES and dtype.itemsize == 2
            and nbytes <= all_reduce_region_bytes())


def _matmul_all_reduce_faster(shapes: Shapes, dtype: np.dtype, n: int) -> bool:
    (rows, _), (_, cols) = shapes
    if n != 2 or dtype.itemsize != 2:
        return False
    if rows >= _MIN_ROWS["matmul_all_reduce"]:  # the fused kernel, or dot + all-reduce
        return True
    return (rows >= _MIN_ROWS_COMPOSED_MATMUL_ALL_REDUCE
            and matmul_all_reduce_kernel(rows * cols * dtype.itemsize) == "gemm_then_all_reduce")


_CUDA_IS_FASTER: dict[str, Callable[[Shapes, np.dtype, int], bool]] = {
    "all_gather_matmul": _measured_faster("all_gather_matmul"),
    "matmul_all_reduce": _matmul_all_reduce_faster, "all_reduce": _all_reduce_faster}


def all_reduce_across_processes(nbytes: int, dtype, impl: str, capacity: int | None,
                                processes: int = _NVSHMEM_MEASURED_PROCESSES,
                                node_size: int = _NVSHMEM_MEASURED_NODE_SIZE) -> str:
    """How all_reduce runs over an axis of all processes, one device each.

    Args:
      nbytes: message bytes per process.
      dtype: its dtype.
      impl: "cuda" or "auto".
      capacity: :func:`jax_flashoverlap.nvshmem.max_message_bytes`, or None
        when NVSHMEM is not started in this process.
      processes: how many processes the axis spans.
      node_size: :func:`jax_flashoverlap.distributed.node_size`.

    Returns:
      "nvshmem" (the hierarchical all-reduce) or "xla" (psum).

    Raises:
      ValueError: impl="cuda" where the NVSHMEM path cannot run, naming why.
    """
    fits = capacity is not None and nbytes <= capacity
    if impl == "auto":
        measured = (np.dtype(dtype).itemsize == 2
                    and nbytes <= NVSHMEM_ALL_REDUCE_MEASURED_MAX_BYTES
                    and processes == _NVSHMEM_MEASURED_PROCESSES
                    and node_size == _NVSHMEM_MEASURED_NODE_SIZE)
        return "nvshmem" if fits and measured else "xla"
    if capacity is None:
        raise ValueError(
            "all_reduce(impl='cuda') over devices of several processes runs on NVSHMEM: "
            "call jax_flashoverlap.nvshmem.initialize() first (in a package built with "
            "JFO_ENABLE_NVSHMEM=ON), or use impl='auto' or 'xla'")
    if not fits:
        raise ValueError(
            f"all_reduce(impl='cuda'): {nbytes} bytes per process exceed the NVSHMEM buffers "
            f"({capacity} bytes); pass a larger heap_mb to "
            f"jax_flashoverlap.nvshmem.initialize(), or use impl='auto' or 'xla'")
    return "nvshmem"


def all_reduce_region_bytes(workspace_mb: int | None = None,
                            local_devices: int | None = None) -> int:
    """A lower bound of the largest message (bytes per rank) impl="cuda"
    all_reduce takes with the workspace of this process.

    The all-reduce region is a quarter of the workspace after its fixed
    parts, with the Lamport kernel's slots and then two buffers for each
    other local GPU (ffi/src/transport/peer_region.cu); messages above it
    raise an error that names ``JAX_FLASHOVERLAP_WORKSPACE_MB``.

    Args:
      workspace_mb: default: ``JAX_FLASHOVERLAP_WORKSPACE_MB`` or 1024.
      local_devices: CUDA devices of this process; default: JAX's count.
    """
    if workspace_mb is None:
        workspace_mb = _workspace_mb_from_env()
    if local_devices is None:
        local_devices = jax.local_device_count()
    senders = max(local_devices - 1, 1)
    # 64 MiB covers the GEMM workspace, the control words and rounding.
    slot = max(workspace_mb - 64, 0) * (1 << 20) // 8 // senders - LAMPORT_MAX_BYTES
    # Each of the kernel's 128 blocks has a 1/128 stripe of the slot and takes
    # up to 16 KiB of a small message (ffi/src/all_reduce.cu): below that the
    # region holds no message reliably.
    if slot // 128 < _AR_BLOCK_BYTES + 256:
        return 0
    return slot - 128 * 256


_AR_BLOCK_BYTES = 16 << 10  # kMinBlockBytes of ffi/src/all_reduce.cu


def _workspace_mb_from_env() -> int:
    """JAX_FLASHOVERLAP_WORKSPACE_MB as the extension reads it (leading digits, at least 64)."""
    raw = os.environ.get("JAX_FLASHOVERLAP_WORKSPACE_MB")
    if raw is None:
        return 1024
    digits = re.match(r"\s*(\d*)", raw).group(1)
    return max(int(digits or 0), 64)


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
# attribute (ffi/src/all_reduce.cu). "lamport", the one-shot without flags,
# is chosen only by name: it has not been measured yet.
ALL_REDUCE_ALGORITHMS = ("one_shot", "two_shot", "lamport")

# Largest message (bytes per rank) that runs one-shot; two-shot above it.
# Measured (benchmarks/results/all_reduce_2xh200.json, bf16, 2 H200s):
# one-shot was faster up to 4 MiB, even at 8 MiB (35.4 vs 35.8 us) and
# slower from 16 MiB (71.4 vs 62.3 us).
ONE_SHOT_MAX_BYTES = 8 << 20


# The flagless one-shot ("lamport") takes messages up to this many bytes per
# rank (kLamportMaxBytes of ffi/src/transport/transport.h).
LAMPORT_MAX_BYTES = 256 << 10


def all_reduce_algorithm(nbytes: int) -> str:
    """The CUDA all-reduce kernel for a message of ``nbytes`` bytes per rank.

    Returns:
      "one_shot" up to :data:`ONE_SHOT_MAX_BYTES`, else "two_shot".
    """
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"


# How impl="cuda" matmul_reduce_scatter folds the peers' partials into the
# rank's own block: "gemm_input" (cuBLASLt's C input; each chunk's GEMM waits
# for that chunk from every peer) or "add_after" (the own GEMM at once, then
# one elementwise add, FlashOverlap's order). "gemm_input" is what every
# committed benchmark ran; "add_after" is not yet measured against it.
REDUCE_SCATTER_FOLDS = ("gemm_input", "add_after")
REDUCE_SCATTER_FOLD = "gemm_input"

# impl="cuda" matmul_all_reduce up to this result size (bytes per rank): XLA's
# dot, then the one-kernel all-reduce on the same stream, instead of the fused
# op. A message this small is latency-bound, so chunking hides little, while
# the fused op pays per-chunk events and side streams. Measured
# (collective_matmul_mar_2xh200.json): 82.1 us composed against 99.0 XLA at
# 1024x4096x4096 (8 MiB result), 63.7 against 62.2 at 128x8192x8192; the
# fused op took 131.1 and 172.3 us on those shapes
# (collective_matmul_2xh200.json).
MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES = 8 << 20


def matmul_all_reduce_kernel(nbytes: int) -> str:
    """How impl="cuda" runs a GEMM→AllReduce whose result has ``nbytes`` per rank.

    Returns:
      "gemm_then_all_reduce" up to :data:`MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES`
      (and what the all-reduce region holds), else "fused".
    """
    if nbytes <= min(MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES, all_reduce_region_bytes()):
        return "gemm_then_all_reduce"
    return "fused"
