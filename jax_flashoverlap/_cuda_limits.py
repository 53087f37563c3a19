"""What the CUDA handlers accept, checked when an op is lowered.

Each check mirrors a refusal of the extension's (ffi/src), so that a call it
would refuse at run time, on every GPU and after XLA compiled the program,
is a ValueError naming the fix at compile time instead. The cuda_policy
settings a user may set are checked here too, when an op reads them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from . import _extension, cuda_policy

__all__ = ["EVENTS_PER_CALL", "check_copy_engine_size", "check_event_budget",
           "check_lamport_size", "check_tile_signalled", "policy_choice"]

# CUDA events one call of a fused op may record (kEventsPerCall of
# ffi/src/transport/transport.h; _extension.limits() has the compiled value).
EVENTS_PER_CALL = 1024


def check_event_budget(chunks: int, n: int) -> None:
    """The fused matmul_all_reduce records 3(n-1)+1 events a chunk, one at
    the start and 2(n-1)+1 at the end; more than the budget is refused here,
    at compile time (the extension checks again before its first send)."""
    needed = chunks * (3 * (n - 1) + 1) + 2 * n
    if needed > EVENTS_PER_CALL:
        most = (EVENTS_PER_CALL - 2 * n) // (3 * (n - 1) + 1)
        raise ValueError(
            f"matmul_all_reduce(impl='cuda'): {chunks} chunks on {n} ranks need {needed} CUDA "
            f"events per call, more than {EVENTS_PER_CALL}; use chunks <= {most}")


def check_lamport_size(aval, algorithm: str) -> None:
    """The Lamport kernel's slots hold cuda_policy.lamport_max_bytes() per rank."""
    nbytes = math.prod(aval.shape) * aval.dtype.itemsize
    limit = cuda_policy.lamport_max_bytes()
    if algorithm == "lamport" and nbytes > limit:
        raise ValueError(
            f"all_reduce(impl='cuda', algorithm='lamport') takes up to "
            f"{limit >> 10} KiB per rank with {cuda_policy.process_cuda_devices()} CUDA "
            f"devices in the process, got {aval.shape} {aval.dtype} ({nbytes} bytes); use "
            f"algorithm='one_shot' or None")


def check_copy_engine_size(aval) -> None:
    """The copy engines' two-shot lands every peer's parts in one receive
    slot of the transport (CheckCapacity, ffi/src/all_reduce_copy_engine.cu)."""
    nbytes = math.prod(aval.shape) * aval.dtype.itemsize
    slot, _ = cuda_policy.transport_capacity()
    if nbytes > slot:
        raise ValueError(
            f"all_reduce(impl='cuda', algorithm='copy_engine'): {aval.shape} {aval.dtype} is "
            f"{nbytes} bytes per rank, more than the transport's receive slot of {slot} bytes; "
            f"raise JAX_FLASHOVERLAP_WORKSPACE_MB (before the first CUDA op of the process) "
            f"or use algorithm='two_shot'")


def check_tile_signalled(x, w, policy: str) -> None:
    """What the tile-signalled GEMM needs of the build and of x [rows, K] and
    w [K, N], or a ValueError naming the fix; ``policy``: the cuda_policy
    setting that chose it."""
    what = f"the tile-signalled GEMM (cuda_policy.{policy})"
    fix = f"; or set cuda_policy.{policy} = 'row_blocks'"
    if not _extension.build_info().get("cutlass"):
        raise ValueError(f"{what} needs the "
                         "extension built with CUTLASS: pip install nvidia-cutlass==4.2.0.0, "
                         "then pip install --no-build-isolation ." + fix)
    k, n = w.shape
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or k % 8 or n % 8:
        raise ValueError(f"{what} takes "
                         f"bf16 x and w with K and N multiples of 8, got x {x.dtype} {x.shape} "
                         f"and w {w.dtype} {w.shape}" + fix)


def policy_choice(name: str, choices: tuple[str, ...]) -> str:
    """cuda_policy.<name>, checked against its choices (users may set it)."""
    value = getattr(cuda_policy, name)
    if value not in choices:
        raise ValueError(f"cuda_policy.{name} must be one of {choices}, got {value!r}")
    return value
