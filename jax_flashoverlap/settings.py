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

The launcher's variables (:data:`LAUNCHER_VARIABLES`) are checked by
:mod:`jax_flashoverlap.distributed` when a program starts. Every other
variable the package reads or writes is listed, with why, in
:data:`OTHER_VARIABLES`; the package touches the environment only through
this module (:func:`raw`, :func:`export`, :func:`snapshot`), which refuses a
name that is not listed, so these tables are the whole list.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Setting", "SETTINGS", "LAUNCHER_VARIABLES", "LAUNCHER_OLD_NAMES", "OTHER_VARIABLES",
           "get", "check_all", "raw", "export", "snapshot"]


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


# What jax_flashoverlap.cli.launch gives each process, by what it means.
LAUNCHER_VARIABLES = {
    "coordinator": "JAX_FLASHOVERLAP_COORDINATOR_ADDRESS",
    "process_id": "JAX_FLASHOVERLAP_PROCESS_ID",
    "num_processes": "JAX_FLASHOVERLAP_NUM_PROCESSES",
    "local_rank": "JAX_FLASHOVERLAP_LOCAL_RANK",
    "local_size": "JAX_FLASHOVERLAP_LOCAL_SIZE",
    "node_size": "JAX_FLASHOVERLAP_NODE_SIZE",
    "platform": "JAX_FLASHOVERLAP_PLATFORM",
}
# Each launcher variable's name before the one prefix, JFO_*.
LAUNCHER_OLD_NAMES = {name: "JFO_" + name.removeprefix("JAX_FLASHOVERLAP_")
                      for name in LAUNCHER_VARIABLES.values()}

OTHER_VARIABLES = {
    **{name: "the launcher's (jax_flashoverlap.distributed parses them)"
       for name in LAUNCHER_VARIABLES.values()},
    **{old: "a launcher variable's name before the one prefix: read only to say it was renamed"
       for old in LAUNCHER_OLD_NAMES.values()},
    "CUDA_MODULE_LOADING": "set to EAGER at import when unset: a kernel loaded lazily while an "
                           "op waits for a peer GPU can stall both (_module_loading)",
    "XLA_FLAGS": "the command-line programs add a CPU device count; benchmarks record it",
    # The NVSHMEM module's init sets these two again (C++), for callers of the
    # module that do not go through jax_flashoverlap.nvshmem.initialize.
    "NVSHMEM_DISABLE_NVLS": "set to 1 before NVSHMEM starts (no NVLink multicast)",
    "NVSHMEM_SYMMETRIC_SIZE": "set to the heap size before NVSHMEM starts, which reads it once",
    "XDG_CACHE_HOME": "where jax-flashoverlap-tune writes the tuning table",
    "JFO_COMMIT": "the commit a benchmark records where the tree's .git may be stale (a copy "
                  "on another machine)",
}


def _declared(name: str) -> str:
    if name not in SETTINGS and name not in OTHER_VARIABLES:
        raise KeyError(f"{name} is not in jax_flashoverlap.settings' tables: declare it there, "
                       f"with why the package touches it")
    return name


def raw(name: str) -> str | None:
    """The environment's value of a declared variable ``name``, unparsed (None
    when unset)."""
    return os.environ.get(_declared(name))


def export(name: str, value: str) -> None:
    """Sets a declared variable ``name`` in this process's environment, for a
    library that reads it later (CUDA, XLA, NVSHMEM) and for child processes.

    Writes only a value that differs: a write races with reads in JAX's
    threads, and the launcher has usually set it before JAX started."""
    if os.environ.get(_declared(name)) != value:
        os.environ[name] = value


def snapshot(prefixes: tuple[str, ...]) -> dict[str, str]:
    """Every set variable whose name starts with one of ``prefixes`` (for a
    benchmark's record of how it ran), sorted by name: the one read of names
    the tables need not list (the scripts' own ``JFO_*`` flags)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


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
    """Parses every set variable of :data:`SETTINGS`; raises on the first bad
    one. Warns about a set ``JAX_FLASHOVERLAP_*`` variable that is no setting
    (a misspelled name would otherwise be ignored in silence), naming the
    closest setting."""
    for name in SETTINGS:
        get(name)
    known = sorted({*SETTINGS, *LAUNCHER_VARIABLES.values()})
    for name in sorted(os.environ):
        if name.startswith("JAX_FLASHOVERLAP_") and name not in known:
            prefix = "JAX_FLASHOVERLAP_"  # shared by every name: compare what follows
            close = difflib.get_close_matches(name.removeprefix(prefix),
                                              [k.removeprefix(prefix) for k in known], n=1)
            hint = (f"did you mean {prefix}{close[0]}?" if close
                    else f"the settings are {', '.join(sorted(SETTINGS))}")
            warnings.warn(f"{name} is set, but jax_flashoverlap has no such setting; {hint}",
                          stacklevel=2)
