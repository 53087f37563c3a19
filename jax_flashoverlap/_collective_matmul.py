"""What the CUDA kernels of all_gather_matmul and matmul_reduce_scatter share:
rows sent in chunks that are signalled one by one, waits for the peers on a
side stream or XLA's, and a GEMM of row blocks or of signalled tiles. Each
op's module adds what is its own (:mod:`.all_gather_matmul`,
:mod:`.matmul_reduce_scatter`)."""

from __future__ import annotations

import numpy as np

from . import _cuda_limits, cuda_policy
from .schedule import CollectiveMatmulSchedule

__all__ = ["cuda_attrs", "cuda_options"]


def cuda_options(op: str, gemm_policy: str, ctx, n: int, opts: dict) -> dict:
    """The choices both kernels make at lowering, from cuda_policy and checked.

    Args:
      op: "all_gather_matmul" or "matmul_reduce_scatter".
      gemm_policy: the cuda_policy setting that names the op's GEMM.
      ctx: the lowering context; its avals_in are x [m, k] and w [k, n_out].
      n: ranks along the axis.
      opts: the call's options; ``chunks`` None is picked by shape.

    Returns:
      ``opts`` with ``chunks``, ``peer_wait_stream`` and ``gemm`` decided.
    """
    if opts.get("chunks") is None:
        opts["chunks"] = cuda_policy.collective_matmul_chunks(
            op, [a.shape for a in ctx.avals_in], n)
    opts["peer_wait_stream"] = _cuda_limits.policy_choice("PEER_WAIT_STREAM",
                                                          cuda_policy.PEER_WAIT_STREAMS)
    opts["gemm"] = _cuda_limits.policy_choice(gemm_policy,
                                              getattr(cuda_policy, gemm_policy + "S"))
    if opts["gemm"] == "tile_signalled":
        _cuda_limits.check_tile_signalled(*ctx.avals_in, policy=gemm_policy)
    return opts


def cuda_attrs(sched: CollectiveMatmulSchedule, opts: dict, **own: np.int32) -> dict:
    """The FFI attributes both handlers bind, with the op's ``own`` after
    the schedule's (the order the handlers list them in): ``order`` [n*n],
    row r the blocks rank r computes, and the row chunks per block.

    The kernels send straight to every peer over NVLink: ``sched`` is the
    "direct" schedule, whatever topology the pure-JAX path was given.
    """
    return {"order": sched.order().reshape(-1), "chunks": np.int32(sched.chunks), **own,
            "waits_on_xla_stream": np.int32(opts["peer_wait_stream"] == "xla"),
            "tile_signalled": np.int32(opts["gemm"] == "tile_signalled")}
