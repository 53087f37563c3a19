"""Groups whose GPUs belong to several processes of one node.

The CUDA ops move data through a workspace on every GPU of a group (copy
engines and flags into the peers' workspaces). In one process every GPU's
workspace is reachable directly. When a mesh axis spans processes of one
node (one process per GPU, as SLURM's ``--gpus-per-task=1`` or
``jax-flashoverlap-launch`` start them, or several processes sharing one GPU
for testing), each process maps the others' workspaces through CUDA IPC.
:func:`setup` does this once per process:

1. every process posts its host, its devices and its workspace size to the
   ``jax.distributed`` key-value store, and reads everyone's;
2. the devices of this node (same host, same ``JAX_FLASHOVERLAP_NODE_SIZE``
   block of processes) get transport ids 0..N-1, ordered by JAX device id;
3. each process allocates its workspace, posts its IPC handle, and maps every
   other process's.

Every wait is bounded by ``timeout_s`` and fails naming the process that did
not arrive. It is collective: every process of the job calls it, which the
first lowering of a CUDA op over such an axis does by itself (every process
lowers the same program); call it yourself to pay the set-up before the
first step.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import jax

__all__ = ["NodeLayout", "setup", "current", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 120.0
_PREFIX = "jax_flashoverlap/node_transport"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The devices of this process's node, as the transport names them.

    Attributes:
      ids: JAX device id -> transport id, for every device of the node.
      process_of: JAX device id -> process index, for the same devices.
      node_size: devices on the node.
      labels: transport id -> how messages name that device.
      local_only: why groups cannot span this node's processes ("" when
        they can, or when the node has one process).
    """

    ids: dict[int, int]
    process_of: dict[int, int]
    node_size: int
    labels: tuple[str, ...]
    local_only: str = ""

    def spans_processes(self) -> bool:
        return len(set(self.process_of.values())) > 1


class Backend(Protocol):
    """What :func:`setup` needs of the extension (a fake one in CPU tests)."""

    def configure_node(self, node_size: int, local: list[tuple[int, int]],
                       labels: list[str]) -> None: ...
    def export_workspace(self, id: int) -> tuple[bytes, int]: ...  # noqa: A002
    def import_workspace(self, id: int, handle: bytes, bytes: int) -> None: ...  # noqa: A002


_LOCK = threading.Lock()
_LAYOUT: NodeLayout | None = None
_GENERATION = 0


def current() -> NodeLayout | None:
    """This process's node layout once :func:`setup` ran, else None."""
    return _LAYOUT


def setup(*, timeout_s: float = DEFAULT_TIMEOUT_S, backend: Backend | None = None,
          workspace_mb: int | None = None) -> NodeLayout:
    """Maps the workspaces of every GPU of this node into this process (once).

    Collective over every process of the job; later calls return the first
    one's layout at once.

    Args:
      timeout_s: bound on each wait for another process.
      backend: the extension (default); tests pass a fake one.
      workspace_mb: this process's workspace size (default: the setting
        ``JAX_FLASHOVERLAP_WORKSPACE_MB``, as the extension uses it).

    Returns:
      The node's layout.

    Raises:
      RuntimeError: ``jax.distributed`` is not initialised, a process did not
        arrive within ``timeout_s`` (named), or another process failed its
        part (its error is quoted).
      ValueError: the node's processes disagree on the workspace size.
    """
    global _LAYOUT, _GENERATION
    with _LOCK:
        if _LAYOUT is not None:
            return _LAYOUT
        if backend is None:
            backend = _extension_backend()
        if workspace_mb is None:
            from . import settings
            workspace_mb = int(settings.get("JAX_FLASHOVERLAP_WORKSPACE_MB"))
        _GENERATION += 1
        layout = _exchange(backend, f"{_PREFIX}/{_GENERATION}", workspace_mb, timeout_s)
        _LAYOUT = layout
        return layout


def _extension_backend() -> Backend:
    from . import _extension

    _extension.require_cuda_ops("node_transport.setup", "jfo_all_reduce")
    _extension.push_settings()
    return _extension._module()


def _host_key() -> str:
    """This machine: its name and boot id (two containers may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _exchange(backend: Backend, prefix: str, workspace_mb: int, timeout_s: float) -> NodeLayout:
    from . import distributed

    client = distributed._kv_client("node_transport.setup")
    me, n = jax.process_index(), jax.process_count()
    node = f"{_host_key()}/{distributed.node_rank() if distributed.is_launched() else 0}"
    local = [(d.id, d.local_hardware_id) for d in jax.local_devices()]
    client.key_value_set(f"{prefix}/hello/{me}", json.dumps(
        {"node": node, "devices": local, "workspace_mb": workspace_mb}))
    hellos = [_get(client, f"{prefix}/hello/{p}", timeout_s, f"process {p}", what="its devices")
              for p in range(n)]
    hellos = [json.loads(h) for h in hellos]
    mine = [p for p, h in enumerate(hellos) if h["node"] == node]
    _check_workspaces(hellos, mine)
    several = {p: len(hellos[p]["devices"]) for p in mine if len(hellos[p]["devices"]) > 1}
    if mine == [me] or several:
        # The one-process transport, CUDA ordinals as ids: alone on the node,
        # or next to processes of several GPUs each (mapping another
        # process's memory into a second GPU of this one is not supported).
        why = ("groups across processes need one GPU per process (" + ", ".join(
            f"process {p} has {k}" for p, k in several.items()) + ")") if len(mine) > 1 else ""
        return NodeLayout({dev: cuda for dev, cuda in local}, {dev: me for dev, _ in local},
                          len(local), tuple(f"CUDA device {cuda}" for _, cuda in local), why)
    devices = sorted((dev, p) for p in mine for dev, _ in hellos[p]["devices"])
    ids = {dev: i for i, (dev, _) in enumerate(devices)}
    process_of = dict(devices)
    cuda_of = {dev: cuda for p in mine for dev, cuda in hellos[p]["devices"]}
    labels = tuple(f"process {process_of[dev]}, CUDA device {cuda_of[dev]}"
                   for dev, _ in devices)
    layout = NodeLayout(ids, process_of, len(devices), labels)
    try:
        backend.configure_node(layout.node_size, [(cuda, ids[dev]) for dev, cuda in local],
                               list(labels))
        for dev, _ in local:
            handle, nbytes = backend.export_workspace(ids[dev])
            client.key_value_set_bytes(f"{prefix}/handle/{ids[dev]}",
                                       nbytes.to_bytes(8, "little") + bytes(handle))
        local_ids = {ids[dev] for dev, _ in local}
        for dev, p in devices:
            if ids[dev] in local_ids:
                continue
            raw = _get(client, f"{prefix}/handle/{ids[dev]}", timeout_s, f"process {p}",
                       what=f"the workspace of {labels[ids[dev]]}", raw=True)
            backend.import_workspace(ids[dev], raw[8:], int.from_bytes(raw[:8], "little"))
    except Exception as e:  # noqa: BLE001 - reported to every process, then raised
        client.key_value_set(f"{prefix}/done/{me}", f"{type(e).__name__}: {e}")
        raise
    client.key_value_set(f"{prefix}/done/{me}", "")
    for p in mine:
        failed = _get(client, f"{prefix}/done/{p}", timeout_s, f"process {p}",
                      what="word that it mapped every workspace")
        if failed:
            raise RuntimeError(f"node_transport.setup: process {p} failed to set up the node "
                               f"transport: {failed}")
    return layout


def _check_workspaces(hellos: Sequence[dict[str, Any]], mine: Sequence[int]) -> None:
    """Every process of the node has the same workspace."""
    sizes = {p: hellos[p]["workspace_mb"] for p in mine}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"process {p}: {mb} MiB" for p, mb in sizes.items())
        raise ValueError(f"node_transport.setup: the processes of this node have different "
                         f"workspaces ({listed}); set the same JAX_FLASHOVERLAP_WORKSPACE_MB "
                         f"in every process")


def _get(client, key: str, timeout_s: float, who: str, *, what: str, raw: bool = False):
    try:
        if raw:
            return bytes(client.blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the runtime raises its own types
        raise RuntimeError(f"node_transport.setup: {who} did not post {what} within "
                           f"{timeout_s:g} s: did it stop, or not reach the same op? "
                           f"({type(e).__name__}: {e})") from None
