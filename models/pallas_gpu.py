"""What the models' GPU kernels share: the Triton backend, the error a
Pallas kernel gives where it cannot run, and how a CUDA kernel's call falls
back to its JAX reference off CUDA GPUs."""

from __future__ import annotations

from typing import Callable

import jax
from jax import lax

from jax_flashoverlap import build_info

try:  # jax 0.11 marks Pallas's Triton backend deprecated: without it, "auto" runs XLA.
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None

__all__ = ["kernel_or_reference", "on_cuda", "plgpu", "require_runnable"]


def on_cuda(device: jax.Device | None = None) -> bool:
    """Whether ``device`` (default the first) is a CUDA GPU, where the
    kernels' "auto" settings run them."""
    device = device or jax.devices()[0]
    return device.platform == "gpu" and "cuda" in device.client.platform_version.lower()


def require_runnable(kernel: str, reason: str | None, interpret: bool, fix: str) -> None:
    """Raises a ValueError naming ``kernel`` and ``fix`` (e.g. "use
    conv_impl='xla'") when ``reason`` (the shape's, from the kernel's
    ``unsupported_reason``) is set, or when the kernels would compile
    (``interpret`` False) off a GPU."""
    if reason:
        raise ValueError(f"{kernel}: {reason}; {fix}.")
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f"{kernel} runs on CUDA GPUs only (Pallas Triton), and the default "
                         f"backend is {jax.default_backend()!r}; {fix}.")


def kernel_or_reference(target: str, setting: str, kernel: Callable, reference: Callable,
                        *operands):
    """``kernel(*operands)`` where the program runs on a CUDA GPU and
    ``reference(*operands)`` elsewhere (``lax.platform_dependent``).

    A package built without the FFI ``target`` runs the reference off CUDA
    GPUs; on them it raises a RuntimeError naming ``setting`` (the config
    field that asked for the kernel, e.g. "TransformerConfig(decode_blocks=
    'cuda')") and the fix.
    """
    info = build_info()  # registers the kernels with XLA where they are built
    if target not in info["ffi_targets"]:
        if on_cuda():
            raise RuntimeError(
                f"{setting}: the installed jax_flashoverlap has no {target!r} kernel "
                f"(build_info()={info}); build it with CUDA or use decode_blocks='layers'.")
        return reference(*operands)
    return lax.platform_dependent(*operands, cuda=kernel, default=reference)
