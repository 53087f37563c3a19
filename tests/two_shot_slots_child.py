"""Run by tests/test_cuda_all_reduce.py in a fresh process with
JAX_FLASHOVERLAP_PEER_STORES=0 (read once per process): the two-shot
all-reduce then gathers through its receive slots, as it does for outputs in
memory the peers cannot reach, instead of storing into the peers' outputs.

    JAX_FLASHOVERLAP_PEER_STORES=0 python tests/two_shot_slots_child.py
    # prints TWO-SHOT SLOTS OK
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashoverlap as jfo
from jax_flashoverlap import _extension


def main():
    devices = jax.devices("gpu")
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
    n = len(devices)
    f = jax.jit(jax.shard_map(
        lambda v: jfo.all_reduce(v[0], "tp", impl="cuda", algorithm="two_shot")[None],
        mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    rng = np.random.default_rng(0)
    counters = _extension._module().debug_counters
    calls, direct = counters()["all_reduce_host_calls"], counters()["all_reduce_direct_gathers"]
    for size in (4097, (3 << 20) + 5):
        x = np.asarray(jnp.asarray(rng.standard_normal((n, size), dtype=np.float32),
                                   jnp.bfloat16))
        per_rank = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("tp")))))
        jfo.check_device_errors()
        acc = x[0].astype(np.float32)
        for r in range(1, n):
            acc = acc + x[r].astype(np.float32)
        for r in range(n):
            np.testing.assert_array_equal(per_rank[r].view(np.uint16),
                                          acc.astype(x.dtype).view(np.uint16))
    calls = counters()["all_reduce_host_calls"] - calls
    direct = counters()["all_reduce_direct_gathers"] - direct
    assert calls >= n and direct == 0, (calls, direct)
    print("TWO-SHOT SLOTS OK", flush=True)


if __name__ == "__main__":
    main()
