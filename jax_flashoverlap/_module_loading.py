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
``CUDA_MODULE_LOADING=EAGER`` (or without those command buffers) three runs
in a row passed.

Importing :mod:`jax_flashoverlap` before JAX starts its GPU backend therefore
sets ``CUDA_MODULE_LOADING=EAGER`` unless the variable is already set; the
first CUDA op compiled in a process that loads lazily warns with the fix.
"""

from __future__ import annotations

import os
import warnings

from . import _jax_shim

__all__ = ["prefer_eager_loading", "warn_if_lazy"]

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
    if ENV in os.environ or _jax_shim.backends_initialized():
        return False
    os.environ[ENV] = "EAGER"
    return True


def warn_if_lazy(op: str) -> None:
    """Warns once per process when a CUDA op runs under lazy module loading."""
    global _warned
    if _warned or os.environ.get(ENV, "").upper() == "EAGER":
        return
    _warned = True
    warnings.warn(
        f"{op}(impl='cuda') in a process with CUDA lazy module loading "
        f"({ENV}={os.environ.get(ENV, 'unset')}): a kernel loaded while the op waits for "
        f"a peer GPU can stall both until the op's timeout. Set {ENV}=EAGER before "
        "JAX starts (importing jax_flashoverlap before the first JAX computation does "
        "this when the variable is unset).", RuntimeWarning, stacklevel=2)
