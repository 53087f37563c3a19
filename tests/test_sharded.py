"""The global-array forms under jax.jit, on (data, tensor) meshes."""

import jax
import pytest
from jax.sharding import PartitionSpec as P
from support import assert_close, cpu_mesh, f64, put, random

from jax_flashoverlap import sharded


@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
def test_all_ops_under_jit_with_data_axis(impl, rng):
    mesh = cpu_mesh(tp=4, dp=2)
    x = put(mesh, random(rng, (2 * 4 * 3, 4 * 6), "float32"), P("data"))
    w_col = put(mesh, random(rng, (4 * 6, 4 * 6), "float32"), P())
    w_row = put(mesh, random(rng, (4 * 6, 7), "float32"), P())

    @jax.jit
    def layers(x, w_col, w_row):
        a = sharded.all_gather_matmul(x, w_col, axis_name="tensor", mesh=mesh, impl=impl)
        b = sharded.matmul_reduce_scatter(a, w_row, axis_name="tensor", mesh=mesh, impl=impl)
        c = sharded.matmul_all_reduce(a, w_row, axis_name="tensor", mesh=mesh, impl=impl)
        return a, b, c

    a, b, c = layers(x, w_col, w_row)
    ref_a = f64(x) @ f64(w_col)
    assert_close(a, ref_a, "float32")
    assert_close(b, ref_a @ f64(w_row), "float32")
    assert_close(c, ref_a @ f64(w_row), "float32")


def test_uses_the_mesh_from_set_mesh(rng):
    mesh = cpu_mesh(tp=4, dp=2)
    x = random(rng, (4, 3, 5), "float32")
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: sharded.all_reduce(x, axis_name="tensor", impl="decomposed"))(
            put(mesh, x, P("tensor")))
    assert_close(y, f64(x).sum(0), "float32")


def test_without_mesh_names_the_fix(rng):
    with pytest.raises(ValueError, match="set_mesh"):
        sharded.all_reduce(random(rng, (4, 3), "float32"), axis_name="tensor")


def test_unknown_axis(rng):
    mesh = cpu_mesh(tp=4, dp=2)
    with pytest.raises(ValueError, match="there is no 'model'"):
        sharded.all_reduce(random(rng, (4, 3), "float32"), axis_name="model", mesh=mesh)


def test_op_names_reach_the_compiled_program(rng):
    """jax.named_scope names are what jax.profiler traces show."""
    mesh = cpu_mesh(tp=2)
    x = random(rng, (4, 8), "float32")
    w = random(rng, (8, 4), "float32")
    hlo = jax.jit(lambda x, w: sharded.all_gather_matmul(
        x, w, axis_name="tensor", mesh=mesh, impl="decomposed")).lower(x, w).compile().as_text()
    assert "jax_flashoverlap.all_gather_matmul" in hlo
