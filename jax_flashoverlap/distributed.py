"""Multi-process setup: ``jax.distributed`` from the launcher, node topology, byte broadcast.

A program started by ``python -m jax_flashoverlap.cli.launch -n N prog.py`` calls
:func:`initialize` first. Processes are grouped into nodes of
:func:`node_size` consecutive processes (``--node-size``; all of them by
default): the NVRAR all-reduce reduces within a node over NVLink and across
nodes with NVSHMEM, and declaring each GPU its own node exercises the
cross-node path on one machine. :func:`broadcast_bytes` shares a small byte
string, such as an NVSHMEM unique id, from one process to all.
:func:`exit_if_stuck` bounds native collective calls that cannot be.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import settings

__all__ = [
    "ENV",
    "initialize",
    "is_launched",
    "process_id",
    "num_processes",
    "node_size",
    "num_nodes",
    "node_rank",
    "rank_in_node",
    "broadcast_bytes",
    "check_same",
    "exit_if_stuck",
    "STUCK_EXIT_STATUS",
    "TERMINATED_STATUS",
]

# The exit status of a process that :func:`exit_if_stuck` ended.
STUCK_EXIT_STATUS = 75
# How a launched rank that got SIGTERM exits (as the signal would end it).
TERMINATED_STATUS = 128 + signal.SIGTERM

# The variables a launcher gives each process (jax_flashoverlap.cli.launch sets them).
ENV = settings.LAUNCHER_VARIABLES

_REQUIRED = ("coordinator", "process_id", "num_processes")
_LAUNCH_HINT = ("start the program with `python -m jax_flashoverlap.cli.launch -n N script.py` "
                "(or call jax.distributed.initialize yourself, e.g. under SLURM)")
_MAX_BYTES = 1 << 20


def is_launched() -> bool:
    """Whether this process was started by :mod:`jax_flashoverlap.cli.launch`."""
    values = [_env(k) for k in _REQUIRED]  # each, so that an old name raises
    return all(v is not None for v in values)


def _env(key: str) -> str | None:
    """The launcher's variable ``ENV[key]``, or None. Its name before the
    JAX_FLASHOVERLAP_ prefix (``JFO_...``) raises rather than being ignored."""
    name = ENV[key]
    old = settings.LAUNCHER_OLD_NAMES[name]
    value = settings.raw(name)
    if value is None and settings.raw(old) is not None:
        raise RuntimeError(f"{old} is set, but the variable is now named {name}: rename it "
                           f"in the job's environment")
    return value


def _env_int(key: str) -> int | None:
    name = ENV[key]
    value = _env(key)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def initialize(**kwargs) -> None:
    """Calls ``jax.distributed.initialize`` with what the launcher passed.

    Does nothing if ``jax.distributed`` is already initialised. Call it before
    anything else touches jax devices.

    Process 0's coordinator (an unauthenticated key-value and barrier
    service) listens on the coordinator address only (the launcher's
    ``127.0.0.1:PORT``), not on every interface as ``jax.distributed``'s
    default; pass ``coordinator_bind_address`` to choose otherwise.

    From then on SIGTERM, which the launcher sends when another rank
    failed, raises ``SystemExit`` in the main thread: the program's
    ``finally`` blocks run (an NVSHMEM finalize, a checkpoint's close), and
    the rank exits with :data:`TERMINATED_STATUS`. (``jax.distributed``
    takes SIGTERM for a preemption notice and runs on.) A main thread inside
    native code sees it once that returns; the launcher's SIGKILL after
    ``--grace`` seconds covers the rest.

    Args:
      **kwargs: passed on to ``jax.distributed.initialize`` (for example
        ``initialization_timeout`` or ``heartbeat_timeout_seconds``, which bound
        how long a missing peer goes unnoticed).

    Raises:
      RuntimeError: the launcher's variables are missing.
    """
    missing = [ENV[k] for k in _REQUIRED if _env(k) is None]
    if missing:
        raise RuntimeError(f"jax_flashoverlap.distributed.initialize: {', '.join(missing)} "
                           f"not set; {_LAUNCH_HINT}")
    import jax

    if jax.distributed.is_initialized():
        return
    node_size()  # a bad --node-size fails here, in every process, before any wait
    address = _env("coordinator")
    kwargs.setdefault("coordinator_bind_address", address)
    jax.distributed.initialize(coordinator_address=address,
                               num_processes=_env_int("num_processes"),
                               process_id=_env_int("process_id"), **kwargs)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum, frame):
    raise SystemExit(TERMINATED_STATUS)


def process_id() -> int:
    """This process's index: the launcher's, else ``jax.process_index()``."""
    value = _env_int("process_id")
    if value is None:
        import jax
        value = jax.process_index()
    return value


def num_processes() -> int:
    """Number of processes: the launcher's, else ``jax.process_count()``."""
    value = _env_int("num_processes")
    if value is None:
        import jax
        value = jax.process_count()
    return value


def node_size() -> int:
    """Consecutive processes forming one node (``JAX_FLASHOVERLAP_NODE_SIZE``, default: all).

    Without the launcher (e.g. under SLURM) set ``JAX_FLASHOVERLAP_NODE_SIZE`` to the
    processes per host yourself; the default treats the whole job as one node.

    Raises:
      ValueError: the node size is below 1 or does not divide the process count.
    """
    n = num_processes()
    size = _env_int("node_size")
    if size is None:
        return n
    if size < 1 or n % size:
        raise ValueError(f"{ENV['node_size']}={size} must be >= 1 and divide the number of "
                         f"processes ({n}); e.g. `launch -n {n} --node-size 1` for one "
                         f"node per process")
    return size


def num_nodes() -> int:
    """Number of nodes: processes / node size."""
    return num_processes() // node_size()


def node_rank() -> int:
    """Index of this process's node, 0 .. num_nodes()-1."""
    return process_id() // node_size()


def rank_in_node() -> int:
    """Index of this process within its node, 0 .. node_size()-1."""
    return process_id() % node_size()


def broadcast_bytes(data: bytes | None, root: int = 0, *, max_bytes: int = _MAX_BYTES,
                    timeout_s: float = 60.0) -> bytes:
    """Sends a small byte string from process ``root`` to every process.

    Collective: every process must call it, with the same ``root``. Through
    the ``jax.distributed`` key-value store, bounded like :func:`check_same`
    (which first checks that every process passed the same ``root`` and
    ``max_bytes``): no device work, so no NCCL communicator, its sockets or
    its unbounded waits. Non-root processes may pass ``None``; what they
    pass is ignored.

    Args:
      data: the bytes, on ``root`` (at most ``max_bytes`` of them).
      root: the sending process.
      max_bytes: upper bound on the length, checked on every process.
      timeout_s: how long to wait for the other processes, and for the bytes.

    Returns:
      ``root``'s bytes, on every process.

    Raises:
      ValueError: ``root`` out of range, ``data`` too long, or the processes
        disagree on ``root`` or ``max_bytes``.
      TypeError: ``data`` on ``root`` is not bytes-like.
      RuntimeError: a process, or the bytes, did not arrive within
        ``timeout_s``, naming it.
    """
    import jax

    n = jax.process_count()
    me = jax.process_index()
    if not 0 <= root < n:
        raise ValueError(f"broadcast_bytes: root={root} is not a process index (0..{n - 1})")
    is_root = me == root
    error = None
    if is_root:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            error = TypeError(f"broadcast_bytes: root process {root} must pass bytes, "
                              f"got {type(data).__name__}")
        elif len(data) > max_bytes:
            error = ValueError(f"broadcast_bytes: {len(data)} bytes exceed max_bytes="
                               f"{max_bytes}; it is meant for small strings (ids, configs)")
        else:
            data = bytes(data)
    if n == 1:
        if error:
            raise error
        return data
    check_same("broadcast_bytes", {"root": root, "max_bytes": max_bytes}, timeout_s=timeout_s)
    key = f"jax_flashoverlap/broadcast/{_AGREEMENTS['broadcast_bytes']}"
    client = _kv_client("broadcast_bytes")
    # One flag byte, then the bytes or the root's error: every process ends
    # the call (no one waits out the timeout) and their counts stay equal.
    if is_root:
        client.key_value_set_bytes(key, b"\x01" + str(error).encode() if error
                                   else b"\x00" + data)
        if error:
            raise error
        return data
    try:
        got = bytes(client.blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
    except Exception as e:  # noqa: BLE001 - the runtime raises its own types
        raise RuntimeError(f"broadcast_bytes: process {root}'s bytes did not arrive within "
                           f"{timeout_s:g} s ({type(e).__name__}: {e})") from None
    if got[:1] == b"\x01":
        raise ValueError(f"broadcast_bytes: process {root} sent nothing: {got[1:].decode()}")
    return got[1:]


def _kv_client(what: str):
    """The ``jax.distributed`` runtime's key-value client, or a clear error."""
    from jax._src import distributed as jax_distributed  # the runtime's KV client

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError(f"{what}: jax.distributed is not initialised; {_LAUNCH_HINT}")
    return client


_AGREEMENTS: collections.Counter = collections.Counter()


def check_same(name: str, settings: dict[str, Any], *, timeout_s: float = 60.0) -> None:
    """Raises on every process unless every process passed the same ``settings``.

    Collective, and bounded: each process posts its settings to the
    ``jax.distributed`` key-value store and reads every other's with a
    timeout, so it also serves as a barrier that cannot hang (a process that
    never arrives is an error naming it, after ``timeout_s``). No device
    work, so it is safe before anything that would wait on peers forever
    (NVSHMEM start-up).

    Args:
      name: what is agreed on (for the keys and the messages).
      settings: JSON-serialisable values by name.
      timeout_s: how long to wait for the other processes.

    Raises:
      RuntimeError: ``jax.distributed`` is not initialised, or a process did
        not post its settings in time.
      ValueError: the processes disagree; names each differing setting and
        every process's value.
    """
    import jax

    client = _kv_client(f"check_same({name!r})")
    n, me = jax.process_count(), jax.process_index()
    _AGREEMENTS[name] += 1
    prefix = f"jax_flashoverlap/agree/{name}/{_AGREEMENTS[name]}"
    client.key_value_set(f"{prefix}/{me}", json.dumps(settings, sort_keys=True))
    seen = []
    for process in range(n):
        try:
            raw = client.blocking_key_value_get(f"{prefix}/{process}", int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own types
            raise RuntimeError(f"check_same({name!r}): process {process} did not arrive within "
                               f"{timeout_s:g} s ({type(e).__name__}: {e})") from None
        seen.append(json.loads(raw))
    differing = sorted({k for s in seen for k in s if any(t.get(k) != s.get(k) for t in seen)})
    if differing:
        detail = "; ".join(f"{k}: " + ", ".join(f"process {i} has {s.get(k)!r}"
                                                for i, s in enumerate(seen))
                           for k in differing)
        raise ValueError(f"{name}: the processes disagree on {detail}; every process must use "
                         f"the same values")


@contextlib.contextmanager
def exit_if_stuck(what: str, timeout_s: float) -> Iterator[None]:
    """Ends the process if the block has not finished after ``timeout_s``.

    For native collective calls that wait on every process without a bound
    of their own (NVSHMEM's start-up and shut-down barriers), made with the
    GIL released: a process that died or stopped leaves the others waiting
    there forever, and neither an exception nor Ctrl-C can reach a thread
    inside native code. So a watchdog thread prints what was stuck, and for
    how long, to stderr and exits with :data:`STUCK_EXIT_STATUS`; the
    launcher then stops the other processes.

    Args:
      what: the call, for the message.
      timeout_s: the bound, in seconds.
    """
    if not timeout_s > 0:
        raise ValueError(f"exit_if_stuck({what!r}): timeout_s={timeout_s} must be positive")
    done = threading.Event()
    message = (f"jax_flashoverlap: {what} did not finish within {timeout_s:g} s in process "
               f"{process_id()}: another process died or stopped before it; exiting with "
               f"status {STUCK_EXIT_STATUS}\n")

    def watch() -> None:
        if not done.wait(timeout_s):
            sys.stderr.write(message)
            sys.stderr.flush()
            os._exit(STUCK_EXIT_STATUS)

    watchdog = threading.Thread(target=watch, name=f"exit_if_stuck({what})", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()

