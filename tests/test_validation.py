"""The errors users hit, each naming the fix."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import cpu_mesh, put, random

import jax_flashoverlap as jfo


def _in_shard_map(op, x, w, in_specs, **kwargs):
    mesh = cpu_mesh(4)
    kwargs.setdefault("axis_name", "tensor")
    fn = functools.partial(op, **kwargs)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P("tensor")))
    return f(put(mesh, x, in_specs[0]), put(mesh, w, in_specs[1]))


def test_unbound_axis_names_the_fix(rng):
    x, w = random(rng, (4, 8), "float32"), random(rng, (8, 4), "float32")
    with pytest.raises(ValueError, match=r"axis name 'tensor' is not bound.*shard_map.*sharded"):
        jfo.all_gather_matmul(x, w, "tensor")
    with pytest.raises(ValueError, match="not bound"):
        jfo.all_reduce(x, "tensor")


def test_mismatched_contraction(rng):
    x, w = random(rng, (8, 6), "float32"), random(rng, (5, 4), "float32")
    with pytest.raises(ValueError, match=r"contraction dims differ.*k=6.*k=5"):
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()))


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((8,), (8, 4), r"x must have at least 2 dims \(\[rows, ..., k\]\), got shape"),
    ((8, 6), (6, 4, 1), "w must be 2-D"),
])
def test_wrong_ranks(x_shape, w_shape, match, rng):
    x, w = random(rng, x_shape, "float32"), random(rng, w_shape, "float32")
    with pytest.raises(ValueError, match=match):
        _in_shard_map(jfo.matmul_all_reduce, x, w, (P("tensor"), P()))


def test_rows_not_divisible(rng):
    # 6 rows cannot be scattered over 4 ranks.
    x, w = random(rng, (6, 8), "float32"), random(rng, (8, 3), "float32")
    mesh = cpu_mesh(4)
    fn = functools.partial(jfo.matmul_reduce_scatter, axis_name="tensor")
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")),
                              out_specs=P("tensor")))
    with pytest.raises(ValueError, match=r"6 rows.*not divisible by the 4 ranks.*pad"):
        f(put(mesh, x, P(None, "tensor")), put(mesh, w, P("tensor")))


@pytest.mark.parametrize("dtype", ["int32", "float64"])
def test_unsupported_dtype(dtype):
    x = jnp.ones((8, 4), dtype) if dtype == "int32" else jnp.ones((8, 4), "float32")
    w = jnp.ones((4, 4), dtype) if dtype == "int32" else jnp.ones((4, 4), "float16")
    match = "supported are" if dtype == "int32" else "operands must share one dtype"
    with pytest.raises(TypeError, match=match):
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()))


def test_unknown_impl(rng):
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    with pytest.raises(ValueError, match="impl must be one of"):
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), impl="nccl")


@pytest.mark.parametrize("op", [jfo.all_gather_matmul, jfo.matmul_reduce_scatter])
@pytest.mark.parametrize("chunks", [0, 65, 1.5, True])
def test_bad_chunks_name_the_choices(op, chunks, rng):
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    with pytest.raises(ValueError, match=r"chunks must be None \(picked by shape\) or an int "
                                         r"from 1 to 64, got"):
        _in_shard_map(op, x, w, (P("tensor"), P()), chunks=chunks)


def test_options_xla_ignores_are_named_once(rng, monkeypatch):
    from jax_flashoverlap import _validation

    monkeypatch.setattr(_validation, "_WARNED_UNUSED", set())
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    with pytest.warns(UserWarning, match=r"all_gather_matmul: chunks=4 has no effect under "
                                         r"impl='xla' \(XLA's own collective\)"):
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), chunks=4, impl="xla")
    with pytest.warns(UserWarning, match=r"all_reduce: algorithm='one_shot' has no effect"):
        jax.jit(jax.shard_map(functools.partial(jfo.all_reduce, axis_name="tensor", impl="xla",
                                                algorithm="one_shot"),
                              mesh=cpu_mesh(4), in_specs=P("tensor"), out_specs=P("tensor")))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only, and none at the defaults
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), chunks=4, impl="xla")
        _in_shard_map(jfo.matmul_all_reduce, x, w.T, (P(None, "tensor"), P("tensor")),
                      impl="xla")


def test_numpy_int_chunks_are_taken(rng):
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    y = _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), chunks=np.int64(2),
                      impl="decomposed")
    # Every rank gathers all of x: the 4 blocks of the output are x @ w each.
    np.testing.assert_allclose(np.asarray(y), np.tile(np.asarray(x) @ np.asarray(w), (4, 1)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jfo.build_info()["cuda"] and bool(jax.devices()[0].platform == "gpu"),
                    reason="CUDA build on a GPU: impl='cuda' is valid here")
def test_cuda_impl_without_gpu_build(rng):
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    if jfo.build_info()["cuda"]:
        error, match = ValueError, r"impl='cuda'\) runs only on NVIDIA GPUs"
    else:
        error, match = RuntimeError, r"impl='cuda'\).*(without CUDA|without its compiled)"
    with pytest.raises(error, match=match):
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), impl="cuda")


def test_axis_name_must_be_a_string(rng):
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    with pytest.raises(TypeError, match=r"axis_name must be the name \(str\) of one mesh axis"):
        _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), axis_name=("tensor",))


def test_wait_timeout_comes_from_the_environment(monkeypatch):
    from jax_flashoverlap import _primitives
    monkeypatch.delenv(_primitives.TIMEOUT_ENV, raising=False)
    assert _primitives.timeout_ms() == _primitives.DEFAULT_TIMEOUT_MS
    monkeypatch.setenv(_primitives.TIMEOUT_ENV, "2500")
    assert _primitives.timeout_ms() == 2500
    for bad in ("0", "-3", "soon", str(2**31)):
        monkeypatch.setenv(_primitives.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="JAX_FLASHOVERLAP_TIMEOUT_MS"):
            _primitives.timeout_ms()


@pytest.mark.parametrize("chunks", [0, 65, 2.5, True, None])
def test_matmul_all_reduce_chunks_must_be_an_int(chunks, rng):
    x, w = random(rng, (8, 16), "float32"), random(rng, (16, 4), "float32")
    mesh = cpu_mesh(4)
    f = jax.shard_map(functools.partial(jfo.matmul_all_reduce, axis_name="tensor",
                                        chunks=chunks),
                      mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")), out_specs=P())
    with pytest.raises(ValueError, match=r"chunks must be an int from 1 to 64, got"):
        jax.jit(f)(x, w)


def _op_on_mesh(op, mesh, in_specs, out_spec, **kwargs):
    fn = functools.partial(getattr(jfo, op), axis_name="tensor", **kwargs)
    if op == "all_reduce":
        fn = (lambda f: lambda x: f(x[0]))(fn)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))


# (op, global operand shapes, in_specs, out_spec) on a 4-rank axis, for
# operands with zero rows and with k = 0.
_EMPTY_CASES = {
    "all_gather_matmul/no rows": ("all_gather_matmul", [(0, 3, 8), (8, 4)],
                                  (P("tensor"), P(None, "tensor")), P(None, None, "tensor")),
    "all_gather_matmul/k=0": ("all_gather_matmul", [(8, 3, 0), (0, 4)],
                              (P("tensor"), P(None, "tensor")), P(None, None, "tensor")),
    "matmul_reduce_scatter/no rows": ("matmul_reduce_scatter", [(0, 3, 8), (8, 4)],
                                      (P(None, None, "tensor"), P("tensor")), P("tensor")),
    "matmul_reduce_scatter/k=0": ("matmul_reduce_scatter", [(8, 3, 0), (0, 4)],
                                  (P(None, None, "tensor"), P("tensor")), P("tensor")),
    "matmul_all_reduce/no rows": ("matmul_all_reduce", [(0, 3, 8), (8, 4)],
                                  (P(None, None, "tensor"), P("tensor")), P()),
    "matmul_all_reduce/k=0": ("matmul_all_reduce", [(8, 3, 0), (0, 4)],
                              (P(None, None, "tensor"), P("tensor")), P()),
    "all_reduce/empty": ("all_reduce", [(4, 0, 5)], (P("tensor"),), P()),
}


@pytest.mark.parametrize("impl", ["xla", "decomposed", "cuda", "auto"])
@pytest.mark.parametrize("case", list(_EMPTY_CASES))
def test_empty_operands_name_the_op(case, impl, rng):
    """Every impl refuses zero-size operands with the same error (XLA's
    all_gather fails its verifier on them)."""
    op, shapes, in_specs, out_spec = _EMPTY_CASES[case]
    args = [random(rng, s, "float32") for s in shapes]
    mesh = cpu_mesh(4)
    f = _op_on_mesh(op, mesh, in_specs, out_spec, impl=impl)
    with pytest.raises(ValueError, match=rf"{op}: \w+ has shape .* with no elements"):
        f(*(put(mesh, a, s) for a, s in zip(args, in_specs)))


def test_negative_axes_count_from_the_end(rng):
    mesh = cpu_mesh(4)
    x, w = random(rng, (3, 8, 6), "float32"), random(rng, (6, 8), "float32")
    gather = _op_on_mesh("all_gather_matmul", mesh, (P(None, "tensor"), P(None, "tensor")),
                         P(None, None, "tensor"), gather_axis=-2, impl="decomposed")
    np.testing.assert_allclose(gather(x, w), np.asarray(x) @ np.asarray(w), rtol=1e-5)
    xs = random(rng, (3, 8, 16), "float32")
    ws = random(rng, (16, 4), "float32")
    scatter = _op_on_mesh("matmul_reduce_scatter", mesh, (P(None, None, "tensor"), P("tensor")),
                          P(None, "tensor"), scatter_dimension=-2, impl="decomposed")
    np.testing.assert_allclose(scatter(xs, ws), np.asarray(xs) @ np.asarray(ws), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="gather_axis=-1 does not name a row dim of x with 3 dims"):
        _op_on_mesh("all_gather_matmul", mesh, (P(None, "tensor"), P(None, "tensor")),
                    P(None, None, "tensor"), gather_axis=-1)(x, w)


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "all-to-all", "custom-call")


@pytest.mark.parametrize("impl", ["xla", "decomposed", "cuda", "auto"])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce", "all_reduce"])
def test_axis_of_one_rank_is_the_plain_dot(op, impl, rng):
    """With one device on the tensor axis every impl (also "cuda", on any
    platform) compiles to the local dot, or nothing for all_reduce: no
    collective, no kernel call; its gradient too. The program is impl="xla"'s
    very one, names aside: the same kernels, so any time measured between
    them is the measurement's spread (on one H200, timed in turn at the
    45-50 µs shapes, "cuda" and "auto" were 0.980-1.036x "xla")."""
    from support import case

    from jax_flashoverlap.benchmarking import comparable_hlo

    args, in_specs, out_spec, want = case(op, 1, rng, "float32")
    mesh = cpu_mesh(1, dp=8)
    f = _op_on_mesh(op, mesh, in_specs, out_spec, impl=impl)
    np.testing.assert_allclose(f(*args), want, rtol=1e-5, atol=1e-5)
    loss = jax.jit(jax.grad(lambda *xs: f(*xs).sum(), argnums=tuple(range(len(args)))))
    forward, backward = (program.lower(*args).compile() for program in (f, loss))
    for compiled in (forward, backward):
        hlo = compiled.as_text()
        found = [c for c in _COLLECTIVES if f" {c}(" in hlo or f"{c}-start(" in hlo]
        assert not found, found
    xla = _op_on_mesh(op, mesh, in_specs, out_spec, impl="xla")
    assert comparable_hlo(forward) == comparable_hlo(xla.lower(*args).compile())
