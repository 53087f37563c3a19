"""CUDA module loading: eager, so that no kernel load waits on a peer wait.

The CUDA ops wait for their peers on the device (a kernel that polls a flag
with a timeout). With CUDA lazy loading (the default since CUDA 12.2) the
first launch of a kernel loads its module, and the CUDA programming guide
warns ("Lazy Loading", concurrent execution) that a load may wait for the
device to go idle: a kernel that waits for another can then stall. On one
process driving several GPUs the wait crosses devices: device 1 polls for
data that device 0's host thread has yet to enqueue, while a module load
for device 1 waits for it to idle (and, as far as we can tell, holds a
driver lock that device 0's thread then needs). Measured on 2×H200: two
Mamba-2 blocks with impl="cuda", forward and backward, timed out in their
first call with lazy loading and XLA's cuBLAS command buffers; with
``CUDA_MODULE_LOADING=EAGER`` (or without those command buffers) 3 calls in
one process passed.

Importing :mod:`jax_flashoverlap` before JAX starts its backends (the first
``jax.devices()``, array or computation) therefore sets
``CUDA_MODULE_LOADING=EAGER`` unless the variable is already set. That is
process-wide and inherited by child processes: every CUDA library loads all
its kernels at start-up (one reading on an H200: 1326 MiB of GPU memory
after a matmul and a cuDNN attention call, against 874 MiB lazily). Set the
variable to ``LAZY`` to opt out. The first CUDA op compiled in a process whose
CUDA driver loads lazily (also when something else, e.g. torch, started CUDA
before the import) warns with the fix.
"""

from __future__ import annotations

import warnings

from . import _extension, _jax_shim, settings

__all__ = ["prefer_eager_loading", "driver_mode", "warn_if_lazy"]

ENV = "CUDA_MODULE_LOADING"
_warned = False


def prefer_eager_loading() -> bool:
    """Sets ``CUDA_MODULE_LOADING=EAGER`` if unset and CUDA not yet started.

    Returns:
      Whether the variable was set here. A value the user chose (``LAZY``
      included) is left alone, and so is a process whose JAX backends are
      already initialised (CUDA read the variable then; changing it later
      would only misreport the mode).
    """
    if settings.raw(ENV) is not None or _jax_shim.backends_initialized():
        return False
    settings.export(ENV, "EAGER")
    return True


def driver_mode() -> str:
    """The CUDA driver's module loading mode here: "lazy", "eager", or
    "unknown" (no extension, no driver, or CUDA not started)."""
    mod = _extension._module()
    return mod.module_loading_mode() if hasattr(mod, "module_loading_mode") else "unknown"


def warn_if_lazy(op: str) -> None:
    """Warns once per process when a CUDA op runs under lazy module loading.

    The driver's mode decides; where it is unknown (e.g. lowering for CUDA on
    a host without GPUs), the environment variable does.
    """
    global _warned
    if _warned:
        return
    mode = driver_mode()
    if mode == "unknown":
        mode = "eager" if settings.raw(ENV) == "EAGER" else "lazy"
    if mode == "eager":
        return
    _warned = True
    warnings.warn(
        f"{op}(impl='cuda') in a process where CUDA loads kernels lazily ({ENV}="
        f"{settings.raw(ENV) or 'unset'}): a kernel loaded while the op waits for a peer GPU "
        f"can stall both until the op's timeout. Set {ENV}=EAGER before CUDA starts "
        "(importing jax_flashoverlap before JAX starts its backends does this when the "
        "variable is unset).", RuntimeWarning, stacklevel=2)


# At import (the package imports this module first): the variable only counts
# before CUDA starts.
prefer_eager_loading()
