"""How impl="cuda" runs each op, as measured: the transport's room in the
workspace, the all-reduce kernel by message size, the collective matmuls'
chunks, matmul_reduce_scatter's fold and where peer waits run.

:mod:`jax_flashoverlap.dispatch` reads these when it resolves "auto", and the
lowering when it builds the CUDA handlers' attributes. Each constant names
the measurement behind it; the C++ facts it mirrors are compared with the
compiled extension's (``_extension.limits()``, tests/test_extension.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence

import jax
import numpy as np

from . import settings

__all__ = ["ALL_REDUCE_ALGORITHMS", "ALL_REDUCE_KERNELS", "COPY_ENGINE_ALL_REDUCE_CHUNKS",
           "all_reduce_algorithm", "all_reduce_region_bytes",
           "collective_matmul_chunks", "lamport_max_bytes", "matmul_all_reduce_kernel",
           "process_cuda_devices", "rows_per_rank", "transport_capacity", "transport_needs",
           "LAMPORT_AUTO_MAX_BYTES", "LAMPORT_MAX_BYTES", "MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES",
           "MATMUL_ALL_REDUCE_PART_ALIGN", "ONE_SHOT_MAX_BYTES", "PEER_WAIT_STREAM",
           "ALL_GATHER_GEMM", "ALL_GATHER_GEMMS",
           "MATMUL_ALL_REDUCE_GEMM", "MATMUL_ALL_REDUCE_GEMMS",
           "PEER_WAIT_STREAMS", "REDUCE_SCATTER_FOLD", "REDUCE_SCATTER_FOLDS",
           "TWO_CHUNKS_FROM_ROWS"]

Shapes = Sequence[tuple[int, ...]]

# The all-reduce, matmul_all_reduce and chunk rules below were measured on
# one machine, 2 H200s: each holds for this many ranks (local GPUs) only.
_MEASURED_RANKS = 2


def rows_per_rank(op: str, shapes: Shapes, n: int) -> int:
    """Rows of the GEMM each rank computes per block: x's rows, except for
    matmul_reduce_scatter, whose x holds all ``n`` blocks."""
    return shapes[0][0] // n if op == "matmul_reduce_scatter" else shapes[0][0]


# Fixed parts of the workspace (kGemmWorkspaceBytes of ffi/src/transport/transport.h,
# kControlBytes of peer_state.h; _extension.limits() has the compiled values,
# which tests/test_extension.py compares with these).
_GEMM_WORKSPACE_BYTES = 32 << 20
_CONTROL_BYTES = 128 << 10


def transport_capacity(workspace_mb: int | None = None,
                       local_devices: int | None = None) -> tuple[int, int]:
    """(receive slot, staging) bytes of the collective matmuls' transport, as
    the extension lays out the workspace (GetOrCreateDevice, ffi/src/transport/peer.cu):
    after the GEMM workspace, the control words and the all-reduce quarter,
    a third is staging and the rest two slots per sending GPU."""
    if workspace_mb is None:
        workspace_mb = _workspace_mb_from_env()
    if local_devices is None:
        local_devices = process_cuda_devices()
    data = (workspace_mb << 20) - _GEMM_WORKSPACE_BYTES - _CONTROL_BYTES
    rest = data - data // 4 // 256 * 256
    staging = rest // 3 // 256 * 256
    return (rest - staging) // (2 * _sender_count(local_devices)) // 256 * 256, staging


def transport_needs(op: str, shapes: Shapes, itemsize: int, n: int) -> tuple[int, int]:
    """(slot, staging) bytes impl="cuda" ``op`` checks for (CheckCapacity in its .cu)."""
    if op == "all_gather_matmul":
        return math.prod(shapes[0]) * itemsize, 0
    if op == "matmul_reduce_scatter":
        block = shapes[0][0] // n * shapes[1][1] * itemsize
        return block, (n - 1) * block
    if op == "matmul_all_reduce":
        result = shapes[0][0] * shapes[1][1] * itemsize
        return result, result
    return 0, 0


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


_AR_BLOCK_BYTES = 16 << 10  # kAllReduceMinBlockBytes (transport.h; _extension.limits())


def process_cuda_devices() -> int:
    """The devices the extension lays its workspace out for.

    Those of the node when its processes share the transport
    (:mod:`.node_transport`). Otherwise the extension counts them with
    ``cudaGetDeviceCount`` (which honours ``CUDA_VISIBLE_DEVICES``), and that
    count sizes its all-reduce slots. It can exceed JAX's local devices, e.g.
    under ``jax_cuda_visible_devices`` or
    ``jax.distributed.initialize(local_device_ids=...)``. Asks the CUDA
    driver the same question; JAX's count where the default backend is not a
    GPU or no driver loads.
    """
    from . import node_transport

    layout = node_transport.current()
    if layout is not None and layout.spans_processes():
        return layout.node_size
    return _driver_device_count()


@functools.cache
def _driver_device_count() -> int:
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
    """JAX_FLASHOVERLAP_WORKSPACE_MB (:mod:`jax_flashoverlap.settings`)."""
    return settings.get("JAX_FLASHOVERLAP_WORKSPACE_MB")


# The CUDA all-reduce's kernels; the position is the handler's `algorithm`
# attribute (ffi/src/all_reduce.cu).
ALL_REDUCE_KERNELS = ("one_shot", "two_shot", "lamport")
# Every algorithm all_reduce(impl="cuda") takes: the kernels, and
# "copy_engine", a two-shot whose transfers run on the copy engines (its own
# handler, ffi/src/all_reduce_copy_engine.cu; not one kernel, so XLA does not
# capture it in command buffers). all_reduce_algorithm does not pick it: it
# has not been measured yet.
ALL_REDUCE_ALGORITHMS = ALL_REDUCE_KERNELS + ("copy_engine",)

# The copy-engine two-shot's chunks: each chunk's sum and all-gather start
# while the next chunk's parts arrive. A starting point, not a measurement.
COPY_ENGINE_ALL_REDUCE_CHUNKS = 4

# Largest message (bytes per rank) that runs one-shot; two-shot above it.
# Measured (benchmarks/results/all_reduce_2xh200.json, bf16, 2 H200s):
# one-shot was faster up to 4 MiB, even at 8 MiB (35.4 vs 35.8 us) and
# slower from 16 MiB (71.4 vs 62.3 us).
ONE_SHOT_MAX_BYTES = 8 << 20

# The flagless one-shot ("lamport") takes messages up to this many bytes per
# rank in a process with 2 GPUs (kLamportMaxBytes of
# ffi/src/transport/transport.h); less with more, see lamport_max_bytes.
LAMPORT_MAX_BYTES = 2 << 20
_LAMPORT_PARITY_BUDGET = 3 << 20  # kLamportParityBudget (transport.h; _extension.limits())


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

# The GEMM of impl="cuda" matmul_reduce_scatter: "row_blocks" (cuBLASLt, one
# GEMM per row chunk, each sent when it is done) or "tile_signalled"
# (experimental: one CUTLASS GEMM over every row, whose epilogue counts
# finished tiles per row block of 256 so the copy engines send rows as
# they are written, with no cut; needs the extension built with CUTLASS,
# bf16 operands, K and N multiples of 8 and an sm_90 GPU). Not yet measured
# on two GPUs, so off.
REDUCE_SCATTER_GEMMS = ("row_blocks", "tile_signalled")
REDUCE_SCATTER_GEMM = "row_blocks"

# The GEMMs of impl="cuda" matmul_all_reduce's fused kernel: "row_blocks"
# (cuBLASLt, one GEMM per rank's part of every chunk) or "tile_signalled"
# (experimental: each rank owns 1/n of the rows; the peers' rows in one
# CUTLASS GEMM per side of the own part, sent as their row blocks of 256 are
# written, then the own part in chunks, each summed with the peers' partials
# and sent on while the next one computes). Same needs as
# REDUCE_SCATTER_GEMM's; not yet measured on two GPUs, so off.
MATMUL_ALL_REDUCE_GEMMS = ("row_blocks", "tile_signalled")
MATMUL_ALL_REDUCE_GEMM = "row_blocks"

# The GEMM of impl="cuda" all_gather_matmul: "row_blocks" (cuBLASLt, the own
# shard, then one GEMM per peer chunk once it landed) or "tile_signalled"
# (experimental, 2 ranks: the peer's shard lands in one [2m, K] frame beside
# the own one, and one gathering CUTLASS GEMM runs over the whole frame, its
# load warp waiting for each chunk's flag before it reads those rows; the
# backward's gathered x, when asked for, is copied after the GEMM). Same
# needs as REDUCE_SCATTER_GEMM's; not yet measured on two GPUs, so off.
ALL_GATHER_GEMMS = ("row_blocks", "tile_signalled")
ALL_GATHER_GEMM = "row_blocks"

# Where impl="cuda" all_gather_matmul and matmul_reduce_scatter wait for a
# peer's message: "side" (a wait kernel of one warp at most on a side stream
# from the call start) or "xla" (the same kernel on XLA's stream, just before
# the GEMM or add that reads the message). A spinning wait CTA holds an SM slot that a
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
TWO_CHUNKS_FROM_ROWS = {"all_gather_matmul": 8192, "matmul_reduce_scatter": 1024}


def collective_matmul_chunks(op: str, shapes: Shapes, n: int) -> int:
    """Row chunks per block for impl="cuda" ``op`` called with chunks=None.

    Args:
      op: "all_gather_matmul" or "matmul_reduce_scatter".
      shapes: shapes of the 2-D operands, per device (x, w).
      n: ranks along the axis.

    Returns:
      2 from the measured rows per rank on 2 GPUs, else 1.
    """
    rows = rows_per_rank(op, shapes, n)
    if n == _MEASURED_RANKS and rows >= TWO_CHUNKS_FROM_ROWS[op]:
        return 2
    return 1
