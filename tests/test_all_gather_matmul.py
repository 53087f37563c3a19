import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support import (
    assert_close,
    check_against_reference,
    check_gradients,
    cpu_mesh,
    f64,
    put,
    random,
)

import jax_flashoverlap as jfo

OP = "all_gather_matmul"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
def test_matches_float64_reference(impl, n, dtype, rng):
    check_against_reference(OP, n, dtype, rng, impl=impl)


@pytest.mark.parametrize("topology", ["ring", "bidirectional", "direct"])
@pytest.mark.parametrize("n", [3, 4, 8])
def test_decomposed_topologies(topology, n, rng):
    check_against_reference(OP, n, "float32", rng, batch=False, impl="decomposed",
                            topology=topology)


def test_gather_axis_one_and_data_axis(rng):
    """[batch, seq, hidden] gathered along seq, on a (data=2, tensor=4) mesh."""
    n, dp = 4, 2
    x = random(rng, (2 * dp, n * 3, 12), "float32")
    w = random(rng, (12, n * 5), "float32")
    mesh = cpu_mesh(n, dp)
    fn = functools.partial(jfo.all_gather_matmul, axis_name="tensor", gather_axis=1,
                           impl="decomposed")
    specs = (P("data", "tensor"), P(None, "tensor"))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("data", None, "tensor")))
    y = f(put(mesh, x, specs[0]), put(mesh, w, specs[1]))
    assert_close(y, f64(x) @ f64(w), "float32")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("impl", ["decomposed", "xla"])
def test_gradients(impl, n, rng):
    check_gradients(OP, n, impl, rng)


def test_replicated_weight_gradient_is_summed(rng):
    """w replicated over the axis (in_specs P()): its gradient sums all ranks'."""
    n = 4
    mesh = cpu_mesh(n)
    x = random(rng, (n * 3, 6), "float32")
    w = random(rng, (6, 5), "float32")

    def loss(x, w):
        fn = functools.partial(jfo.all_gather_matmul, axis_name="tensor", impl="decomposed")
        y = jax.shard_map(fn, mesh=mesh, in_specs=(P("tensor"), P()), out_specs=P("tensor"))(x, w)
        return jnp.sum(y ** 2)

    gw = jax.jit(jax.grad(loss, argnums=1))(put(mesh, x, P("tensor")), put(mesh, w, P()))
    # Each rank computes all of x @ w, so the stacked output holds it n times.
    expected = n * 2 * f64(x).T @ (f64(x) @ f64(w))
    assert_close(gw, expected, "float32")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce"])
def test_gradients_with_a_second_manual_axis(op, rng):
    """shard_map manual over (data, tensor), w replicated over data: dw sums over data."""
    n, dp = 2, 4
    mesh = cpu_mesh(n, dp)
    if op == "all_gather_matmul":
        x = random(rng, (dp * 2, n * 3, 8), "float32")
        w = random(rng, (8, n * 5), "float32")
        specs, out = (P("data", "tensor"), P(None, "tensor")), P("data", None, "tensor")
        kwargs = dict(gather_axis=1)
    else:
        x = random(rng, (dp * 2, n * 3, n * 4), "float32")
        w = random(rng, (n * 4, 5), "float32")
        specs = (P("data", None, "tensor"), P("tensor"))
        out = P("data", "tensor") if op == "matmul_reduce_scatter" else P("data")
        kwargs = dict(scatter_dimension=1) if op == "matmul_reduce_scatter" else {}

    def loss(impl, x, w):
        fn = functools.partial(getattr(jfo, op), axis_name="tensor", impl=impl, **kwargs)
        y = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out)(x, w)
        return jnp.sum(jnp.sin(y))

    args = [put(mesh, a, s) for a, s in zip((x, w), specs)]
    got = jax.jit(jax.grad(functools.partial(loss, "decomposed"), argnums=(0, 1)))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1)))(*args)
    for g, ref in zip(got, want):
        assert_close(g, f64(ref), "float32")
