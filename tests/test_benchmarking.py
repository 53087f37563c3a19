"""The timing protocol: differences of loop lengths, checked arguments."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support import cpu_mesh, put, random

from jax_flashoverlap.benchmarking import Timing, time_per_op


def test_times_a_dependent_loop(rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (2 * 64, 64), "float32"), P("tensor"))
    t = time_per_op(lambda a: jnp.tanh(a @ a.T), [x], mesh=mesh, in_specs=(P("tensor"),),
                    k1=1, k2=4, reps=3, warmup=1)
    assert isinstance(t, Timing) and t.reps == 3
    assert t.min_s <= t.median_s <= t.max_s
    assert t.median_us == pytest.approx(t.median_s * 1e6)


@pytest.mark.parametrize("k1,k2", [(0, 4), (4, 4), (5, 2)])
def test_rejects_bad_loop_lengths(k1, k2, rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (4, 4), "float32"), P("tensor"))
    with pytest.raises(ValueError, match="0 < k1 < k2"):
        time_per_op(lambda a: a, [x], mesh=mesh, in_specs=(P("tensor"),), k1=k1, k2=k2)


def test_unrolled_loop_with_compiler_options(rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (2 * 32, 32), "float32"), P("tensor"))
    t = time_per_op(lambda a: jnp.tanh(a @ a.T), [x], mesh=mesh, in_specs=(P("tensor"),),
                    k1=2, k2=10, reps=3, warmup=1, unroll=4,
                    compiler_options={"xla_cpu_enable_fast_math": False})
    assert t.min_s <= t.median_s <= t.max_s and t.reps == 3


def test_rejects_unroll_below_one(rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (4, 4), "float32"), P("tensor"))
    with pytest.raises(ValueError, match="unroll"):
        time_per_op(lambda a: a, [x], mesh=mesh, in_specs=(P("tensor"),), unroll=0)
