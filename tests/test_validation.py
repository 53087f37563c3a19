"""The errors users hit, each naming the fix."""

import functools

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
    ((8,), (8, 4), "at least 2 dims"),
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
    match = "supported are" if dtype == "int32" else "share one dtype"
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


def test_numpy_int_chunks_are_taken(rng):
    x, w = random(rng, (8, 4), "float32"), random(rng, (4, 4), "float32")
    _in_shard_map(jfo.all_gather_matmul, x, w, (P("tensor"), P()), chunks=np.int64(2),
                  impl="decomposed")


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
    with pytest.raises(TypeError, match="axis_name must be"):
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
