import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import (
    case,
    check_against_reference,
    check_gradients,
    cpu_mesh,
    put,
)

import jax_flashoverlap as jfo

OP = "all_reduce"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
def test_matches_float64_reference(impl, n, dtype, rng):
    check_against_reference(OP, n, dtype, rng, impl=impl)


def test_decomposed_is_identical_on_every_rank(rng):
    """Every rank must end with the same bits (the sum is formed once, then copied)."""
    n = 8
    args, *_ = case(OP, n, rng, "bfloat16")
    mesh = cpu_mesh(n)
    f = jax.jit(jax.shard_map(lambda x: jfo.all_reduce(x[0], "tensor", impl="decomposed")[None],
                              mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"),
                              check_vma=False))
    per_rank = np.asarray(f(put(mesh, args[0], P("tensor"))).astype("float32"))
    assert all(np.array_equal(per_rank[0], per_rank[r]) for r in range(n))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("impl", ["decomposed", "xla"])
def test_gradients(impl, n, rng):
    check_gradients(OP, n, impl, rng)
