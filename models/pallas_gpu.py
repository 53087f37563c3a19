"""What the models' Pallas GPU kernels share: the Triton backend, and the
error a kernel gives where it cannot run."""

from __future__ import annotations

import jax

try:  # jax 0.11 marks Pallas's Triton backend deprecated: without it, "auto" runs XLA.
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None

__all__ = ["on_cuda", "plgpu", "require_runnable"]


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
