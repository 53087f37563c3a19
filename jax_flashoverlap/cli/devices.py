"""Device set-up shared by the command-line programs."""

import re

from .. import settings

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def ensure_cpu_devices(count: int) -> None:
    """Gives the CPU backend ``count`` devices, unless XLA_FLAGS already sets a count.

    XLA reads the flag when the CPU backend starts, i.e. at the first
    ``jax.devices()``, so this must run before that (importing jax is fine).
    GPU backends are unaffected: on a GPU machine the programs use the GPUs.
    """
    flag = f"{_DEVICE_COUNT_FLAG}={count}"
    flags = settings.raw("XLA_FLAGS") or ""
    if _DEVICE_COUNT_FLAG not in flags:
        settings.export("XLA_FLAGS", f"{flags} {flag}".strip())


def without_cpu_device_count(xla_flags: str) -> str:
    """``xla_flags`` less a CPU device count (for child processes that must not
    inherit one, e.g. from the test suite's conftest); the other flags stay."""
    return " ".join(re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", xla_flags).split())
