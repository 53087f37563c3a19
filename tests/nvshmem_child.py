"""Run by tests/test_nvshmem_all_reduce.py through the launcher: one process, one GPU.

Initialises NVSHMEM, all-reduces fresh random data of several sizes and dtypes
with ``jax_flashoverlap.nvshmem.all_reduce`` and compares with ``lax.psum`` and
across processes (every process must get the same bits), then checks that
``jax_flashoverlap.all_reduce(impl="auto")`` over the processes lowers to the
same all-reduce for bf16 where that was measured (2 processes, each its own
node; same bits) and to psum otherwise. Prints ``ok ...``
lines and ``NVSHMEM_ALL_REDUCE_OK`` at the end; fails loudly otherwise.

With ``--shared-gpu`` (processes sharing one GPU, where NCCL refuses to
run) the reference is the float64 sum of every process's data, drawn from
one seed in each, the bits are compared through jax.distributed's store,
and the routing of "auto" (which would run psum) is not checked.

With ``--mismatch`` the last call has one PE all-reduce another size than
the others: every PE must get NaN or an error, and the PEs that exchange
with that one an error naming both calls (after which NVSHMEM's
all-reduce fails for the rest of the processes' lives).
"""

import hashlib
import sys

import numpy as np

from jax_flashoverlap import distributed

distributed.initialize()

import jax  # noqa: E402  (after initialize, which must come first)
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jax_flashoverlap import nvshmem  # noqa: E402

SHARED_GPU = "--shared-gpu" in sys.argv
MISMATCH = "--mismatch" in sys.argv
args = [a for a in sys.argv[1:] if a not in ("--shared-gpu", "--mismatch")]
HEAP_MB = int(args[0]) if args else 512
# Single elements, odd tails, one block, many blocks, several MiB.
SIZES = (1, 7, 8, 1000, 4099, 65_536, 300_001, (1 << 20) + 5, 4 << 20)
DTYPES = ("float32", "bfloat16", "float16")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
REPEATS = 3  # fresh data each time; both slot parities, twice

nvshmem.initialize(heap_mb=HEAP_MB)
me, n = jax.process_index(), jax.process_count()
g = distributed.node_size()
print(f"pe={me}/{n} node_size={g} max_message_bytes={nvshmem.max_message_bytes()}")
mesh = jax.make_mesh((n,), ("p",))
spec = jax.P("p")


def both(v):
    return nvshmem.all_reduce(v[0], "p")[None], jax.lax.psum(v, "p")


def ours_alone(v):
    return nvshmem.all_reduce(v[0], "p")[None]


step = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
alone = jax.jit(jax.shard_map(ours_alone, mesh=mesh, in_specs=spec, out_specs=spec))
rng = np.random.default_rng(1234 + me)
shared_rng = np.random.default_rng(4321)  # the same draws in every process


def same_everywhere(name: str, ours: np.ndarray) -> bool:
    digest = hashlib.sha256(ours.tobytes()).hexdigest()
    if SHARED_GPU:
        try:
            distributed.check_same(name, {"digest": digest})
            return True
        except ValueError:
            return False
    digests = np.asarray(multihost_utils.process_allgather(
        np.frombuffer(bytes.fromhex(digest), np.uint8)))
    return bool((digests == digests[0]).all())
failures = 0
for dtype in DTYPES:
    for size in SIZES:
        if size * jnp.dtype(dtype).itemsize > nvshmem.max_message_bytes():
            print(f"skip {dtype} {size}: over max_message_bytes")
            continue
        for rep in range(REPEATS):
            if SHARED_GPU:
                every = shared_rng.standard_normal((n, size), np.float32).astype(
                    jnp.dtype(dtype))
                local = every[me:me + 1]
                x = multihost_utils.host_local_array_to_global_array(local, mesh, spec)
                ours = np.asarray(alone(x).addressable_data(0)).astype(np.float32)
                ref = every.astype(np.float64).sum(0, keepdims=True)
            else:
                local = rng.standard_normal((1, size), np.float32).astype(jnp.dtype(dtype))
                x = multihost_utils.host_local_array_to_global_array(local, mesh, spec)
                ours, ref = step(x)
                ours = np.asarray(ours.addressable_data(0)).astype(np.float32)
                ref = np.asarray(ref.addressable_data(0)).astype(np.float32)
            nvshmem.check_device_errors()
            same_bits = same_everywhere(f"{dtype}/{size}/{rep}", ours)
            close = np.allclose(ours, ref, rtol=TOL[dtype], atol=TOL[dtype] * n)
            if not (same_bits and close and np.isfinite(ours).all()):
                failures += 1
                bad = np.flatnonzero(~np.isclose(ours, ref, rtol=TOL[dtype], atol=TOL[dtype] * n))
                print(f"FAIL {dtype} size={size} rep={rep} same_bits={same_bits} "
                      f"mismatches={bad.size} first={bad[:5].tolist()} "
                      f"ours={ours.ravel()[bad[:5]].tolist()} ref={ref.ravel()[bad[:5]].tolist()}")
        print(f"ok {dtype} size={size}")

# jax_flashoverlap.all_reduce over this axis of processes: "auto" runs the
# NVSHMEM all-reduce where it was measured (16-bit, 2 processes, each its own
# node: same bits), psum otherwise.
import jax_flashoverlap as jfo  # noqa: E402

measured_layout = n == 2 and g == 1

routed = jax.jit(jax.shard_map(lambda v: (jfo.all_reduce(v[0], "p")[None],
                                          nvshmem.all_reduce(v[0], "p")[None]),
                               mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
for dtype, size, on_nvshmem in () if SHARED_GPU else (("bfloat16", 65_536, measured_layout),
                                                      ("float32", 1000, False)):
    local = rng.standard_normal((1, size), np.float32).astype(jnp.dtype(dtype))
    x = multihost_utils.host_local_array_to_global_array(local, mesh, spec)
    calls = routed.lower(x).as_text().count("custom_call @jfo_nvshmem_all_reduce")
    auto, ours = (np.asarray(r.addressable_data(0)).astype(np.float32) for r in routed(x))
    nvshmem.check_device_errors()
    same = np.array_equal(auto, ours) if on_nvshmem else np.allclose(
        auto, ours, rtol=TOL[dtype], atol=TOL[dtype] * n)
    if calls != 1 + on_nvshmem or not same:
        failures += 1
        print(f"FAIL auto {dtype}: {calls} NVSHMEM calls, same={same}")
    print(f"ok auto {dtype} size={size} nvshmem={on_nvshmem}")

if MISMATCH:  # the last call: a failure is for the rest of the process's life
    size = 1000 + (me == n - 1)
    local = shared_rng.standard_normal((n, size), np.float32)[me:me + 1]
    x = multihost_utils.host_local_array_to_global_array(local, mesh, spec)
    try:
        ours = np.asarray(alone(x).addressable_data(0))
        nvshmem.check_device_errors()
        outcome = "nan" if np.isnan(ours).all() else "wrong"
    except (jax.errors.JaxRuntimeError, RuntimeError) as e:
        # A PE whose partner failed first times out instead.
        outcome = "named" if "ran different calls" in str(e) else "error"
    print(f"mismatch pe={me}: {outcome}", flush=True)
    failures += outcome == "wrong"

nvshmem.finalize()
if failures:
    sys.exit(f"{failures} mismatching all-reduces")
print("NVSHMEM_ALL_REDUCE_OK")
