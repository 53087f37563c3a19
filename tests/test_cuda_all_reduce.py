"""impl="cuda" all_reduce on the GPUs: rank-order sums with the same bits on
every rank, right across CUDA-graph replays and long runs of random sizes.

Runs only where CUDA GPUs and the CUDA build exist (marker ``gpu``). The
references are exact: the kernels add ranks 0, 1, ... in float32 and round
once, which the tests recompute (on the host, or in-graph from an
all_gather), besides a float64 comparison.
"""

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import assert_close, child_env, f64, gpu_layout_mesh, poison_allocator

import jax_flashoverlap as jfo
from jax_flashoverlap import _extension, cuda_policy

pytestmark = pytest.mark.gpu

IMPL = "cuda"
ALGORITHMS = cuda_policy.ALL_REDUCE_ALGORITHMS
KERNELS = cuda_policy.ALL_REDUCE_KERNELS  # one kernel each: XLA captures them in graphs
DTYPES = ("bfloat16", "float16", "float32")
MAX_BYTES = 64 << 20  # the largest message, per rank
# bf16 element counts of the stress test: single elements, odd tails,
# one block, many blocks, the largest message.
STRESS_SIZES = (1, 7, 8, 1000, 4099, 65_536, 300_001, 1 << 20, (4 << 20) + 3,
                MAX_BYTES // 2)
STRESS_CALLS, STRESS_ITERS = 10, 1000  # 10 x 1000 all-reduces


def _mesh():
    devices = jax.devices("gpu")
    return jax.sharding.Mesh(np.asarray(devices), ("tp",)), len(devices)


def _per_rank(fn, mesh, *, sharded=True):
    """jit(shard_map(fn)) returning every rank's own result, stacked: [n, ...].

    out_specs P("tp") with check_vma=False keeps each rank's copy of the
    (invariant) result, so the test sees whether all ranks got the same bits.
    ``sharded``: the argument is [n, ...] and ``fn`` gets this rank's row;
    else it is replicated (a key) and passed whole.
    """
    def per_device(x):
        return fn(x[0] if sharded else x)[None]
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("tp") if sharded else P(),
                                 out_specs=P("tp"), check_vma=False))


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _rank_order_sum(x):
    """What the kernels compute from x [n, ...]: ranks 0, 1, ... in float32, rounded once."""
    acc = x[0].astype(np.float32)
    for r in range(1, x.shape[0]):
        acc = acc + x[r].astype(np.float32)
    return acc.astype(x.dtype)


def _fresh(key, i, shape, dtype):
    """Normal data for iteration ``i``, a different draw on every rank."""
    k = jax.random.fold_in(jax.random.fold_in(key, i), lax.axis_index("tp"))
    return jax.random.normal(k, shape, jnp.float32).astype(dtype)


CHECKS = ("rank-order sum", "same on every rank")


def _wrong(y, x):
    """In-graph counts of wrong elements of y = all_reduce(x) on this rank: [2] int32.

    Per check of CHECKS: elements that differ from the exact rank-order sum
    of the gathered inputs, and elements that differ from another rank's y.
    (The float64 comparison is on the host, in the first test. An in-graph
    ``psum`` of the float32 upcast is no reference: on the GPU machine it
    differed from the float32 sum of the gathered values almost everywhere,
    and from bf16 rounding of it in ~0.02% of elements, with impl="xla" as
    much as with impl="cuda".)
    """
    gathered = lax.all_gather(x, "tp")  # [n, ...] in rank order
    acc = gathered[0].astype(jnp.float32)
    for r in range(1, gathered.shape[0]):
        acc = acc + gathered[r].astype(jnp.float32)
    exact = jnp.sum(y != acc.astype(y.dtype))
    same = jnp.sum(lax.all_gather(y, "tp") != y[None])
    return jnp.stack([exact, same]).astype(jnp.int32)


def _assert_none_wrong(counts, context=""):
    """counts: [n, 3] per rank and check, from _wrong."""
    counts = np.asarray(counts).reshape(-1, len(CHECKS))
    failed = {f"rank {r}: {name}": int(c) for r, row in enumerate(counts)
              for name, c in zip(CHECKS, row) if c}
    assert not failed, f"{context} wrong elements per check: {failed}"


def _host_calls() -> int:
    return _extension._module().debug_counters().get("all_reduce_host_calls", 0)


def _sizes(rng, dtype, algorithm):
    """Element counts from 1 to the algorithm's largest message: tiny, odd,
    around the packs, random, largest."""
    top = ((cuda_policy.lamport_max_bytes() if algorithm == "lamport" else MAX_BYTES)
           // jnp.dtype(dtype).itemsize)
    return [1, 3, 8, 9, 4097, int(rng.integers(1 << 10, min(1 << 16, top))),
            int(rng.integers(min(1 << 16, top - 1), min(1 << 22, top))) | 1, top]


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 is the identity, no kernel runs
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_order_sum_with_the_same_bits_on_every_rank(dtype, algorithm, rng):
    mesh, n = _mesh()
    f = _per_rank(functools.partial(jfo.all_reduce, axis_name="tp", impl=IMPL,
                                    algorithm=algorithm), mesh)
    for size in _sizes(rng, dtype, algorithm):
        x = np.asarray(jnp.asarray(rng.standard_normal((n, size), dtype=np.float32), dtype))
        placed = jax.device_put(x, NamedSharding(mesh, P("tp")))
        poison_allocator(size * x.dtype.itemsize, devices=mesh.devices.flat)
        per_rank = np.asarray(f(placed))
        jfo.check_device_errors()
        expected = _bits(_rank_order_sum(x))
        for r in range(n):
            np.testing.assert_array_equal(_bits(per_rank[r]), expected,
                                          err_msg=f"rank {r}, {size} elements")
        assert_close(per_rank[0], f64(x).sum(0), dtype)


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 is the identity, no kernel runs
@pytest.mark.parametrize("algorithm", KERNELS)
def test_fori_loop_replays_of_a_captured_call_stay_exact(algorithm):
    """200 iterations of one call site with fresh data; XLA is told to put
    even a single command into a CUDA graph, so the loop replays the graph."""
    mesh, n = _mesh()
    iters, size = 200, 3 * 4096 + 5

    def count_wrong(key):
        def body(i, wrong):
            x = _fresh(key, i, (size,), jnp.bfloat16)
            y = jfo.all_reduce(x, "tp", impl=IMPL, algorithm=algorithm)
            return wrong + _wrong(y, x)
        return lax.fori_loop(0, iters, body, jnp.zeros(len(CHECKS), jnp.int32))

    f = _per_rank(count_wrong, mesh, sharded=False)
    compiled = f.lower(jax.random.key(0)).compile({"xla_gpu_graph_min_graph_size": 1})
    before = _host_calls()
    wrong = np.asarray(compiled(jax.random.key(1)))
    host_calls = _host_calls() - before
    jfo.check_device_errors()
    _assert_none_wrong(wrong)
    if host_calls >= iters:
        pytest.fail(f"right, but not a graph replay: the handler's host code ran {host_calls} "
                    f"times for {iters} iterations on {n} GPUs (XLA did not capture it)")


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 is the identity, no kernel runs
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_jit_called_100_times(algorithm):
    mesh, _ = _mesh()

    def count_wrong(key):
        x = _fresh(key, 0, (100_003,), jnp.bfloat16)
        return _wrong(jfo.all_reduce(x, "tp", impl=IMPL, algorithm=algorithm), x)

    f = _per_rank(count_wrong, mesh, sharded=False)
    wrong = sum(np.asarray(f(jax.random.key(i))) for i in range(100))
    _assert_none_wrong(wrong)
    jfo.check_device_errors()

@pytest.mark.gpus(2)  # one GPU: an axis of size 1 is the identity, no kernel runs

def test_back_to_back_calls_of_random_sizes_and_algorithms():
    """STRESS_CALLS x STRESS_ITERS all-reduces, each of a randomly drawn size
    and algorithm with fresh data: the per-block sequence numbers must stay in
    step while the grid changes from call to call."""
    mesh, _ = _mesh()

    def case(size, algorithm):
        def run(key):
            x = _fresh(key, 0, (size,), jnp.bfloat16)
            return _wrong(jfo.all_reduce(x, "tp", impl=IMPL, algorithm=algorithm), x)
        return run

    branches = [case(s, a) for s in STRESS_SIZES for a in ALGORITHMS
                if a != "lamport" or 2 * s <= cuda_policy.lamport_max_bytes()]

    def count_wrong(key):
        def body(i, wrong):
            k = jax.random.fold_in(key, i)
            which = jax.random.randint(k, (), 0, len(branches))  # the same on every rank
            return wrong + lax.switch(which, branches, k)
        return lax.fori_loop(0, STRESS_ITERS, body, jnp.zeros(len(CHECKS), jnp.int32))

    f = _per_rank(count_wrong, mesh, sharded=False)
    for call in range(STRESS_CALLS):
        _assert_none_wrong(f(jax.random.key(call)), f"call {call}:")
    jfo.check_device_errors()


# On one GPU all_reduce is the identity (no kernel): this needs two.
@pytest.mark.gpus(2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lamport_sends_negative_zero_as_positive_zero(dtype, rng):
    """The Lamport slots' empty pattern is -0.0 (16-bit) or one fp32 denormal:
    such inputs travel as +0.0 / -0.0, and every rank still gets the same bits."""
    mesh, n = _mesh()
    size = 5003  # packs and a scalar tail
    x = np.array(jnp.asarray(rng.standard_normal((n, size), dtype=np.float32), dtype))
    bits = x.view(f"u{x.dtype.itemsize}")
    empty = 0x8000 if x.dtype.itemsize == 2 else 0x80008000
    bits[:, ::7] = empty
    canonical = bits.copy()
    canonical[canonical == empty] = 0 if x.dtype.itemsize == 2 else 0x80000000
    f = _per_rank(functools.partial(jfo.all_reduce, axis_name="tp", impl=IMPL,
                                    algorithm="lamport"), mesh)
    per_rank = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("tp")))))
    jfo.check_device_errors()
    expected = _bits(_rank_order_sum(canonical.view(x.dtype)))
    for r in range(n):
        np.testing.assert_array_equal(_bits(per_rank[r]), expected, err_msg=f"rank {r}")


@pytest.mark.gpus(2)
def test_lamport_timeout_poisons_the_lamport_kernel_on_every_gpu():
    """In a fresh process (tests/lamport_timeout_child.py): a late message may
    still land in a Lamport slot its reader gave up on, so after a timeout
    the Lamport kernel is poisoned on both GPUs and every call on the group
    raises; jax_flashoverlap.reset() makes both exact again."""
    _run_child("lamport_timeout_child.py", "LAMPORT TIMEOUT OK",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")


def _run_child(script: str, marker: str, **env: str) -> None:
    """Runs tests/``script`` in a fresh process with ``env`` added; it must
    exit 0 after printing ``marker``."""
    child = Path(__file__).with_name(script)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(child)],
                          env=child_env(**env), cwd=child.parent, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and marker in proc.stdout, out[-6000:]


@pytest.mark.gpus(2)
@pytest.mark.parametrize("layout", ["reversed", "data_x_tensor"])
def test_groups_follow_the_mesh_not_the_ordinals(layout, rng):
    """GPUs in reversed order on "tp", or a (data, tp) mesh ((n/2, 2) from 4
    GPUs on, (1, 2) on 2): each tp group sums its own ranks, in mesh order.
    (With 2 ranks the order of the sum is not observable, a + b == b + a; from
    3 GPUs on a wrong rank order changes bits.)"""
    mesh, t, d = gpu_layout_mesh(layout)
    spec = P("data" if "data" in mesh.axis_names else None, "tp")
    size = 3 * 4096 + 5
    x = np.asarray(jnp.asarray(rng.standard_normal((d, t, size), dtype=np.float32),
                               jnp.bfloat16))
    f = jax.jit(jax.shard_map(
        lambda v: jfo.all_reduce(v, "tp", impl=IMPL),
        mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    poison_allocator(size * 2, devices=mesh.devices.flat)
    y = np.asarray(f(jax.device_put(x, NamedSharding(mesh, spec))))
    jfo.check_device_errors()
    for g in range(d):  # every rank of group g holds the group's rank-order sum
        expected = _bits(_rank_order_sum(x[g]))
        for r in range(t):
            np.testing.assert_array_equal(_bits(y[g, r]), expected,
                                          err_msg=f"group {g}, rank {r}")


@pytest.mark.gpus(2)
def test_message_over_the_region_names_the_setting():
    """The failing call launches nothing, so the group stays in step."""
    if int(os.environ.get("JAX_FLASHOVERLAP_WORKSPACE_MB", "1024")) > 1024:
        pytest.skip("a workspace larger than the default may hold the message")
    mesh, n = _mesh()
    size = (256 << 20) // 2  # bf16: 256 MiB per rank, over a quarter of 1 GiB
    make = jax.jit(lambda: jnp.ones((n, size), jnp.bfloat16),
                   out_shardings=NamedSharding(mesh, P("tp")))
    f = _per_rank(functools.partial(jfo.all_reduce, axis_name="tp", impl=IMPL,
                                    algorithm="two_shot"), mesh)
    with pytest.raises(jax.errors.JaxRuntimeError, match="JAX_FLASHOVERLAP_WORKSPACE_MB"):
        f(make()).block_until_ready()
    jfo.check_device_errors()


@pytest.mark.gpus(2)
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "copy_engine"])
def test_missing_peer_times_out_with_nan_and_a_named_error(algorithm):
    """Device 0 runs the all-reduce alone: its wait for rank 1 must give up
    after timeout_ms, fill the output with NaN and leave an error naming
    rank 1.

    Device 0 then counted a call device 1 never made, so the pair is out of
    step: every later call on the group raises, on both devices, until
    jax_flashoverlap.reset() (faults.py), after which the sum is exact.
    """
    mesh, n = _mesh()
    ordinals = np.asarray([d.local_hardware_id for d in mesh.devices.flat], np.int32)
    warm = _per_rank(functools.partial(jfo.all_reduce, axis_name="tp", impl=IMPL), mesh)
    warm(jnp.ones((n, 8), jnp.float32)).block_until_ready()  # group set up
    jfo.check_device_errors()
    if algorithm == "copy_engine":
        target, attrs = "jfo_all_reduce_copy_engine", {"chunks": np.int32(2)}
    else:
        target = "jfo_all_reduce"
        attrs = {"algorithm": np.int32(cuda_policy.ALL_REDUCE_KERNELS.index(algorithm))}
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1000,), jnp.float32))
    alone = jax.jit(lambda x: call(x, group_ordinals=ordinals, n=np.int32(n),
                                   timeout_ms=np.int32(300), **attrs))
    on_device = [jax.device_put(jnp.ones((1000,), jnp.float32), d) for d in mesh.devices.flat]
    start = time.perf_counter()
    y = np.asarray(alone(on_device[0]))
    assert time.perf_counter() - start < 30
    assert np.all(np.isnan(y))
    with pytest.raises(RuntimeError, match=r"all_reduce( \(copy engines\))?: rank 0 \(CUDA "
                                           r"device \d+\) timed out after 300 ms waiting "
                                           r"for rank 1"):
        jfo.check_device_errors()

    x = jnp.arange(n * 8, dtype=jnp.float32).reshape(n, 8)
    try:
        replayed = np.asarray(warm(x))
    except jax.errors.JaxRuntimeError as e:  # the host code ran: it refuses
        assert "failed earlier, so every call on it fails until jax_flashoverlap.reset()" \
            in str(e), e
    else:  # replayed from a CUDA graph: the region's failed word stops it
        assert np.all(np.isnan(replayed)), replayed
        with pytest.raises(RuntimeError, match=r"failed earlier, so every call on their "
                                               r"groups fails until jax_flashoverlap.reset"):
            jfo.check_device_errors()
    jfo.reset()
    jfo.check_device_errors()
    np.testing.assert_array_equal(np.asarray(warm(x)), np.broadcast_to(x.sum(0), (n, 8)))


def _direct_gathers() -> int:
    return _extension._module().debug_counters()["all_reduce_direct_gathers"]


@pytest.mark.gpus(2)
def test_two_shot_stores_into_the_peers_output_directly(rng):
    """XLA's allocators map their memory into every local GPU, so every
    two-shot call's peers store their sums straight into y. (The fallback
    through the slots runs in tests/two_shot_slots_child.py.)"""
    if os.environ.get("JAX_FLASHOVERLAP_PEER_STORES") == "0":
        pytest.skip("JAX_FLASHOVERLAP_PEER_STORES=0 turns the direct stores off")
    mesh, n = _mesh()
    f = _per_rank(functools.partial(jfo.all_reduce, axis_name="tp", impl=IMPL,
                                    algorithm="two_shot"), mesh)
    calls, direct = _host_calls(), _direct_gathers()
    for size in (4097, (3 << 20) + 5):
        x = np.asarray(jnp.asarray(rng.standard_normal((n, size), dtype=np.float32),
                                   jnp.bfloat16))
        poison_allocator(size * 2, devices=mesh.devices.flat)
        per_rank = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("tp")))))
        jfo.check_device_errors()
        for r in range(n):
            np.testing.assert_array_equal(_bits(per_rank[r]), _bits(_rank_order_sum(x)))
    calls, direct = _host_calls() - calls, _direct_gathers() - direct
    assert calls >= n and direct == calls, (calls, direct)


@pytest.mark.gpus(2)
def test_two_shot_gathers_through_the_slots_when_peer_stores_are_off():
    """In a fresh process with JAX_FLASHOVERLAP_PEER_STORES=0
    (tests/two_shot_slots_child.py): the path for outputs the peers cannot
    reach, gathering through the receive slots, sums exactly."""
    _run_child("two_shot_slots_child.py", "TWO-SHOT SLOTS OK", JAX_FLASHOVERLAP_PEER_STORES="0")
