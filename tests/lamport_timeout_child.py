"""Run by tests/test_cuda_all_reduce.py in a fresh process: a Lamport
all-reduce whose peer never comes times out with NaN and an error naming the
peer; every later call on the group raises until jax_flashoverlap.reset(),
after which the Lamport kernel (poisoned until then) and the classic kernels
sum exactly again.

    python tests/lamport_timeout_child.py    # prints LAMPORT TIMEOUT OK
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_flashoverlap as jfo

SIZE = 1000


def all_reduce(mesh, algorithm):
    def per_device(v):
        return jfo.all_reduce(v, "tp", impl="cuda", algorithm=algorithm)[None]
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                              check_vma=False))
    return np.asarray(f(jnp.ones((mesh.size * SIZE,), jnp.float32)))


def main():
    devices = jax.devices("gpu")[:2]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
    np.testing.assert_array_equal(all_reduce(mesh, "one_shot"), 2.0)  # group set up
    ordinals = np.asarray([d.local_hardware_id for d in devices], np.int32)
    call = jax.ffi.ffi_call("jfo_all_reduce", jax.ShapeDtypeStruct((SIZE,), jnp.float32))
    alone = jax.jit(lambda x: call(x, group_ordinals=ordinals, n=np.int32(2),
                                   timeout_ms=np.int32(300), algorithm=np.int32(2)))
    y = np.asarray(alone(jax.device_put(jnp.ones((SIZE,), jnp.float32), devices[0])))
    assert np.all(np.isnan(y)), y
    try:
        jfo.check_device_errors()
    except RuntimeError as e:
        assert "all_reduce (lamport): rank 0" in str(e) and "waiting for rank 1" in str(e), e
    else:
        raise AssertionError("the timeout left no error")
    for algorithm in ("lamport", "one_shot"):
        try:
            all_reduce(mesh, algorithm)
        except jax.errors.JaxRuntimeError as e:
            assert "failed earlier" in str(e) and "jax_flashoverlap.reset()" in str(e), e
        else:
            raise AssertionError(f"{algorithm} ran on a failed group")
    jfo.reset()
    np.testing.assert_array_equal(all_reduce(mesh, "lamport"), 2.0)
    np.testing.assert_array_equal(all_reduce(mesh, "one_shot"), 2.0)
    jfo.check_device_errors()
    print("LAMPORT TIMEOUT OK", flush=True)


if __name__ == "__main__":
    main()
