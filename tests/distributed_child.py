"""Run by tests/test_distributed.py through the launcher: one process of a CPU job.

Prints ``key=value`` lines that the test checks across ranks.
"""

import os

import numpy as np

from jax_flashoverlap import distributed

distributed.initialize()

import jax  # noqa: E402  (after initialize, which must come first)
from jax.experimental import multihost_utils  # noqa: E402

me = jax.process_index()
print(f"process={me}/{jax.process_count()} local_devices={jax.local_device_count()}")


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, local_port = local.rsplit(":", 1)
            if int(local_port, 16) == port and state == "0A":  # 0A: LISTEN
                found.append(address)
    return sorted(found)


coordinator_port = int(os.environ["JAX_FLASHOVERLAP_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
print(f"listening={','.join(listening_addresses(coordinator_port))}")
print(f"node={distributed.node_rank()}/{distributed.num_nodes()} "
      f"in_node={distributed.rank_in_node()}/{distributed.node_size()}")

# A cross-process sum inside one jitted computation: process i holds row i
# (filled with i + 1) of a global array, and psum adds the rows across processes.
mesh = jax.make_mesh((jax.process_count(),), ("p",))
rows = multihost_utils.host_local_array_to_global_array(
    np.full((1, 4), me + 1, np.float32), mesh, jax.P("p"))
total = jax.jit(jax.shard_map(lambda r: jax.lax.psum(r, "p"), mesh=mesh,
                              in_specs=jax.P("p"), out_specs=jax.P()))(rows)
print(f"sum={np.asarray(total.addressable_data(0)).ravel().tolist()}")

# Fresh random bytes from each root; everyone prints what it received.
for root in range(jax.process_count()):
    sent = os.urandom(128) if me == root else None
    if sent is not None:
        print(f"sent{root}={sent.hex()}")
    print(f"got{root}={distributed.broadcast_bytes(sent, root=root).hex()}")
print(f"empty={distributed.broadcast_bytes(b'' if me == 0 else None)!r}")

# Every process claims to be the root: the error must say so, on every process.
try:
    distributed.broadcast_bytes(b"x", root=me)
except ValueError as e:
    print(f"mismatch={e}")
# The root's own error ends the call on every process at once (and the calls
# after it stay paired).
try:
    distributed.broadcast_bytes(123 if me == 0 else None)
except (TypeError, ValueError) as e:
    print(f"root_error={type(e).__name__}: {e}")
print(f"after={distributed.broadcast_bytes(b'ok' if me == 0 else None)!r}")
# Settings every process must share: equal ones pass, differing ones fail
# on every process, naming each process's value.
distributed.check_same("same", {"heap_mb": 1024, "node_size": 1})
try:
    distributed.check_same("differ", {"heap_mb": 1024 + me, "node_size": 1})
except ValueError as e:
    print(f"disagree={e}")
if me == 0:  # process 1 never arrives: a bounded wait, then an error naming it
    try:
        distributed.check_same("alone", {"heap_mb": 1024}, timeout_s=2)
    except RuntimeError as e:
        print(f"alone={e}")
print("done")
