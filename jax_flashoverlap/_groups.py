"""The devices of an op's group along a mesh axis, found when it is lowered.

The handlers get every group as a row of transport ids (``group_ordinals``):
CUDA ordinals in a job of one process, the node's device ids of
:mod:`.node_transport` across processes. Whether an axis spans processes
also decides the path: the NVSHMEM all-reduce over an axis of all
processes, the node transport within a node.
"""

from __future__ import annotations

import jax
import numpy as np

from . import _jax_shim

__all__ = ["axis_is_all_processes", "nvshmem_started", "group_processes", "group_ids"]


def axis_is_all_processes(ctx, n: int) -> bool:
    """Whether the op's ``n`` ranks are the whole mesh, one device in each of
    ``n`` processes: the layout of the NVSHMEM all-reduce, which sums over
    every process."""
    mesh = _jax_shim.lowering_mesh(ctx)
    return (mesh is not None and n > 1 and mesh.size == n == jax.process_count()
            and len({d.process_index for d in mesh.devices.flat}) == n)


def nvshmem_started() -> bool:
    """Whether this process started NVSHMEM (the all-reduce across nodes)."""
    from . import nvshmem

    return nvshmem.is_initialized()


def group_processes(ctx, axis_name: str, n: int) -> int:
    """How many processes this process's group along ``axis_name`` spans
    (1 without a concrete mesh)."""
    mesh = _jax_shim.lowering_mesh(ctx)
    if mesh is None or jax.process_count() == 1:
        return 1
    mine = jax.process_index()
    spans = [len({d.process_index for d in row}) for row in _groups_along(mesh, axis_name, n)
             if any(d.process_index == mine for d in row)]
    return max(spans, default=1)


def group_ids(ctx, op_name: str, axis_name: str, n: int, *,
              across_processes: bool = True) -> np.ndarray:
    """Transport ids of every group along ``axis_name``, each ordered by rank.

    In a job of one process the ids are CUDA ordinals. In a job of several,
    they are the node's device ids of :mod:`.node_transport`, whose set-up
    (collective, once) this runs: a group may then span the processes of a
    node. With ``across_processes=False`` (kernels that reach their peers by
    CUDA ordinal) they stay CUDA ordinals, and only groups of this process
    are listed.

    Returns:
      int32 [groups * n]: the kernels find the row holding their own id;
      the position within it is their rank. Only groups whose devices are
      all reachable (this process's, or its node's) are listed.
    """
    mesh = _jax_shim.lowering_mesh(ctx)
    if mesh is None:
        raise ValueError(
            f"{op_name}(impl='cuda') needs a concrete device mesh: use jax.shard_map with "
            f"mesh=jax.sharding.Mesh(...) (not an AbstractMesh), or impl='auto' (which "
            f"runs 'xla' there).")
    devices = _groups_along(mesh, axis_name, n)
    why = ""
    if across_processes and jax.process_count() > 1:
        from . import node_transport

        layout = node_transport.setup()
        ids, why = layout.ids, layout.local_only
    else:
        ids = {d.id: d.local_hardware_id for d in mesh.local_devices}
    rows = [[ids[d.id] for d in row] for row in devices if all(d.id in ids for d in row)]
    if not rows:
        raise ValueError(f"{op_name}(impl='cuda'): no group along {axis_name!r} has all its "
                         f"devices on this node{f' ({why})' if why else ''} (or in the "
                         f"NVSHMEM layout: all_reduce over an axis of all processes, one GPU "
                         f"each); use impl='xla' or 'auto' here.")
    return np.asarray(rows, np.int32).reshape(-1)


def _groups_along(mesh, axis_name: str, n: int) -> np.ndarray:
    """The mesh's devices as [groups, n]: each row one group along ``axis_name``, by rank."""
    return np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), -1).reshape(-1, n)
