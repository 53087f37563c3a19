"""impl="cuda" on the GPUs: equal to float64 references and to impl="xla".

Runs only where CUDA GPUs and the CUDA build exist (marker ``gpu``).
"""

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import assert_close, child_env, f64, gpu_layout_mesh, poison_allocator

import jax_flashoverlap as jfo
from jax_flashoverlap import cuda_policy
from jax_flashoverlap.benchmarking import comparable_hlo

pytestmark = pytest.mark.gpu

MATMUL_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
SPECS = {  # (in_specs, out_specs) on global [rows, k] / [k, cols] operands
    "all_gather_matmul": ((P("tp"), P(None, "tp")), P(None, "tp")),
    "matmul_reduce_scatter": ((P(None, "tp"), P("tp")), P("tp")),
    "matmul_all_reduce": ((P(None, "tp"), P("tp")), P()),
}


def _mesh():
    devices = jax.devices("gpu")
    return jax.sharding.Mesh(np.asarray(devices), ("tp",)), len(devices)


def _global_shapes(op, n, m, k, cols):
    if op == "all_gather_matmul":
        return (n * m, k), (k, n * cols)
    return (n * m, n * k), (n * k, cols)


def _call(op, impl, args, **kwargs):
    mesh, _ = _mesh()
    in_specs, out_specs = SPECS[op]
    fn = functools.partial(getattr(jfo, op), axis_name="tp", impl=impl, **kwargs)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    return f(*placed)


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 runs XLA's plain dot, not the kernels
@pytest.mark.parametrize("impl", ["cuda", "auto"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(256, 512, 384), (100, 72, 40), (8, 16, 8)])
@pytest.mark.parametrize("op", MATMUL_OPS)
def test_cuda_and_auto_match_float64(op, shape, dtype, impl, rng):
    """impl="auto" too: what it picks here (the tuning table's choice, or
    xla) must return the same numbers."""
    _, n = _mesh()
    xs, ws = _global_shapes(op, n, *shape)
    x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), dtype)
    poison_allocator(4 * int(np.prod(xs)) * 4)
    y = _call(op, impl, (x, w))
    jfo.check_device_errors()
    assert_close(y, f64(x) @ f64(w), dtype)


@pytest.fixture(params=["fused", "gemm_then_all_reduce"])
def mar_kernel(request, monkeypatch):
    """Runs a test once with each kernel of impl="cuda" matmul_all_reduce."""
    limit = -1 if request.param == "fused" else 1 << 40
    monkeypatch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES", limit)
    return request.param


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 runs XLA's plain dot, not the kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(256, 512, 384), (100, 72, 40)])
def test_matmul_all_reduce_kernels_match_float64(mar_kernel, shape, dtype, rng):
    _, n = _mesh()
    xs, ws = _global_shapes("matmul_all_reduce", n, *shape)
    x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), dtype)
    poison_allocator(4 * int(np.prod(xs)) * 4)
    y = _call("matmul_all_reduce", "cuda", (x, w))
    jfo.check_device_errors()
    assert_close(y, f64(x) @ f64(w), dtype)


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 runs XLA's plain dot, not the kernels
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_cuda_chunked(op, chunks, rng):
    _, n = _mesh()
    xs, ws = _global_shapes(op, n, 96, 128, 64)
    x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), jnp.bfloat16)
    poison_allocator(4 * int(np.prod(xs)) * 2)
    y = _call(op, "cuda", (x, w), chunks=chunks)
    jfo.check_device_errors()
    assert_close(y, f64(x) @ f64(w), "bfloat16")


def _require_tile_gemm():
    if not jfo.build_info()["cutlass"]:
        pytest.skip("built without CUTLASS (carry build/wheels to gpu_run.sh build)")
    if jax.devices("gpu")[0].compute_capability != "9.0":
        pytest.skip("the tile GEMM runs on sm_90 GPUs")


def _tile_signalled_matches_float64(op, shapes, rng, **kwargs):
    """``op`` with impl="cuda" on bf16 operands of each (m, k, cols) in
    ``shapes`` against float64, and its lowering asks for the tile GEMM.
    Returns the last operands."""
    _, n = _mesh()
    for shape in shapes:
        xs, ws = _global_shapes(op, n, *shape)
        x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), jnp.bfloat16)
        poison_allocator(int(np.prod(xs)) * 2 * n)
        y = _call(op, "cuda", (x, w), **kwargs)
        jfo.check_device_errors()
        assert_close(y, f64(x) @ f64(w), "bfloat16")
    mesh, _ = _mesh()
    in_specs, out_specs = SPECS[op]
    fn = functools.partial(getattr(jfo, op), axis_name="tp", impl="cuda", **kwargs)
    lowered = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                                    out_specs=out_specs)).lower(x, w)
    assert "tile_signalled = 1" in lowered.as_text()  # the schedule under test ran
    return x, w


# On one GPU the op is the plain dot (no kernel): this needs two.
@pytest.mark.gpus(2)
def test_tile_signalled_reduce_scatter(rng, monkeypatch):
    """cuda_policy.REDUCE_SCATTER_GEMM = "tile_signalled": one CUTLASS GEMM
    over every row, each peer's rows sent as the tile counters complete. 300
    rows per rank split across the counters' 256-row blocks; twice in a row,
    since the counters and the staging are reused."""
    _require_tile_gemm()
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_GEMM", "tile_signalled")
    _tile_signalled_matches_float64("matmul_reduce_scatter",
                                    [(256, 512, 384), (300, 72, 40), (300, 72, 40)], rng)


# On one GPU the op is the plain dot (no kernel): this needs two.
@pytest.mark.gpus(2)
def test_tile_signalled_all_gather_matmul(rng, monkeypatch):
    """cuda_policy.ALL_GATHER_GEMM = "tile_signalled": one gathering tile
    GEMM over the [2m, K] frame, waiting in-kernel for each chunk. Shards
    of 300 rows in 3 chunks of 100, twice in a row; chunks=7 cut to the 4
    that the GEMM's 8 blocks of waits allow; 301 rows, which no chunk count
    from 2 to 4 divides, in one; and the gradient, whose forward keeps the
    gathered x."""
    _require_tile_gemm()
    monkeypatch.setattr(cuda_policy, "ALL_GATHER_GEMM", "tile_signalled")
    op, shape = "all_gather_matmul", (300, 72, 40)
    _tile_signalled_matches_float64(op, [shape, shape], rng, chunks=3)
    _tile_signalled_matches_float64(op, [shape], rng, chunks=7)
    x, w = _tile_signalled_matches_float64(op, [(301, 72, 40)], rng, chunks=4)
    mesh, _ = _mesh()
    in_specs, out_specs = SPECS[op]
    fn = functools.partial(jfo.all_gather_matmul, axis_name="tp", impl="cuda")
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    dy = jnp.asarray(rng.standard_normal((x.shape[0], w.shape[1]), dtype=np.float32),
                     jnp.bfloat16)
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(sharded(a, b).astype(jnp.float32)
                                                   * dy.astype(jnp.float32)),
                              argnums=(0, 1)))(x, w)
    jfo.check_device_errors()
    assert_close(dx, f64(dy) @ f64(w).T, "bfloat16")
    assert_close(dw, f64(x).T @ f64(dy), "bfloat16")


# On one GPU the op is the plain dot (no kernel): this needs two.
@pytest.mark.gpus(2)
def test_tile_signalled_matmul_all_reduce(rng, monkeypatch):
    """cuda_policy.MATMUL_ALL_REDUCE_GEMM = "tile_signalled": the peers'
    rows in tile GEMMs sent as their counters complete, the own part in
    chunks summed and sent on. On 2 GPUs: 1100 rows (parts of 550, which
    cross the counters' 256-row blocks), twice in a row (the counters and
    the staging are reused), 4096 rows in two chunks, and 6 rows."""
    _require_tile_gemm()
    monkeypatch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_GEMM", "tile_signalled")
    monkeypatch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES", -1)  # fused
    _tile_signalled_matches_float64(
        "matmul_all_reduce", [(550, 72, 40), (550, 72, 40), (2048, 256, 384), (3, 64, 16)], rng)


# On one GPU the op is the plain dot (no kernel): this needs two.
@pytest.mark.gpus(2)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_reduce_scatter_adding_partials_after_the_gemm(chunks, dtype, rng, monkeypatch):
    """The "add_after" fold: own GEMM first, then one add of the received partials."""
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_FOLD", "add_after")
    _, n = _mesh()
    for shape in [(256, 512, 384), (100, 72, 40)]:
        xs, ws = _global_shapes("matmul_reduce_scatter", n, *shape)
        x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), dtype)
        w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), dtype)
        poison_allocator(4 * int(np.prod(xs)) * 4)
        y = _call("matmul_reduce_scatter", "cuda", (x, w), chunks=chunks)
        jfo.check_device_errors()
        assert_close(y, f64(x) @ f64(w), dtype)
    mesh, _ = _mesh()
    in_specs, out_specs = SPECS["matmul_reduce_scatter"]
    fn = functools.partial(jfo.matmul_reduce_scatter, axis_name="tp", impl="cuda", chunks=chunks)
    lowered = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                                    out_specs=out_specs)).lower(x, w)
    assert "add_after = 1" in lowered.as_text()  # the fold under test ran


# On one GPU the op is the plain dot (no kernel): this needs two.
@pytest.mark.gpus(2)
@pytest.mark.parametrize("fold", ["gemm_input", "add_after"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_waits_on_the_xla_stream(chunks, fold, rng, monkeypatch):
    """cuda_policy.PEER_WAIT_STREAM = "xla": each peer wait runs on XLA's stream
    just before its GEMM or add; forward, gradients and back-to-back calls
    (flags over several calls) equal the reference."""
    monkeypatch.setattr(cuda_policy, "PEER_WAIT_STREAM", "xla")
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_FOLD", fold)
    mesh, n = _mesh()
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        in_specs, out_specs = SPECS[op]
        fn = functools.partial(getattr(jfo, op), axis_name="tp", impl="cuda", chunks=chunks)
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
        xs, ws = _global_shapes(op, n, 64, 96, 32)  # test_cuda_gradients_match_xla's
        for _ in range(3):
            x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), jnp.bfloat16)
            poison_allocator(4 * int(np.prod(xs)) * 4)
            y = f(x, w)
            jfo.check_device_errors()
            assert_close(y, f64(x) @ f64(w), "bfloat16")
        assert "waits_on_xla_stream = 1" in f.lower(x, w).as_text()
        probe = jnp.asarray(rng.standard_normal(y.shape, dtype=np.float32))

        def loss(impl, x, w, op=op, in_specs=in_specs, out_specs=out_specs, probe=probe):
            g = functools.partial(getattr(jfo, op), axis_name="tp", impl=impl, chunks=chunks)
            y = jax.shard_map(g, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(x, w)
            return jnp.sum(y.astype(jnp.float32) * probe)

        x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
        got = jax.jit(jax.grad(functools.partial(loss, "cuda"), argnums=(0, 1)))(x32, w32)
        want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1)))(x32, w32)
        jfo.check_device_errors()
        for g, ref in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=2e-4, atol=2e-3)


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 runs XLA's plain dot, not the kernels
@pytest.mark.parametrize("autotune,shapes", [
    ("1", [(384, 640, 448), (136, 520, 264)]), ("0", [(392, 648, 456), (144, 528, 272)])])
@pytest.mark.parametrize("op", MATMUL_OPS)
def test_gemm_plans_with_and_without_autotuning_match_float64(op, autotune, shapes, rng,
                                                              monkeypatch):
    """JAX_FLASHOVERLAP_GEMM_AUTOTUNE (default on) times the heuristic's
    candidates for every new problem; "0" takes its first. Shapes no other
    test uses, so the plans are new."""
    monkeypatch.setenv("JAX_FLASHOVERLAP_GEMM_AUTOTUNE", autotune)
    monkeypatch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES", -1)  # fused kernel
    _, n = _mesh()
    for shape in shapes:
        xs, ws = _global_shapes(op, n, *shape)
        x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), jnp.bfloat16)
        poison_allocator(4 * int(np.prod(xs)) * 4)
        for kwargs in ([{}] if op == "matmul_all_reduce" else [{"chunks": 1}, {"chunks": 2}]):
            y = _call(op, "cuda", (x, w), **kwargs)
            jfo.check_device_errors()
            assert_close(y, f64(x) @ f64(w), "bfloat16")


@pytest.mark.gpus(2)  # one GPU: an axis of size 1 runs XLA's plain dot, not the kernels
@pytest.mark.parametrize("op", MATMUL_OPS)
def test_cuda_gradients_match_xla(op, rng):
    mesh, n = _mesh()
    xs, ws = _global_shapes(op, n, 64, 96, 32)
    x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32))
    w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32))
    in_specs, out_specs = SPECS[op]
    probe = jnp.asarray(rng.standard_normal((f64(x) @ f64(w)).shape, dtype=np.float32))

    def loss(impl, x, w):
        fn = functools.partial(getattr(jfo, op), axis_name="tp", impl=impl)
        y = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(x, w)
        return jnp.sum(y * probe)

    poison_allocator(4 * int(np.prod(xs)) * 4)
    got = jax.jit(jax.grad(functools.partial(loss, "cuda"), argnums=(0, 1)))(x, w)
    jfo.check_device_errors()
    want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1)))(x, w)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=2e-4, atol=2e-3)
    # Both against float64 (y = x @ w globally): neither impl is the reference.
    exact = (f64(probe) @ f64(w).T, f64(x).T @ f64(probe))
    for impl, grads in (("cuda", got), ("xla", want)):
        for g, e in zip(grads, exact):
            err = np.linalg.norm(f64(g) - e) / np.linalg.norm(e)
            assert err < 5e-3, (impl, err)  # float32 inputs, TF32-rate GEMMs

@pytest.mark.gpus(2)  # one GPU: an axis of size 1 runs XLA's plain dot, not the kernels

def test_back_to_back_random_calls_equal_xla():
    """1,000 calls of randomly chosen ops, shapes and (for matmul_all_reduce)
    kernels, fresh data each time."""
    mesh, n = _mesh()
    shapes = [(64, 128, 96), (200, 64, 48), (512, 256, 128), (16, 512, 64)]
    runners = {}
    for op in MATMUL_OPS:
        in_specs, out_specs = SPECS[op]
        for shape in shapes:
            xs, ws = _global_shapes(op, n, *shape)

            def make_both(op=op, xs=xs, ws=ws, in_specs=in_specs, out_specs=out_specs):
                # A new function per compile: jit reuses the lowering of one
                # it has seen, whatever the dispatch limit says now.
                def both(seed):
                    kx, kw = jax.random.split(seed)
                    x = jax.random.normal(kx, xs, jnp.bfloat16)
                    w = jax.random.normal(kw, ws, jnp.bfloat16)
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, in_specs[0]))
                    w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, in_specs[1]))
                    outs = [jax.shard_map(functools.partial(getattr(jfo, op), axis_name="tp",
                                                            impl=impl),
                                          mesh=mesh, in_specs=in_specs,
                                          out_specs=out_specs)(x, w)
                            for impl in ("cuda", "xla")]
                    return outs[0].astype(jnp.float32), outs[1].astype(jnp.float32)
                return jax.jit(both)

            key = jax.random.key(0)
            if op != "matmul_all_reduce":
                runners[(op, shape)] = make_both().lower(key).compile()
                continue
            for limit in (-1, 1 << 40):  # the fused kernel, then dot + all-reduce kernel
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES", limit)
                    runners[(op, shape, limit)] = make_both().lower(key).compile()
    keys = list(runners)
    rng = np.random.default_rng(1234)
    for i in range(1000):
        op_shape = keys[rng.integers(len(keys))]
        got, want = runners[op_shape](jax.random.key(i))
        got, want = np.asarray(got), np.asarray(want)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert np.all(np.isfinite(got)) and err < 1e-2, (i, op_shape, err)
    jfo.check_device_errors()


# Per op: global x and w shapes from (t, d, m, b, k, c), and the specs that
# put a batch dim on "data" and the op's dims on "tp".
LAYOUT_CASES = {
    "all_gather_matmul": (lambda t, d, m, b, k, c: ((t * m, d * b, k), (k, t * c)),
                          (P("tp", "data", None), P(None, "tp")), P(None, "data", "tp")),
    "matmul_reduce_scatter": (lambda t, d, m, b, k, c: ((t * m, d * b, t * k), (t * k, c)),
                              (P(None, "data", "tp"), P("tp", None)), P("tp", "data", None)),
    "matmul_all_reduce": (lambda t, d, m, b, k, c: ((m, d * b, t * k), (t * k, c)),
                          (P(None, "data", "tp"), P("tp", None)), P(None, "data", None)),
}


def _drop_absent(spec, names):
    return P(*(a if a in names else None for a in spec))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("layout", ["reversed", "data_x_tensor"])
@pytest.mark.parametrize("op", MATMUL_OPS)
def test_cuda_on_reordered_and_two_axis_meshes(op, layout, rng):
    """Rank comes from the mesh position, not the CUDA ordinal, and groups run
    along "tp" only: results equal float64 on every layout."""
    mesh, t, d = gpu_layout_mesh(layout)
    shapes, in_specs, out_spec = LAYOUT_CASES[op]
    names = mesh.axis_names
    in_specs = tuple(_drop_absent(s, names) for s in in_specs)
    out_spec = _drop_absent(out_spec, names)
    xs, ws = shapes(t, d, 48, 2, 64, 40)
    x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32), jnp.bfloat16)
    fn = functools.partial(getattr(jfo, op), axis_name="tp", impl="cuda")
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs)]
    poison_allocator(4 * x.size * 4)
    y = f(*placed)
    jfo.check_device_errors()
    assert_close(y, np.einsum("mbk,kc->mbc", f64(x), f64(w)), "bfloat16")


@pytest.mark.gpus(2)  # the child's shapes are TP=2's
@pytest.mark.parametrize("case", ["reduce_scatter_k5152", "unrolled", "scan"])
def test_mamba_step_shapes_in_a_fresh_process(case):
    """The collective matmuls at the Mamba-2 1B step's shapes, alone and as two
    blocks unrolled or in a lax.scan, forward and backward (tests/cuda_scan_child.py).

    impl="cuda" crashed that training step during execution on the GPU
    machine while the Transformer's ran; these cases separate the suspects
    (k = 5152, the reduce-scatter inside a while loop). A fresh process, so
    that a crash fails this test only.
    """
    child = Path(__file__).with_name("cuda_scan_child.py")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(child), case],
                          env=child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"),
                          cwd=child.parent, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"MATCH {case}" in proc.stdout, (
        f"exit status {proc.returncode}\n{out[-6000:]}")


@pytest.mark.parametrize("impl", ["cuda", "auto"])
@pytest.mark.parametrize("op", (*MATMUL_OPS, "all_reduce"))
def test_one_gpu_axis_runs_the_plain_dot(op, impl, rng):
    """One GPU on the axis: impl "cuda" and "auto" compile to the local dot
    (all_reduce: nothing), with no kernel of the library and no collective:
    impl="xla"'s very program, names aside."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]), ("tp",))
    if op == "all_reduce":
        args, in_specs, out_specs = [rng.standard_normal((1, 64, 48), np.float32)], (P("tp"),), P()

        def per_rank(impl):
            return lambda x: jfo.all_reduce(x[0], "tp", impl=impl)
        want = f64(args[0]).sum(0)
    else:
        (in_specs, out_specs), args = SPECS[op], [
            rng.standard_normal(s, np.float32) for s in _global_shapes(op, 1, 256, 512, 384)]

        def per_rank(impl):
            return functools.partial(getattr(jfo, op), axis_name="tp", impl=impl)
        want = f64(args[0]) @ f64(args[1])
    args = [jnp.asarray(a, jnp.bfloat16) for a in args]

    def program(impl):
        return jax.jit(jax.shard_map(per_rank(impl), mesh=mesh, in_specs=in_specs,
                                     out_specs=out_specs))
    f = program(impl)
    assert_close(f(*args), want, "bfloat16")
    compiled = f.lower(*args).compile()
    hlo = compiled.as_text()
    assert "jfo_" not in hlo and "all-reduce" not in hlo and "all-gather" not in hlo
    assert comparable_hlo(compiled) == comparable_hlo(program("xla").lower(*args).compile())
