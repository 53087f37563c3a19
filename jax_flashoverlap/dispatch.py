"""``impl="auto"``: which implementation runs, per machine, op and shape.

:func:`resolve` decides, when a program is lowered, from the tuning tables of
:mod:`jax_flashoverlap.tuning`: measured, not assumed, on the machine it runs
on (``jax-flashoverlap-tune``), or on the machine that shipped a table (2
H200s). Untuned, "auto" is "xla": never slower than what users have today.
The CUDA paths' own measured settings (the all-reduce kernel by size,
chunks, the transport's room) are :mod:`jax_flashoverlap.cuda_policy`'s;
the NVSHMEM path across processes is decided here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence

import jax
import numpy as np

from . import _extension, cuda_policy
from ._op_handlers import FFI_TARGETS

__all__ = ["resolve", "explain", "Decision", "prefer_xla", "AUTO_OPS",
           "all_reduce_across_processes"]

Shapes = Sequence[tuple[int, ...]]

# all_reduce over an axis of processes, one GPU each
# (benchmarks/results/hierarchical_all_reduce_2xh200.json): the NVSHMEM
# hierarchical all-reduce beat psum across 2 processes, each GPU its own node,
# at every measured size, 4 KiB to 4 MiB of bf16, in both loop modes
# (1.14-4.09x). Other process counts, node sizes and larger messages were not
# measured: "auto" runs psum there.
NVSHMEM_ALL_REDUCE_MEASURED_MAX_BYTES = 4 << 20
_NVSHMEM_MEASURED_PROCESSES = 2
_NVSHMEM_MEASURED_NODE_SIZE = 1


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


_PREFERRED_XLA: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "jax_flashoverlap_preferred_xla", default=frozenset())
# The ops whose impl="auto" this module resolves.
AUTO_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce")


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


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``impl="auto"`` runs for one call, and why.

    Attributes:
      impl: "xla", "decomposed" or "cuda".
      reason: one line: the measurement (a :class:`~jax_flashoverlap.tuning.Entry`)
        or the rule behind it.
    """

    impl: str
    reason: str


def resolve(op: str, shapes: Shapes, dtype, n: int, *, platform: str,
            chunks: int | None = None, device_kind: str | None = None,
            devices: int | None = None, note_untuned: bool = True,
            processes: int = 1) -> Decision:
    """The one place that decides ``impl="auto"``, called when a program is lowered.

    It runs the implementation measured fastest for this machine (device
    kind and devices in the process), axis size, dtype, op and shape in the
    tuning tables (:mod:`jax_flashoverlap.tuning`: those shipped, then
    ``jax-flashoverlap-tune``'s cache). "cuda" only where the CUDA build has
    the op and the call fits what was measured; "xla" where nothing was
    measured (a machine with no table says so once, naming the command that
    tunes it).

    Args:
      op: public op name.
      shapes: shapes of the 2-D operands, per device.
      dtype: operand dtype.
      n: ranks along the axis.
      platform: the platform the program is compiled for ("cuda", "cpu", ...).
      chunks: the op's ``chunks`` argument (None: picked by shape).
      device_kind, devices: the machine to decide for (default: this one's
        devices of ``platform``: their kind, and how many the process has).
      note_untuned: log, once, that nothing was measured for this machine
        (:func:`explain` prints the decision itself).
      processes: how many processes the op's axis spans. A measurement in
        one process does not decide for an axis across processes: there the
        kernels reach only their peers' workspaces, not their outputs, so
        the all-reduce stages its gathers.
    """
    from . import tuning

    dtype = np.dtype(dtype)
    if n == 1:
        return Decision("xla", "one rank on the axis: every impl is the local dot")
    if op in _PREFERRED_XLA.get():
        return Decision("xla", f"{op} is in an enclosing dispatch.prefer_xla(...)")
    gpu = platform in ("cuda", "gpu")
    if device_kind is None or devices is None:
        machine = _machine(platform)
        if machine is None:
            return Decision("xla", f"no {platform} devices in this process to look up "
                                   f"(compiling for another platform)")
        device_kind, devices = device_kind or machine[0], devices or machine[1]
    kind, count = device_kind, devices
    entry, why = tuning.load().lookup(op, shapes, dtype.name, n, kind, count, dtype.itemsize,
                                      processes)
    if entry is None:
        if (note_untuned and processes == 1
                and (why.startswith("no tuning table") or " not tuned on " in why)):
            _say_untuned_once(kind, count, n, dtype.name)
        return Decision("xla", why)
    impls = ["xla", "decomposed"]
    unfit = _cuda_unfit(op, shapes, dtype, n, chunks, entry) if gpu else "not a CUDA platform"
    if gpu and not _extension.cuda_ops_available(FFI_TARGETS[op]):
        unfit = "the CUDA build lacks this op"
    if not unfit:
        impls.append("cuda")
    best = entry.fastest(impls) or "xla"
    note = f"; not cuda: {unfit}" if unfit and "cuda" in entry.times_us else ""
    exact = (tuning.rows_per_rank(op, shapes, n, dtype.itemsize) == entry.rows
             and tuning.size_of(op, shapes) == entry.weight)
    nearest = "" if exact else "another shape's (same or next lower row bucket, nearest weight): "
    return Decision(best, nearest + entry.describe() + note)


def _machine(platform: str) -> tuple[str, int] | None:
    """(device kind, devices in this process) of ``platform``; None without any."""
    gpu = platform in ("cuda", "gpu")
    try:
        local = jax.devices("gpu" if gpu else platform)
    except RuntimeError:
        return None
    return local[0].device_kind, (cuda_policy.process_cuda_devices() if gpu else len(local))


def _cuda_unfit(op: str, shapes: Shapes, dtype: np.dtype, n: int, chunks: int | None,
                entry) -> str:
    """Why impl="cuda" would run outside what ``entry`` measured ("" if it would not)."""
    kernel = None
    if op == "matmul_all_reduce":
        # The kernel the op's lowering will pick for this call (by result
        # size), and the one the measurement ran.
        kernel, measured = (cuda_policy.matmul_all_reduce_kernel(rows * cols * dtype.itemsize)
                            for rows, cols in ((shapes[0][0], shapes[1][1]),
                                               (entry.shape[0], entry.shape[2])))
        if kernel != measured:
            return f"it would run the {kernel} kernel, the measurement ran {measured}"
    needs = cuda_policy.transport_needs(op, shapes, dtype.itemsize, n)
    slot, staging = cuda_policy.transport_capacity()
    # gemm_then_all_reduce sends through the all-reduce kernel's region (which
    # matmul_all_reduce_kernel checked), not the fused kernel's slot and staging.
    if (op != "all_reduce" and kernel != "gemm_then_all_reduce"
            and not (needs[0] <= slot and needs[1] <= staging)):
        return (f"it needs {needs[0]} bytes per receive slot and {needs[1]} of staging, "
                f"the workspace has {slot} and {staging} (JAX_FLASHOVERLAP_WORKSPACE_MB)")
    if op == "all_reduce":
        nbytes = math.prod(shapes[0]) * dtype.itemsize
        if nbytes > cuda_policy.all_reduce_region_bytes():
            return (f"{nbytes} bytes exceed the all-reduce region "
                    f"({cuda_policy.all_reduce_region_bytes()} bytes; "
                    f"JAX_FLASHOVERLAP_WORKSPACE_MB)")
    if (op in cuda_policy.TWO_CHUNKS_FROM_ROWS
            and chunks not in (None, cuda_policy.collective_matmul_chunks(op, shapes, n))):
        return f"chunks={chunks} differs from the measured chunks=None"
    return ""


@functools.cache
def _say_untuned_once(device_kind: str, devices: int, n: int, dtype: str) -> None:
    # The command names the axis size and dtype: tune's defaults (all local
    # devices; bf16 on GPUs) need not be what a model's mesh runs.
    logging.getLogger("jax_flashoverlap").warning(
        "impl='auto' runs 'xla' over an axis of %d on %s x%d in %s: nothing measured there; "
        "run `jax-flashoverlap-tune --axis-size %d --dtype %s` once to measure it",
        n, device_kind, devices, dtype, n, dtype)


def explain(op: str, x_shape: Sequence[int], w_shape: Sequence[int] | None = None,
            dtype="bfloat16", axis_size: int = 2, *, platform: str | None = None,
            chunks: int | None = None, device_kind: str | None = None,
            devices: int | None = None) -> Decision:
    """Prints and returns what ``impl="auto"`` picks for one call, and from
    which measurement.

    Args:
      op: "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"
        or "all_reduce".
      x_shape: x per device as the op takes it, e.g. [rows, k] (leading dims
        are flattened into rows; all_reduce: any shape).
      w_shape: [k, n_out] (not for all_reduce).
      dtype: operand dtype.
      axis_size: ranks along the axis.
      platform: default: JAX's default backend.
      chunks: the op's ``chunks`` argument.
      device_kind, devices: another machine to ask about, e.g.
        ``device_kind="NVIDIA H200", devices=2, platform="cuda"``.
    """
    if op not in AUTO_OPS:
        raise ValueError(f"explain: op must be one of {AUTO_OPS}, got {op!r}")
    if (w_shape is None) != (op == "all_reduce"):
        raise ValueError(f"explain: {op} takes " + ("no w_shape" if op == "all_reduce"
                                                     else "w_shape [k, n_out]"))
    x_shape = tuple(x_shape)
    if not x_shape:
        raise ValueError(f"explain: x_shape must have at least one dim, got {x_shape}")
    if w_shape is not None and (len(w_shape) != 2 or w_shape[0] != x_shape[-1]):
        raise ValueError(f"explain: w_shape must be [k, n_out] with k = x_shape[-1] = "
                         f"{x_shape[-1]}, got {list(w_shape)}")
    name = np.dtype(dtype).name
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"explain: the ops take float32, bfloat16 or float16, got {name}")
    if (isinstance(axis_size, bool) or not isinstance(axis_size, numbers.Integral)
            or axis_size < 1):
        raise ValueError(f"explain: axis_size must be an int >= 1, got {axis_size!r}")
    shapes = ([(1, math.prod(x_shape))] if op == "all_reduce"
              else [(math.prod(x_shape[:-1]), x_shape[-1]), tuple(w_shape)])
    platform = platform or jax.default_backend()
    decision = resolve(op, shapes, dtype, axis_size, platform=platform, chunks=chunks,
                       device_kind=device_kind, devices=devices, note_untuned=False)
    print(f"{op} x{list(x_shape)}" + (f" w{list(w_shape)}" if w_shape else "")
          + f" {np.dtype(dtype).name}, axis size {axis_size}, {platform}: "
          f"auto -> {decision.impl!r}; {decision.reason}")
    return decision
