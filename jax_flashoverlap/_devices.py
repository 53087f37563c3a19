"""Device set-up shared by the command-line programs."""

import os


def ensure_cpu_devices(count: int) -> None:
    """Gives the CPU backend ``count`` devices, unless XLA_FLAGS already sets a count.

    XLA reads the flag when the CPU backend starts, i.e. at the first
    ``jax.devices()``, so this must run before that (importing jax is fine).
    GPU backends are unaffected: on a GPU machine the programs use the GPUs.
    """
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
