"""The NVRAR hierarchical all-reduce on NVSHMEM, for several processes and nodes.

Tested on one machine with 2 processes (2 H200s: each GPU its own node, and
both in one node; tests/test_nvshmem_all_reduce.py); not yet run with more
processes or across real nodes.

One process per GPU (``python -m jax_flashoverlap.cli.launch -n N script.py``),
processes grouped into nodes of :func:`jax_flashoverlap.distributed.node_size`
consecutive processes. :func:`all_reduce` reduce-scatters within a node over
NVLink, runs recursive doubling across nodes (NVSHMEM put-with-signal into
per-step receive slots, call sequence numbers as signal values, bounded
waits), then all-gathers within the node, in one kernel with no host state
per call. The node count must be a power of two.

This path is opt-in at build time: the compiled module
``jax_flashoverlap._nvshmem_ffi`` exists only when the package was built with
the CMake option ``JFO_ENABLE_NVSHMEM=ON`` and the ``nvidia-nvshmem-cu13``
wheel installed::

    pip install --no-build-isolation -C cmake.define.JFO_ENABLE_NVSHMEM=ON .

``jax_flashoverlap.all_reduce`` uses it too, over a mesh axis that spans
all processes one GPU each, once :func:`initialize` ran (impl="cuda"
always, impl="auto" where it was measured faster than psum:
:func:`jax_flashoverlap.dispatch.all_reduce_across_processes`). Usage::

    from jax_flashoverlap import distributed, nvshmem
    distributed.initialize()
    nvshmem.initialize(heap_mb=1024)
    f = jax.jit(jax.shard_map(lambda v: nvshmem.all_reduce(v, "p"), mesh=mesh,
                              in_specs=P("p"), out_specs=P("p")))
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from . import distributed, settings

__all__ = [
    "TARGET",
    "ffi_all_reduce",
    "is_built",
    "is_initialized",
    "initialize",
    "finalize",
    "all_reduce",
    "max_message_bytes",
    "check_device_errors",
]

TARGET = "jfo_nvshmem_all_reduce"
DEFAULT_TIMEOUT_MS = 10_000
_MAX_NODE_SIZE = 8
_DTYPES = ("bfloat16", "float16", "float32")
_NOT_BUILT = (
    "jax_flashoverlap was built without its NVSHMEM module (jax_flashoverlap._nvshmem_ffi). "
    "It is opt-in: install the nvidia-nvshmem-cu13 wheel and rebuild with the CMake option "
    "JFO_ENABLE_NVSHMEM=ON: `pip install --no-build-isolation "
    "-C cmake.define.JFO_ENABLE_NVSHMEM=ON .`")
_NEEDS_DISTRIBUTED = (
    "needs jax.distributed with one GPU per process: start the program with "
    "`python -m jax_flashoverlap.cli.launch -n N script.py` and call "
    "jax_flashoverlap.distributed.initialize() first (or jax.distributed.initialize "
    "yourself, e.g. under SLURM)")


@functools.cache
def _load() -> tuple[Any | None, str]:
    """The compiled module, or None and why it did not import."""
    try:
        return importlib.import_module("jax_flashoverlap._nvshmem_ffi"), ""
    except ImportError as e:
        return None, str(e)


def _module() -> Any | None:
    return _load()[0]


def is_built() -> bool:
    """Whether the NVSHMEM module was built and imports."""
    return _module() is not None


def _require_module(what: str) -> Any:
    mod, why = _load()
    if mod is None:
        detail = f" (import error: {why})" if why and "No module named" not in why else ""
        raise RuntimeError(f"jax_flashoverlap.nvshmem.{what}: {_NOT_BUILT}{detail}")
    return mod


def is_initialized() -> bool:
    """Whether :func:`initialize` ran in this process (and no :func:`finalize` since)."""
    mod = _module()
    return bool(mod is not None and mod.info()["initialized"])


@functools.cache
def _register() -> None:
    import jax

    for name, capsule in _module().registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def initialize(heap_mb: int = 1024, *, timeout_s: float = 300.0) -> None:
    """Starts NVSHMEM on every process and allocates the all-reduce buffers.

    Collective: every process calls it, after
    :func:`jax_flashoverlap.distributed.initialize`. Process 0 creates an
    NVSHMEM unique id, :func:`~jax_flashoverlap.distributed.broadcast_bytes`
    shares it, and each process joins as PE ``jax.process_index()``. Half the
    symmetric heap holds the all-reduce buffers (see :func:`max_message_bytes`).
    NVLink multicast stays off (``NVSHMEM_DISABLE_NVLS=1``). A second call
    does nothing.

    Args:
      heap_mb: NVSHMEM symmetric heap per GPU (``NVSHMEM_SYMMETRIC_SIZE``), MiB.
        It comes out of the GPU memory XLA has not taken: with XLA's default
        preallocation (75%) keep it well under a quarter of the GPU.
      timeout_s: the bound of NVSHMEM's own start-up (its barriers and
        collective allocations wait on every process without one): a process
        still inside it after this long exits with
        :data:`~jax_flashoverlap.distributed.STUCK_EXIT_STATUS` and a message
        (:func:`~jax_flashoverlap.distributed.exit_if_stuck`).

    Raises:
      RuntimeError: the module was not built (names the CMake option), or
        ``jax.distributed`` is not initialised, or a process has more than
        one GPU, or a process does not arrive within a minute, or NVSHMEM
        fails to start. (A process stuck in NVSHMEM's start-up exits
        instead, after ``timeout_s``.)
      ValueError: the processes passed different ``heap_mb`` or run with
        different node sizes (``JAX_FLASHOVERLAP_NODE_SIZE``).
    """
    mod = _require_module("initialize")
    import jax

    if not jax.distributed.is_initialized():
        raise RuntimeError(f"jax_flashoverlap.nvshmem.initialize {_NEEDS_DISTRIBUTED}")
    if mod.info()["initialized"]:
        return
    devices = jax.local_devices()
    if len(devices) != 1 or devices[0].platform != "gpu":
        raise RuntimeError(f"jax_flashoverlap.nvshmem.initialize: NVSHMEM takes one GPU per "
                           f"process, this process has {devices}; the launcher gives each "
                           f"process one GPU")
    if heap_mb < 1:
        raise ValueError(f"heap_mb={heap_mb} must be positive")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive")
    # NVSHMEM's own start-up waits on every process without a bound: agree
    # first, with one, on everything the processes must share.
    distributed.check_same("jax_flashoverlap.nvshmem.initialize",
                           {"heap_mb": int(heap_mb), "node_size": distributed.node_size()})
    settings.export("NVSHMEM_DISABLE_NVLS", "1")
    # NVSHMEM reads its environment once, at the first call (get_unique_id on
    # process 0): the heap size must be set before it, on every process alike.
    settings.export("NVSHMEM_SYMMETRIC_SIZE", str(int(heap_mb) << 20))
    me = jax.process_index()
    uid = distributed.broadcast_bytes(mod.get_unique_id() if me == 0 else None, root=0)
    ordinal = getattr(devices[0], "local_hardware_id", None)
    with distributed.exit_if_stuck("jax_flashoverlap.nvshmem.initialize (NVSHMEM start-up)",
                                   timeout_s):
        mod.init(uid, me, jax.process_count(), int(heap_mb) << 20,
                 0 if ordinal is None else int(ordinal),
                 hostlib=settings.get("JAX_FLASHOVERLAP_NVSHMEM_INIT") == "hostlib",
                 debug=settings.get("JAX_FLASHOVERLAP_NVSHMEM_DEBUG"))
    _register()


def finalize(*, timeout_s: float = 60.0) -> None:
    """Collective: frees the buffers and shuts NVSHMEM down (no-op if not started).

    Also drops JAX's compiled functions (``jax.clear_caches()``): those that
    ``jax_flashoverlap.all_reduce`` lowered to the NVSHMEM all-reduce would
    otherwise keep calling it.

    Args:
      timeout_s: the bound of NVSHMEM's shut-down barrier, as in :func:`initialize`.
    """
    mod = _module()
    if mod is not None and mod.info()["initialized"]:
        with distributed.exit_if_stuck("jax_flashoverlap.nvshmem.finalize (NVSHMEM shut-down)",
                                       timeout_s):
            mod.finalize()
        import jax

        jax.clear_caches()


def max_message_bytes(node_size: int | None = None) -> int:
    """Largest all-reduce, in bytes per process, the buffers hold (0 before initialize)."""
    mod = _require_module("max_message_bytes")
    return int(mod.max_message_bytes(node_size or distributed.node_size()))


def check_device_errors() -> None:
    """Raises if an all-reduce's bounded wait expired (its output is NaN then).

    The next :func:`all_reduce` raises it too; call this after
    ``block_until_ready`` to raise at once.
    """
    mod = _module()
    message = mod.pending_error() if mod is not None else None
    if message:
        raise RuntimeError(message)


def all_reduce(x, axis_name: str, *, node_size: int | None = None,
               timeout_ms: int = DEFAULT_TIMEOUT_MS):
    """Sum of ``x`` over every process (NVRAR on NVSHMEM).

    Use inside ``jax.shard_map`` over a mesh axis that spans all processes,
    one GPU each, after :func:`initialize`; compiles for the CUDA platform
    only. Every process gets the same bits (each slice is summed once, in a
    fixed order, then copied). ``jax.ffi.ffi_call`` types the result as
    invariant over ``axis_name`` (as ``lax.psum``'s), so ``out_specs`` may
    omit the axis. Every process must run the same all-reduces in the same
    order. Not differentiable (no VJP is defined).

    Args:
      x: this process's operand: bfloat16, float16 or float32, any shape.
      axis_name: the shard_map axis over all processes.
      node_size: consecutive processes per node (default
        :func:`jax_flashoverlap.distributed.node_size`); at most 8, and the
        node count must be a power of two. 1 makes every GPU its own node
        (the inter-node path on one machine).
      timeout_ms: bound of every wait; a missing peer yields NaN and an error
        from the next call or :func:`check_device_errors`.

    Returns:
      The sum over all processes, shape and dtype of ``x``.
    """
    import jax
    import jax.numpy as jnp

    _require_module("all_reduce")
    if not is_initialized():
        raise RuntimeError("jax_flashoverlap.nvshmem.all_reduce: call "
                           "jax_flashoverlap.nvshmem.initialize() first")
    n = jax.process_count()
    axis_size = jax.lax.axis_size(axis_name)
    if axis_size != n:
        raise ValueError(f"nvshmem.all_reduce: axis {axis_name!r} has {axis_size} devices, but "
                         f"it reduces over all {n} processes (one GPU each)")
    if jnp.dtype(x.dtype).name not in _DTYPES:
        raise TypeError(f"nvshmem.all_reduce: dtype {x.dtype} is not one of {_DTYPES}")
    return ffi_all_reduce(x, node_size=node_size, timeout_ms=timeout_ms)


def ffi_all_reduce(x, *, node_size: int | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS):
    """The custom call of :func:`all_reduce`, after its checks of the node layout.

    Also what ``jax_flashoverlap.all_reduce`` lowers to across processes.
    """
    import jax

    n = jax.process_count()
    g = distributed.node_size() if node_size is None else int(node_size)
    if not 1 <= g <= _MAX_NODE_SIZE or n % g:
        raise ValueError(f"nvshmem.all_reduce: node_size={g} must be in [1, {_MAX_NODE_SIZE}] "
                         f"and divide the process count {n}")
    nodes = n // g
    if nodes & (nodes - 1):
        raise ValueError(f"nvshmem.all_reduce: {nodes} nodes ({n} processes / node_size {g}); "
                         f"the node count must be a power of two")
    if timeout_ms <= 0:
        raise ValueError(f"timeout_ms={timeout_ms} must be positive")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, node_size=np.int32(g), timeout_ms=np.int32(timeout_ms))
