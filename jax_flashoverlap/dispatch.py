"""``impl="auto"``: which implementation runs, per platform, op and shape.

Resolved when a program is lowered for CUDA (on every other platform "auto"
is "xla"). The rule is measured, not assumed: "cuda" is picked only for the
ops and shapes where the benchmark on the GPU machine found it faster than
XLA, so "auto" never picks a slower path than the one users have today.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from . import _extension

__all__ = ["choose_impl", "prefer_xla", "AUTO_OPS", "all_reduce_algorithm",
           "all_reduce_region_bytes", "all_reduce_across_processes", "collective_matmul_chunks",
           "lamport_max_bytes", "matmul_all_reduce_kernel", "process_cuda_devices",
           "ALL_REDUCE_ALGORITHMS"]

Shapes = Sequence[tuple[int, ...]]

# Every rule below was measured on one machine, 2 H200s: each holds for this
# many ranks (local GPUs) only; elsewhere the untuned choice runs.
_MEASURED_RANKS = 2

# op -> predicate(shapes, dtype, n, chunks): True from the size where impl="cuda" was
# measured faster than impl="xla" on every listed shape, and by at least 5% on
# most (bf16, 2 H200s, DESIGN.md §4 protocol; run-to-run spread is a few
# percent, so smaller wins alone are not counted). Only
# what was measured: 2 ranks and 16-bit dtypes (fp16 runs the same kernels as
# bf16). An op missing here runs "xla".
#
# Collective matmuls (benchmarks/results/collective_matmul_2xh200.json): the
# rows per shard from which the fused op won on every listed shape.
# matmul_reduce_scatter (rows = the result's rows per rank) from 1024 rows,
# with the chunks of chunks=None (collective_matmul_chunks: two there) and
# autotuned GEMMs (collective_matmul_rs_fold_autotune_2xh200.json): 1.33x XLA at
# 1024x4096x4096, 1.03x at 2048x8192x7168, 1.10x at 2048x8192x14336, 1.14x at
# 4096x8192x4096, 1.09x at 8192x8192x14336; at 128 rows 1.03x with one chunk.
# Without autotuning: 1.32x, 1.05x, 0.99x (1.03x with one chunk), 1.10x, 1.05x.
# With one chunk everywhere (the earlier benchmarks) it won by 5% on one shape
# and lost at 2048x8192x7168 (846 vs 818 us), so "auto" keeps XLA when the
# caller asks for chunks other than those of chunks=None. A later run at
# 2048x8192x7168 (collective_matmul_rs_chunks_2xh200.json) measured 0.96x
# (826 vs 795 us; 777 vs 826 in collective_matmul_xla_waits_2xh200.json): the
# spread there is about 4% either way.
#
# Below 1024 rows, at x8192x8192, two runs (collective_matmul_small_rows_2xh200.json,
# then ..._small_rows_auto_2xh200.json): all_gather_matmul 1.21x and 1.19x XLA
# at 256 rows, 1.29x and 1.22x at 512; at 128 rows 1.04x, then 0.96x (1.16x
# and 1.04x in two earlier runs), so it starts at 256. matmul_all_reduce as
# XLA's dot + the all-reduce kernel (Lamport up to 2 MiB, one-shot above):
# 1.18x and 1.20x at 128 rows (1.07x in an earlier run; 0.98x when the
# all-reduce there was the flag one-shot), 1.06x and 0.99x at 256 (where
# "auto", the same path, ran 1.08x in the second run), 1.11x and 1.08x at 512.
# The fused matmul_all_reduce from 2048 rows since its chunks hold whole tiles
# (MATMUL_ALL_REDUCE_PART_ALIGN, three runs): 1.03-1.08x XLA at
# 2048x8192x7168, 1.05-1.15x at 2048x8192x14336, 1.11-1.12x at 4096x8192x4096.
_MIN_ROWS = {"all_gather_matmul": 256, "matmul_all_reduce": 2048,
             "matmul_reduce_scatter": 1024}
_MIN_ROWS_COMPOSED_MATMUL_ALL_REDUCE = 128

# all_reduce (benchmarks/results/all_reduce_2xh200.json): the kernel "auto"
# runs (one-shot to 8 MiB, two-shot above) was faster than psum at every size
# from 4 KiB to 256 MiB with unrolled loops (1.22-2.51x), and with one op per
# loop iteration (both bound by XLA's host) at every size but one: 16 KiB,
# one-shot 16.3 us (range 14.0-24.4 over 7 runs) against psum 13.7 us. That
# exception is kept, as noise of a host-bound loop, and is to be re-measured.
# Since then "auto" runs Lamport up to 2 MiB (see LAMPORT_AUTO_MAX_BYTES;
# all_reduce_lamport_auto_2xh200.json: faster than psum at every measured
# size in both modes, 16 KiB was not in that run).
# "auto" keeps to messages the all-reduce region holds, so that it never
# fails where psum would not.

# all_reduce over an axis of processes, one GPU each
# (benchmarks/results/hierarchical_all_reduce_2xh200.json): the NVSHMEM
# hierarchical all-reduce beat psum across 2 processes, each GPU its own node,
# at every measured size, 4 KiB to 4 MiB of bf16, in both loop modes
# (1.14-4.09x). Other process counts, node sizes and larger messages were not
# measured: "auto" runs psum there.
NVSHMEM_ALL_REDUCE_MEASURED_MAX_BYTES = 4 << 20
_NVSHMEM_MEASURED_PROCESSES = 2
_NVSHMEM_MEASURED_NODE_SIZE = 1


def _rows_per_rank(op: str, shapes: Shapes, n: int) -> int:
    """Rows of the GEMM each rank computes per block: x's rows, except for
    matmul_reduce_scatter, whose x holds all ``n`` blocks."""
    return shapes[0][0] // n if op == "matmul_reduce_scatter" else shapes[0][0]


Predicate = Callable[[Shapes, np.dtype, int, "int | None"], bool]


def _measured_faster(op: str) -> Predicate:
    def faster(shapes: Shapes, dtype: np.dtype, n: int, chunks: int | None) -> bool:
        del chunks  # measured with the op's default and explicit chunks alike
        return (n == _MEASURED_RANKS and dtype.itemsize == 2
                and _rows_per_rank(op, shapes, n) >= _MIN_ROWS[op])
    return faster


_reduce_scatter_rows_faster = _measured_faster("matmul_reduce_scatter")


def _reduce_scatter_faster(shapes: Shapes, dtype: np.dtype, n: int, chunks: int | None) -> bool:
    """Measured with the chunks of chunks=None only (see _MIN_ROWS)."""
    picked = collective_matmul_chunks("matmul_reduce_scatter", shapes, n)
    return _reduce_scatter_rows_faster(shapes, dtype, n, None) and chunks in (None, picked)


def _all_reduce_faster(shapes: Shapes, dtype: np.dtype, n: int, chunks: int | None) -> bool:
    del chunks
    nbytes = math.prod(shapes[0]) * dtype.itemsize
    return (n == _MEASURED_RANKS and dtype.itemsize == 2
            and nbytes <= all_reduce_region_bytes())


def _matmul_all_reduce_faster(shapes: Shapes, dtype: np.dtype, n: int,
                              chunks: int | None) -> bool:
    del chunks  # the composed path has none; the fused one was measured with its default
    (rows, _), (_, cols) = shapes
    if n != _MEASURED_RANKS or dtype.itemsize != 2:
        return False
    if rows >= _MIN_ROWS["matmul_all_reduce"]:  # the fused kernel, or dot + all-reduce
        return True
    return (rows >= _MIN_ROWS_COMPOSED_MATMUL_ALL_REDUCE
            and matmul_all_reduce_kernel(rows * cols * dtype.itemsize) == "gemm_then_all_reduce")


_CUDA_IS_FASTER: dict[str, Predicate] = {
    "all_gather_matmul": _measured_faster("all_gather_matmul"),
    "matmul_reduce_scatter": _reduce_scatter_faster,
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
      local_devices: CUDA devices of this process; default:
        :func:`process_cuda_devices`.
    """
    if workspace_mb is None:
        workspace_mb = _workspace_mb_from_env()
    if local_devices is None:
        local_devices = process_cuda_devices()
    senders = _sender_count(local_devices)
    # 64 MiB covers the GEMM workspace, the control words and rounding.
    slot = (max(workspace_mb - 64, 0) * (1 << 20) // 8 // senders
            - lamport_max_bytes(local_devices))
    # Each of the kernel's 128 blocks has a 1/128 stripe of the slot and takes
    # up to 16 KiB of a small message (ffi/src/all_reduce.cu): below that the
    # region holds no message reliably.
    if slot // 128 < _AR_BLOCK_BYTES + 256:
        return 0
    return slot - 128 * 256


_AR_BLOCK_BYTES = 16 << 10  # kMinBlockBytes of ffi/src/all_reduce.cu


@functools.cache
def process_cuda_devices() -> int:
    """The CUDA devices the extension lays its workspace out for.

    The extension counts them with ``cudaGetDeviceCount`` (which honours
    ``CUDA_VISIBLE_DEVICES``), and that count sizes its all-reduce slots. It
    can exceed JAX's local devices, e.g. under ``jax_cuda_visible_devices``
    or ``jax.distributed.initialize(local_device_ids=...)``. Asks the CUDA
    driver the same question; JAX's count where the default backend is not a
    GPU or no driver loads.
    """
    if jax.default_backend() in ("gpu", "cuda"):
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            count = ctypes.c_int(0)
            if driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0:
                return max(count.value, 1)
        except OSError:
            pass
    return jax.local_device_count()


def _sender_count(local_devices: int) -> int:
    """Local GPUs with slots in a device's memory: every other one, and one
    when it is alone (SenderCount of ffi/src/transport/transport.h)."""
    return max(local_devices - 1, 1)


def _workspace_mb_from_env() -> int:
    """JAX_FLASHOVERLAP_WORKSPACE_MB as the extension reads it (leading digits, at least 64)."""
    raw = os.environ.get("JAX_FLASHOVERLAP_WORKSPACE_MB")
    if raw is None:
        return 1024
    digits = re.match(r"\s*(\d*)", raw).group(1)
    return max(int(digits or 0), 64)


_PREFERRED_XLA: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "jax_flashoverlap_preferred_xla", default=frozenset())
# The ops whose impl="auto" this module resolves.
AUTO_OPS = tuple(_CUDA_IS_FASTER)


@contextlib.contextmanager
def prefer_xla(ops: Iterable[str]) -> Iterator[None]:
    """Within this context, ``impl="auto"`` lowers the named ops through XLA.

    "auto" follows measurements of each op alone; a model can measure
    otherwise in its own training step (Mamba-2's, see
    ``models.MambaConfig.auto_xla_ops``). "auto" decides when a program is
    lowered, i.e. at the first call of a jitted function for its shapes, so
    enter the context around that call: jit's cache does not know of it, and
    a function compiled outside it keeps its choice.

    Args:
      ops: names among :data:`AUTO_OPS` (empty: no change).
    """
    ops = frozenset(ops)
    unknown = sorted(ops - set(AUTO_OPS))
    if unknown:
        raise ValueError(f"prefer_xla: unknown ops {unknown}; expected names among {AUTO_OPS}")
    token = _PREFERRED_XLA.set(_PREFERRED_XLA.get() | ops)
    try:
        yield
    finally:
        _PREFERRED_XLA.reset(token)


def choose_impl(op: str, ffi_target: str, shapes: Shapes, dtype, n: int,
                chunks: int | None = None) -> str:
    """The implementation "auto" runs on a CUDA GPU.

    Args:
      op: public op name.
      ffi_target: the op's CUDA handler.
      shapes: shapes of the 2-D operands, per device.
      dtype: operand dtype.
      n: ranks along the axis.
      chunks: the op's ``chunks`` argument (None: picked by shape).

    Returns:
      "cuda" where it is built and measured faster, and ``op`` is not in an
      enclosing :func:`prefer_xla`, else "xla".
    """
    if op in _PREFERRED_XLA.get():
        return "xla"
    faster = _CUDA_IS_FASTER.get(op)
    if n > 1 and faster is not None and _extension.cuda_ops_available(ffi_target):
        if faster(shapes, np.dtype(dtype), n, chunks):
            return "cuda"
    return "xla"


def resolved_impl(op: str, ffi_target: str, shapes: Shapes, dtype, n: int,
                  platform: str | None = None, chunks: int | None = None) -> str:
    """What ``impl="auto"`` becomes on ``platform`` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "cuda"):
        return "xla"
    return choose_impl(op, ffi_target, shapes, dtype, n, chunks)


# The CUDA all-reduce's kernels; the position is the handler's `algorithm`
# attribute (ffi/src/all_reduce.cu).
ALL_REDUCE_ALGORITHMS = ("one_shot", "two_shot", "lamport")

# Largest message (bytes per rank) that runs one-shot; two-shot above it.
# Measured (benchmarks/results/all_reduce_2xh200.json, bf16, 2 H200s):
# one-shot was faster up to 4 MiB, even at 8 MiB (35.4 vs 35.8 us) and
# slower from 16 MiB (71.4 vs 62.3 us).
ONE_SHOT_MAX_BYTES = 8 << 20

# The flagless one-shot ("lamport") takes messages up to this many bytes per
# rank in a process with 2 GPUs (kLamportMaxBytes of
# ffi/src/transport/transport.h); less with more, see lamport_max_bytes.
LAMPORT_MAX_BYTES = 2 << 20
_LAMPORT_PARITY_BUDGET = 3 << 20  # kLamportParityBudget


def lamport_max_bytes(local_devices: int | None = None) -> int:
    """The largest message (bytes per rank) of ``algorithm="lamport"``.

    One parity of every other local GPU's Lamport slot shares a fixed 3 MiB
    (LamportSlotBytes of ffi/src/transport/transport.h): 2 MiB with 2 GPUs,
    1024 KiB with 4, 384 KiB with 8.

    Args:
      local_devices: CUDA devices of this process; default:
        :func:`process_cuda_devices`.
    """
    if local_devices is None:
        local_devices = process_cuda_devices()
    senders = _sender_count(local_devices)
    fit = _LAMPORT_PARITY_BUDGET // senders // (64 << 10) * (64 << 10)
    return min(fit, LAMPORT_MAX_BYTES)


# Largest message (bytes per rank) for which the size rule picks "lamport".
# Measured (benchmarks/results/all_reduce_lamport_2mib_2xh200.json, bf16, 2
# H200s, 8 all-reduces per loop iteration), lamport / one-shot / psum in us:
# 4.5 / 5.9 / 13.8 at 4 KiB, 5.1 / 8.1 / 12.7 at 256 KiB, 6.2 / 8.8 / 17.4 at
# 512 KiB, 7.6 / 11.3 / 18.6 at 1 MiB, 10.1 / 14.8 / 23.4 at 2 MiB. With one
# per iteration (host-bound, spreads of several us) 14.5 vs 13.5 one-shot at
# 1 MiB and 14.3 vs 17.2 at 2 MiB.
LAMPORT_AUTO_MAX_BYTES = 2 << 20


def all_reduce_algorithm(nbytes: int, n: int, dtype, local_devices: int | None = None) -> str:
    """The CUDA all-reduce kernel for a message of ``nbytes`` bytes per rank.

    Args:
      nbytes: message bytes per rank.
      n: ranks (local GPUs) in the all-reduce.
      dtype: the message's dtype.
      local_devices: CUDA devices of this process (they size the Lamport
        slots); default: :func:`process_cuda_devices`.

    Returns:
      "lamport" up to :data:`LAMPORT_AUTO_MAX_BYTES` where it was measured (2
      ranks, 16-bit dtypes; in float32 it would send one denormal as -0.0) and
      its slots hold the message (:func:`lamport_max_bytes`), "one_shot" up to
      :data:`ONE_SHOT_MAX_BYTES`, else "two_shot".
    """
    lamport_bytes = min(LAMPORT_AUTO_MAX_BYTES, lamport_max_bytes(local_devices))
    if (nbytes <= lamport_bytes and n == _MEASURED_RANKS
            and np.dtype(dtype).itemsize == 2):
        return "lamport"
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"


# How impl="cuda" matmul_reduce_scatter folds the peers' partials into the
# rank's own block: "gemm_input" (cuBLASLt's C input; each chunk's GEMM waits
# for that chunk from every peer) or "add_after" (the own GEMM at once, then
# one elementwise add, FlashOverlap's order). Measured against each other
# (collective_matmul_rs_fold_2xh200.json and ..._autotune_2xh200.json, 2 runs
# of 6 shapes): "add_after" was faster at 1024x4096x4096 (120 vs 133 us) and
# within a few percent either way elsewhere, while two chunks with
# "gemm_input" beat both on 4 of the 5 shapes from 1024 rows in the first
# run and on 3 of 5 in the autotuned one (add_after won at 2048x8192x7168,
# one chunk tied at 2048x8192x14336).
REDUCE_SCATTER_FOLDS = ("gemm_input", "add_after")
REDUCE_SCATTER_FOLD = "gemm_input"

# Where impl="cuda" all_gather_matmul and matmul_reduce_scatter wait for a
# peer's message: "side" (a one-thread wait kernel on a side stream from the
# call start) or "xla" (the same kernel on XLA's stream, just before the GEMM
# or add that reads the message). A spinning wait CTA holds an SM slot that a
# GEMM CTA could use: in matmul_reduce_scatter at 4096x8192x4096 the GEMM
# running beside the waits took 369.5 us of kernel time against 347.0 for
# the same-sized GEMM after them (kernel_times_2xh200.json), with no transfer
# running during the first. Measured against each other in one run
# (collective_matmul_xla_waits_2xh200.json, 12 shapes): "xla" was slower on 9
# of 12, by up to 42% (158.4 vs 111.4 us for matmul_reduce_scatter at
# 1024x4096x4096), and faster by 1.5% and 2.5% on two: "side" stays.
PEER_WAIT_STREAMS = ("side", "xla")
PEER_WAIT_STREAM = "side"

# impl="cuda" matmul_all_reduce up to this result size (bytes per rank): XLA's
# dot, then the one-kernel all-reduce on the same stream, instead of the fused
# op. A message this small is latency-bound, so chunking hides little, while
# the fused op pays per-chunk events and side streams. Measured
# (collective_matmul_mar_2xh200.json): 82.1 us composed against 99.0 XLA at
# 1024x4096x4096 (8 MiB result), 63.7 against 62.2 at 128x8192x8192; the
# fused op took 131.1 and 172.3 us on those shapes
# (collective_matmul_2xh200.json).
MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES = 8 << 20


# impl="cuda" and "decomposed" matmul_all_reduce cut the rows into chunks
# whose rows, but for the first chunk's, are a multiple of n times this: each
# rank's part of a chunk (the fused kernel splits every chunk into n parts, one
# GEMM each) then fills whole GEMM tiles. With 8-row chunks, 2048 rows in 2
# chunks on 2 GPUs made parts of 684 and 340 rows (6 and 3 tiles of 128
# rows); 256 makes them 768 and 256. The fused kernel in three runs
# (collective_matmul_mar_align*_2xh200.json, us, alignment 8 / 128 / 256,
# XLA): 2048x8192x7168 452-457 / 422-427 / 433-445, XLA 458-466;
# 2048x8192x14336 849-954 / 872-912 / 758-818, XLA 847-870; 4096x8192x4096
# 448-450 / 457-474 / 448-461, XLA 504-512; one run at 1024x4096x4096:
# 136.3 / 144.4 / 123.1. 256 is the best at 2048x8192x14336 and
# 1024x4096x4096, within 2.4% of the best at 4096x8192x4096, and 2.3-5.6%
# slower than 128 at 2048x8192x7168.
MATMUL_ALL_REDUCE_PART_ALIGN = 256


def matmul_all_reduce_kernel(nbytes: int) -> str:
    """How impl="cuda" runs a GEMM→AllReduce whose result has ``nbytes`` per rank.

    Returns:
      "gemm_then_all_reduce" up to :data:`MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES`
      (and what the all-reduce region holds), else "fused".
    """
    if nbytes <= min(MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES, all_reduce_region_bytes()):
        return "gemm_then_all_reduce"
    return "fused"


# Row chunks per block that impl="cuda" all_gather_matmul and
# matmul_reduce_scatter run when called with chunks=None, from these rows per
# rank (2 GPUs; one chunk elsewhere). Measured with one and two chunks in two
# runs (collective_matmul_rs_fold_2xh200.json, without and with GEMM
# autotuning): matmul_reduce_scatter with two was faster at 1024x4096x4096
# (113 vs 133 us; 112 vs 132), 2048x8192x7168 (776 vs 846; 816 vs 830),
# 4096x8192x4096 (818 vs 895; 805 vs 882) and 8192x8192x14336 (5866 vs 6075;
# 5731 vs 6044), slower at 2048x8192x14336 in one run (1601 vs 1544; 1473 vs
# 1473) and at 128x8192x8192 (153 vs 97; 157 vs 93). all_gather_matmul with
# two was faster only at 8192x8192x14336 (5572 vs 5629; 5486 vs 5684).
_TWO_CHUNKS_FROM_ROWS = {"all_gather_matmul": 8192, "matmul_reduce_scatter": 1024}


def collective_matmul_chunks(op: str, shapes: Shapes, n: int) -> int:
    """Row chunks per block for impl="cuda" ``op`` called with chunks=None.

    Args:
      op: "all_gather_matmul" or "matmul_reduce_scatter".
      shapes: shapes of the 2-D operands, per device (x, w).
      n: ranks along the axis.

    Returns:
      2 from the measured rows per rank on 2 GPUs, else 1.
    """
    rows = _rows_per_rank(op, shapes, n)
    if n == _MEASURED_RANKS and rows >= _TWO_CHUNKS_FROM_ROWS[op]:
        return 2
    return 1
