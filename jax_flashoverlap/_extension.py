"""Loading the compiled extension and registering its FFI handlers.

The extension ``jax_flashoverlap._ffi`` is optional at import: without it (or
without its CUDA half) the pure-JAX implementations still work and
``impl="cuda"`` fails with a message that says how to get the CUDA build.
Handlers are registered with XLA once, on first import.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import jax

from . import settings

__all__ = ["build_info", "cuda_ops_available", "require_cuda_ops", "check_device_errors",
           "push_settings"]

_NOT_BUILT = ("jax_flashoverlap was installed without its compiled extension "
              "(jax_flashoverlap._ffi).")
_HOW_TO_BUILD = ("Reinstall from source on a machine with nvcc (CUDA 12.8 or later) and the "
                 "nvidia-cublas wheel: `pip install --no-build-isolation .` "
                 "(README: 'Install'; docs/design.md: 'Building with CUDA').")


@functools.cache
def _module() -> Any | None:
    try:
        return importlib.import_module("jax_flashoverlap._ffi")
    except ImportError:
        return None


@functools.cache
def _register() -> tuple[str, ...]:
    """Registers every handler the extension exports; returns their names."""
    mod = _module()
    if mod is None:
        return ()
    _point_at_cublaslt(mod)
    push_settings()  # for ffi_call users that lower no op of this package first
    names = []
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        names.append(name)
    return tuple(sorted(names))


def _point_at_cublaslt(mod: Any) -> None:
    """Tells the extension where the nvidia-cublas wheel keeps libcublasLt.

    The extension loads cuBLASLt lazily (so that it imports where there is
    none); jax's CUDA plugin normally has it loaded already, this is the
    fallback path.
    """
    if not hasattr(mod, "set_cublaslt_path"):
        return
    try:
        import nvidia.cu13  # type: ignore[import-not-found]
    except ImportError:
        return
    for root in getattr(nvidia.cu13, "__path__", []):
        path = os.path.join(root, "lib", "libcublasLt.so.13")
        if os.path.exists(path):
            mod.set_cublaslt_path(path)
            return


def push_settings() -> dict[str, Any] | None:
    """Checks every setting (:func:`settings.check_all`) and hands the
    extension the ones its ops use, as :mod:`~jax_flashoverlap.settings`
    parsed them: the extension reads no environment variable itself.

    Called when the handlers are registered and whenever a CUDA op is
    lowered: an op runs with the values of the latest lowering before it (or
    of the import). A GPU's workspace is sized at its first op, and whether
    kernels store into peers is fixed at the process's first two-shot
    all-reduce.

    Returns:
      The extension's settings after the call, None without the extension.
    """
    settings.check_all()
    mod = _module()
    if mod is None:
        return None
    mod.configure(workspace_mb=settings.get("JAX_FLASHOVERLAP_WORKSPACE_MB"),
                  peer_stores=settings.get("JAX_FLASHOVERLAP_PEER_STORES"),
                  gemm_autotune=settings.get("JAX_FLASHOVERLAP_GEMM_AUTOTUNE"))
    return mod.settings()


def build_info() -> dict[str, Any]:
    """What the installed extension was built with.

    Returns:
      A dict with keys ``extension`` (bool: the compiled module imports),
      ``cuda`` (bool: CUDA kernels were compiled), ``cuda_version`` (str),
      ``architectures`` (CMake CUDA architectures, e.g. ``["80-real", "100"]``:
      "-real" machine code only, plain also PTX), ``cublaslt`` (bool:
      the GEMM ops were compiled), ``cutlass`` (str: the CUTLASS version
      the tile-signalled GEMM was built with, "" without it) and
      ``ffi_targets`` (registered handler names).
    """
    mod = _module()
    if mod is None:
        return {"extension": False, "cuda": False, "cuda_version": "",
                "architectures": [], "cublaslt": False, "cutlass": "", "ffi_targets": []}
    info = dict(mod.build_info())
    info["extension"] = True
    info["ffi_targets"] = list(_register())
    return info


def limits() -> dict[str, int]:
    """The CUDA transport's layout limits as compiled (empty without the CUDA
    ops): what :mod:`jax_flashoverlap.dispatch` mirrors in Python."""
    mod = _module()
    return dict(mod.limits()) if mod is not None and hasattr(mod, "limits") else {}


def cuda_ops_available(target: str | None = None) -> bool:
    """Whether CUDA handlers (or the named one) are built and registered."""
    names = _register()
    return bool(names) if target is None else target in names


def require_cuda_ops(op: str, target: str) -> None:
    """Raises a clear error when ``impl="cuda"`` cannot run ``op``."""
    if _module() is None:
        raise RuntimeError(f"{op}(impl='cuda'): {_NOT_BUILT} {_HOW_TO_BUILD}")
    if not cuda_ops_available():
        raise RuntimeError(
            f"{op}(impl='cuda'): the installed jax_flashoverlap was built without "
            f"CUDA (build_info()={build_info()}). {_HOW_TO_BUILD}")
    if not cuda_ops_available(target):
        raise NotImplementedError(
            f"{op}(impl='cuda'): this build has no CUDA kernel for {op} (FFI target "
            f"{target!r} is missing); use impl='xla', 'decomposed' or 'auto'.")


def check_device_errors() -> None:
    """Raises if a CUDA op recorded an error on the device (e.g. a peer
    timeout), or if a group of GPUs has failed (:mod:`jax_flashoverlap.faults`).

    The kernels cannot raise from the GPU: a bounded wait that expires records
    which rank it waited for and fills the op's output with NaN. From then on
    the group has failed: every call on it raises (under CUDA graph replay,
    returns NaN) and this function raises, until
    :func:`jax_flashoverlap.reset`. Call it after ``block_until_ready`` to
    raise at once.
    """
    mod = _module()
    message = mod.pending_error() if mod is not None and hasattr(mod, "pending_error") else None
    if message:
        raise RuntimeError(message)
