"""What happens after a fault in the CUDA transport: the sticky failure of a
group, :func:`reset`, and the fault-injection hook for tests.

A wait on another GPU that times out, or an error in the middle of a call,
can leave the GPUs of a group disagreeing about which message belongs to
which call. A GPU that ran on would then read its peers' stale data as if it
were new. So the group has *failed*, everywhere and for good: the call
that failed raises or returns NaN, and every later call on a group with a
failed GPU raises at once, on every GPU, naming the first fault, until
:func:`reset`. Errors that are the same on every rank and come before
anything moves (a shape the workspace cannot hold, too many chunks) fail
only their own call.

Under CUDA graph replay (XLA's command buffers) the all-reduce's host code
does not run: a replayed call after a fault returns NaN, and
:func:`~jax_flashoverlap.check_device_errors` raises. XLA does not run
again a command buffer whose run failed ("Command executor can be recorded
into the command buffer at most once"): after a fault and :func:`reset`,
build the program anew (a new ``jax.jit``).

A copy-engine op whose wait failed fills the receive slots it computes
from with NaN first, so that what it sends on (matmul_all_reduce's summed
rows) is NaN on its peers too, never a sum with an earlier call's partials.

The NVSHMEM all-reduce across processes fails on the host, for the rest of
the processes' lives (:func:`reset` does not cover it). On the device, a
wait that finds its partner two calls ahead (a process that timed out and
ran on) fails at once: that call returns NaN and the host raises, naming
the partner.
"""

from __future__ import annotations

import jax
import numpy as np

from . import _extension

__all__ = ["reset", "inject_fault", "FAULT_KINDS"]

FAULT_KINDS = ("error", "skip", "stall", "none")


def _ops_module(what: str):
    mod = _extension._module()
    if mod is None or not hasattr(mod, "reset") or not _extension.build_info()["cuda"]:
        raise RuntimeError(f"jax_flashoverlap.{what} needs the CUDA build of the extension "
                           f"(build_info()['cuda'] is False)")
    return mod


def reset() -> None:
    """Returns this process's CUDA transport to its state before its first
    call: no failed group, every flag and call counter zero, no injected
    fault.

    First it runs a small computation on every local GPU and waits for it:
    JAX runs a device's computations in the order they were dispatched, so
    the host code of every earlier one (e.g. the other shards of the call
    that failed) has run by then. Then it waits until every GPU the
    transport has used is idle (a pending wait gives up within its timeout,
    ``JAX_FLASHOVERLAP_TIMEOUT_MS``) and clears the transport. No other
    thread may dispatch CUDA ops meanwhile: a call that runs across the reset
    fails (its peers time out), but one that starts on some GPUs before it
    and on others after it may pair with the wrong call. A CPU-only build
    has no transport: there it does nothing.

    When groups span the processes of a node (:mod:`.node_transport`), it is
    collective: every process drains its GPUs, then all wait for each other
    (no message of an earlier call is still on its way), clear their own
    GPUs' transport, and wait for each other again before any runs on.
    Each wait is bounded and names the process that did not arrive.

    Raises:
      RuntimeError: a GPU reports a CUDA error (the process must restart),
        or another process did not reach the reset.
    """
    from . import distributed, node_transport

    mod = _extension._module()
    if mod is None or not hasattr(mod, "reset"):
        return
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    jax.block_until_ready([jax.device_put(np.float32(0), d) + 1 for d in gpus])
    layout = node_transport.current()
    across = layout is not None and layout.spans_processes()
    if across:
        distributed.check_same("reset: drained", {}, timeout_s=node_transport.DEFAULT_TIMEOUT_S)
    mod.reset()
    if across:
        distributed.check_same("reset: cleared", {}, timeout_s=node_transport.DEFAULT_TIMEOUT_S)


def inject_fault(kind: str, *, device: int, call: int = 1, stall_ms: int = 0) -> None:
    """Test hook, off unless called: makes a chosen call on one GPU fail.

    Args:
      kind: "error" (a collective matmul raises after its first send, or
        at its end when it sends nothing; the all-reduce before its launch),
        "skip" (the call raises at its start and sends nothing, as a rank
        that dropped out), "stall" (the call starts ``stall_ms`` late) or
        "none" (clears an injected fault).
      device: the GPU, a local ``jax.Device`` or its CUDA ordinal
        (``jax.Device.local_hardware_id``).
      call: the ``call``-th next call of a CUDA op on that GPU (1: the next).
      stall_ms: the delay of a "stall".
    """
    from . import node_transport

    if kind not in FAULT_KINDS:
        raise ValueError(f"inject_fault: kind must be one of {FAULT_KINDS}, got {kind!r}")
    if isinstance(device, jax.Device):
        device = device.local_hardware_id
    if device < 0 or call < 1 or stall_ms < 0:
        raise ValueError(f"inject_fault: need device >= 0, call >= 1 and stall_ms >= 0, got "
                         f"device={device}, call={call}, stall_ms={stall_ms}")
    layout = node_transport.current()
    if layout is not None and layout.spans_processes():
        # The transport names the node's devices by their ids there.
        ids = [layout.ids[d.id] for d in jax.local_devices() if d.local_hardware_id == device]
        if not ids:
            raise ValueError(f"inject_fault: no GPU of this process has CUDA ordinal {device}")
        device = ids[0]
    _ops_module("inject_fault").inject_fault(kind, device, call, stall_ms)
