"""Helpers shared by the tests: meshes, random data, float64 references."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jax_flashoverlap.cli.devices import without_cpu_device_count

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}


def cpu_mesh(tp: int, dp: int = 1, names=("data", "tensor")) -> jax.sharding.Mesh:
    """A (data, tensor) mesh of CPU devices."""
    devices = np.asarray(jax.devices("cpu")[: dp * tp]).reshape(dp, tp)
    return jax.sharding.Mesh(devices, names)


def gpu_layout_mesh(layout: str) -> tuple[jax.sharding.Mesh, int, int]:
    """(mesh, t, d) of the GPUs: "reversed" order on one "tp" axis (t = n,
    d = 1), or "data_x_tensor", a (data, tp) mesh of (n/2, 2) from 4 GPUs on
    and (1, 2) on 2: the CUDA ops must find their tp groups among the mesh
    axes either way."""
    devices = np.asarray(jax.devices("gpu"))
    if layout == "reversed":
        return jax.sharding.Mesh(devices[::-1], ("tp",)), len(devices), 1
    t = 2
    d = len(devices) // t
    return jax.sharding.Mesh(devices[:d * t].reshape(d, t), ("data", "tp")), t, d


def slow_unless(keep, cases) -> list:
    """``cases`` for ``pytest.mark.parametrize``, each not in ``keep`` marked
    ``slow``: the default run keeps one representative of each behaviour,
    ``-m "slow or not slow"`` runs them all. A case is a value, or a tuple of
    values where the parametrization names several arguments."""
    keep = list(keep)
    assert all(k in cases for k in keep), keep
    return [c if c in keep else
            pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
            for c in cases]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a GPU child process: this one's, less conftest's
    CPU device count (other XLA_FLAGS stay), plus ``extra``."""
    env = dict(os.environ, **extra)
    env["XLA_FLAGS"] = without_cpu_device_count(env.get("XLA_FLAGS", ""))
    return env


def put(mesh, array, spec):
    return jax.device_put(array, NamedSharding(mesh, spec))


def random(rng, shape, dtype):
    """Standard-normal data in ``dtype`` (never zeros)."""
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)


def assert_close(actual, expected_f64, dtype):
    """Relative-norm and elementwise comparison with a tolerance set by dtype."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected_f64.shape, (actual.shape, expected_f64.shape)
    assert np.all(np.isfinite(actual)), "non-finite values in the result"
    rel = TOLERANCE[jnp.dtype(dtype).name]
    err = np.linalg.norm(actual - expected_f64) / max(np.linalg.norm(expected_f64), 1e-30)
    assert err <= rel, f"relative error {err:.3g} > {rel:g} for {jnp.dtype(dtype)}"
    scale = np.abs(expected_f64).max()
    np.testing.assert_allclose(actual, expected_f64, rtol=0, atol=8 * rel * scale)


def assert_as_accurate(got, baseline, exact, dtype):
    """``got`` is no less accurate than ``baseline`` against ``exact``.

    For results of a chain of low-precision steps (a model's gradients), where
    two implementations round differently and neither is the reference: each
    leaf of the pytree ``got`` must be within twice ``baseline``'s relative
    error from ``exact`` (a float32 run), or within the dtype's tolerance.
    """
    leaves = [jax.tree.leaves(t) for t in (got, baseline, exact)]
    assert len({len(x) for x in leaves}) == 1, [len(x) for x in leaves]
    for i, (a, b, want) in enumerate(zip(*leaves)):
        a, b, want = f64(a), f64(b), f64(want)
        assert a.shape == want.shape and np.all(np.isfinite(a)), (i, a.shape, want.shape)
        errs = [np.linalg.norm(x - want) / max(np.linalg.norm(want), 1e-30) for x in (a, b)]
        bound = max(2 * errs[1], TOLERANCE[jnp.dtype(dtype).name])
        assert errs[0] <= bound, f"leaf {i}: relative error {errs[0]:.3g} > {bound:.3g}"


def f64(a):
    return np.asarray(a, dtype=np.float64)


def poison_allocator(nbytes, devices=None):
    """Leaves NaN in the memory the next allocation of this size will likely get.

    XLA's allocator hands a freed block to the next request that fits, so an
    output the kernel fails to write shows up as NaN instead of stale data.
    ``devices``: where (default: every local device, since each rank's
    output lives on its own).
    """
    for device in jax.local_devices() if devices is None else devices:
        jnp.full((max(nbytes, 4) // 4,), jnp.nan, jnp.float32,
                 device=device).block_until_ready()


# Per op: how the global operands are laid out and what the answer is.
# Shapes are deliberately uneven (3 rows per rank, batch 5, k 12, 7 columns).
M_LOCAL, BATCH, K_LOCAL, N_LOCAL = 3, 5, 12, 7


def case(op: str, n: int, rng, dtype, *, batch: bool = True,
         dims: tuple[int, int, int, int] = (M_LOCAL, BATCH, K_LOCAL, N_LOCAL)):
    """Global inputs, shard_map specs and float64 reference for ``op`` on n ranks.

    ``dims``: (rows per rank, batch, k per rank, columns per rank).

    Returns:
      (args, in_specs, out_specs, expected): ``args`` are global arrays.
    """
    from jax.sharding import PartitionSpec as P

    M_LOCAL, BATCH, K_LOCAL, N_LOCAL = dims  # noqa: N806 - the module's names
    b = (BATCH,) if batch else ()
    nb = (None,) * len(b)
    if op == "all_gather_matmul":
        x = random(rng, (n * M_LOCAL, *b, K_LOCAL), dtype)
        w = random(rng, (K_LOCAL, n * N_LOCAL), dtype)
        return ((x, w), (P("tensor"), P(None, "tensor")), P(None, *nb, "tensor"),
                f64(x) @ f64(w))
    if op in ("matmul_reduce_scatter", "matmul_all_reduce"):
        x = random(rng, (n * M_LOCAL, *b, n * K_LOCAL), dtype)
        w = random(rng, (n * K_LOCAL, N_LOCAL), dtype)
        out = P("tensor") if op == "matmul_reduce_scatter" else P()
        return ((x, w), (P(None, *nb, "tensor"), P("tensor")), out, f64(x) @ f64(w))
    if op == "all_reduce":
        x = random(rng, (n, M_LOCAL, *b, N_LOCAL), dtype)
        return (x,), (P("tensor"),), P(), f64(x).sum(0)
    raise ValueError(op)


def run_case(op: str, n: int, args, in_specs, out_specs, *, dp: int = 1, **kwargs):
    """Runs ``op`` under jit(shard_map) on a (dp, n) CPU mesh."""
    import functools

    import jax_flashoverlap as jfo

    mesh = cpu_mesh(n, dp)
    fn = functools.partial(getattr(jfo, op), axis_name="tensor", **kwargs)
    if op == "all_reduce":
        fn = (lambda f: lambda x: f(x[0]))(fn)
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return sharded(*(put(mesh, a, s) for a, s in zip(args, in_specs)))


def check_gradients(op: str, n: int, impl: str, rng) -> None:
    """Gradients of ``op`` under shard_map: by finite differences, and against
    the float64 gradients of its global math (the same reference for every
    impl, "xla" included)."""
    import functools

    import jax.test_util

    import jax_flashoverlap as jfo

    args, in_specs, out_specs, expected = case(op, n, rng, "float32")
    mesh = cpu_mesh(n)
    probe = random(rng, expected.shape, "float32")

    def loss(impl_, *xs):
        fn = functools.partial(getattr(jfo, op), axis_name="tensor", impl=impl_)
        if op == "all_reduce":
            fn = (lambda f: lambda x: f(x[0]))(fn)
        y = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*xs)
        return jnp.sum(y * probe)

    sharded = [put(mesh, a, s) for a, s in zip(args, in_specs)]
    jax.test_util.check_grads(functools.partial(loss, impl), sharded, order=1,
                              modes=["rev"], atol=1e-2, rtol=1e-2)
    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(functools.partial(loss, impl), argnums=argnums))(*sharded)
    # d sum(y * probe): y = x @ w (global) or x.sum(0) for all_reduce.
    p = f64(probe)
    if op == "all_reduce":
        want = [np.broadcast_to(p, args[0].shape)]
    else:
        x, w = f64(args[0]), f64(args[1])
        want = [p @ w.T, x.reshape(-1, x.shape[-1]).T @ p.reshape(-1, p.shape[-1])]
    for g, ref in zip(got, want, strict=True):
        assert_close(g, ref, "float32")


def check_against_reference(op: str, n: int, dtype, rng, *, batch: bool = True, **kwargs):
    """Runs ``op`` on fresh data and compares it with the float64 answer."""
    args, in_specs, out_specs, expected = case(op, n, rng, dtype, batch=batch)
    assert_close(run_case(op, n, args, in_specs, out_specs, **kwargs), expected, dtype)


def data_parallel_grad_lowered_for_h200(monkeypatch, kernel, args, in_specs):
    """The gradients of ``kernel(*args)``'s sum, data-parallel over a 2-device
    "data" mesh (``in_specs`` per argument), traced and lowered for an H200
    where there is none (Pallas's interpreter does not run inside
    shard_map): (the traced function, its StableHLO text)."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(*t):
        def local(*u):
            return jax.lax.psum(jnp.sum(kernel(*u).astype(jnp.float32)), "data")
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=jax.P())(*t)

    traced = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args)
    return traced, traced.lower(lowering_platforms=("cuda",)).as_text()


def with_word_tokenizer(fixture, directory, vocab: int) -> None:
    """The checkpoint ``fixture`` copied to ``directory``, with a
    tokenizer.json whose word "w<i>" is token i (i < ``vocab``)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(fixture, directory)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, "w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(directory / "tokenizer.json"))


def missing_path_in(argv: list[str], message: str, tmp_path) -> tuple[list[str], str]:
    """``argv`` and ``message`` with MISSING replaced by a path under
    ``tmp_path`` that does not exist (a fixed one such as /nonexistent may
    exist on a shared machine)."""
    missing = str(tmp_path / "missing")
    return [a.replace("MISSING", missing) for a in argv], message.replace("MISSING", missing)
