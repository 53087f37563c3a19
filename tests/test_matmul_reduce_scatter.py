import functools

import jax
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

OP = "matmul_reduce_scatter"


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


def test_scatter_dimension_one_and_data_axis(rng):
    """[batch, seq, hidden] scattered along seq, on a (data=2, tensor=4) mesh."""
    n, dp = 4, 2
    x = random(rng, (2 * dp, n * 3, n * 6), "float32")
    w = random(rng, (n * 6, 5), "float32")
    mesh = cpu_mesh(n, dp)
    fn = functools.partial(jfo.matmul_reduce_scatter, axis_name="tensor",
                           scatter_dimension=1, impl="decomposed", topology="bidirectional")
    specs = (P("data", None, "tensor"), P("tensor"))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("data", "tensor")))
    y = f(put(mesh, x, specs[0]), put(mesh, w, specs[1]))
    assert_close(y, f64(x) @ f64(w), "float32")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("impl", ["decomposed", "xla"])
def test_gradients(impl, n, rng):
    check_gradients(OP, n, impl, rng)
