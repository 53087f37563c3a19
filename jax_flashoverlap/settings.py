"""Every environment variable the library reads, parsed strictly.

A value that does not parse, or is out of range, raises an error naming the
variable and what it accepts, never a silent default. The package checks
every set variable when it is imported (:func:`check_all`), and again
whenever it lowers a CUDA op, when it hands the compiled extension the
values its ops use (``_extension.push_settings``; NVSHMEM's two go to its
``init``): the extension reads no environment variable itself.

- ``JAX_FLASHOVERLAP_WORKSPACE_MB``: per-GPU workspace of the CUDA ops, MiB,
  64 to 1048576 (default 1024).
- ``JAX_FLASHOVERLAP_TIMEOUT_MS``: bound of every wait on another GPU, ms,
  1 to 2147483647 (default 10000).
- ``JAX_FLASHOVERLAP_GEMM_AUTOTUNE``: 1 (default) times cuBLASLt's candidate
  algorithms per shape; 0 takes its first heuristic.
- ``JAX_FLASHOVERLAP_PEER_STORES``: 1 (default) lets kernels store into
  peers' memory over NVLink where allowed; 0 never.
- ``JAX_FLASHOVERLAP_NVSHMEM_INIT``: "hostlib" (default) or "inline".
- ``JAX_FLASHOVERLAP_NVSHMEM_DEBUG``: 1 logs NVSHMEM start-up; 0 (default) quiet.

The launcher's variables (``JAX_FLASHOVERLAP_PROCESS_ID`` and the rest) are checked by
:mod:`jax_flashoverlap.distributed` when a program starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

__all__ = ["Setting", "SETTINGS", "get", "check_all"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its default and how it parses."""

    name: str
    default: Any
    accepts: str
    parse: Callable[[str], Any]


def _integer(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        if not re.fullmatch(r"\s*\d+\s*", raw) or not low <= int(raw) <= high:
            raise ValueError
        return int(raw)
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError
        return raw
    return parse


def _flag(raw: str) -> bool:
    return _choice("0", "1")(raw) == "1"


SETTINGS = {s.name: s for s in (
    Setting("JAX_FLASHOVERLAP_WORKSPACE_MB", 1024, "an integer number of MiB from 64 to 1048576",
            _integer(64, 1 << 20)),
    Setting("JAX_FLASHOVERLAP_TIMEOUT_MS", 10_000,
            "an integer number of milliseconds from 1 to 2147483647", _integer(1, 2**31 - 1)),
    Setting("JAX_FLASHOVERLAP_GEMM_AUTOTUNE", True, "0 or 1", _flag),
    Setting("JAX_FLASHOVERLAP_PEER_STORES", True, "0 or 1", _flag),
    Setting("JAX_FLASHOVERLAP_NVSHMEM_INIT", "hostlib", "hostlib or inline",
            _choice("hostlib", "inline")),
    Setting("JAX_FLASHOVERLAP_NVSHMEM_DEBUG", False, "0 or 1", _flag),
)}


def get(name: str) -> Any:
    """The parsed value of setting ``name`` (its default when unset).

    Raises:
      ValueError: the variable is set to something it does not accept.
    """
    setting = SETTINGS[name]
    raw = os.environ.get(name)
    if raw is None:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {setting.accepts}; unset it for the "
                         f"default ({setting.default!r})") from None


def check_all() -> None:
    """Parses every set variable of :data:`SETTINGS`; raises on the first bad one."""
    for name in SETTINGS:
        get(name)
