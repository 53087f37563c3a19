"""The NNX parallel layers: placement by sharding metadata, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import assert_close, cpu_mesh, f64, random

from jax_flashoverlap.nn import ColumnParallelLinear, RowParallelLinear, shard_map_apply

SEQ, BATCH, D, F = 16, 4, 12, 24


def _pair(mesh, **kwargs):
    with jax.set_mesh(mesh):
        return nnx.List([ColumnParallelLinear(D, F, rngs=nnx.Rngs(0), **kwargs),
                         RowParallelLinear(F, D, rngs=nnx.Rngs(1), **kwargs)])


def test_parameters_are_placed_by_their_sharding():
    mesh = cpu_mesh(tp=4, dp=2)
    up, down = _pair(mesh)
    assert up.kernel[...].shape == (D, F) and down.kernel[...].shape == (F, D)
    assert up.kernel[...].sharding.spec == P(None, "tensor")
    assert down.kernel[...].sharding.spec == P("tensor", None)
    assert nnx.get_partition_spec(nnx.state(up)).kernel.get_value() == P(None, "tensor")


def test_parameters_do_not_depend_on_the_mesh():
    one, eight = _pair(cpu_mesh(tp=1)), _pair(cpu_mesh(tp=4, dp=2))
    for a, b in zip(jax.tree.leaves(nnx.state(one)), jax.tree.leaves(nnx.state(eight))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("impl", ["xla", "decomposed"])
def test_column_then_row_matches_dense(impl, sequence_parallel, rng):
    """y = (x W1) W2 on a (2, 4) mesh, and its gradients, against float64."""
    mesh = cpu_mesh(tp=4, dp=2)
    layers = _pair(mesh, impl=impl, sequence_parallel=sequence_parallel)
    x = random(rng, (SEQ, BATCH, D), "float32")
    probe = random(rng, (SEQ, BATCH, D), "float32")
    spec = P("tensor" if sequence_parallel else None, "data")

    def loss(layers, x):
        y = shard_map_apply(lambda m, x: m[1](m[0](x)), layers, x, in_specs=(spec,),
                            out_specs=spec)
        return jnp.sum(y * probe), y

    with jax.set_mesh(mesh):
        (_, y), (grads, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1),
                                                         has_aux=True))(layers, x)
    w1, w2 = (f64(layer.kernel[...]) for layer in layers)
    x64, p64 = f64(x).reshape(-1, D), f64(probe).reshape(-1, D)
    assert_close(y, (x64 @ w1 @ w2).reshape(SEQ, BATCH, D), "float32")
    assert_close(grads[1].kernel[...], (x64 @ w1).T @ p64, "float32")
    assert_close(grads[0].kernel[...], x64.T @ (p64 @ w2.T), "float32")
    assert_close(dx, (p64 @ w2.T @ w1.T).reshape(SEQ, BATCH, D), "float32")


def test_explicit_sharding_mesh(rng):
    """Under jax.make_mesh's default (Explicit axes) inputs are resharded to in_specs."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    layers = _pair(mesh, impl="decomposed")
    x = random(rng, (SEQ, BATCH, D), "float32")
    with jax.set_mesh(mesh):
        y = nnx.jit(lambda m, x: shard_map_apply(lambda m, x: m[1](m[0](x)), m, x,
                                                 in_specs=(P("tensor", "data"),),
                                                 out_specs=P("tensor", "data")))(layers, x)
    w1, w2 = (f64(layer.kernel[...]) for layer in layers)
    assert_close(y, f64(x) @ w1 @ w2, "float32")


def test_compute_dtype_keeps_float32_parameters(rng):
    mesh = cpu_mesh(tp=2)
    layers = _pair(mesh, impl="xla", dtype=jnp.bfloat16)
    x = random(rng, (SEQ, BATCH, D), "float32")
    with jax.set_mesh(mesh):
        y = nnx.jit(lambda m, x: shard_map_apply(lambda m, x: m[1](m[0](x)), m, x,
                                                 in_specs=(P("tensor"),),
                                                 out_specs=P("tensor")))(layers, x)
    assert layers[0].kernel[...].dtype == jnp.float32 and y.dtype == jnp.bfloat16
    w1, w2 = (f64(layer.kernel[...]) for layer in layers)
    assert_close(y, f64(x) @ w1 @ w2, "bfloat16")


def test_outside_shard_map_names_the_fix(rng):
    up, _ = _pair(cpu_mesh(tp=2), impl="xla")
    with pytest.raises(ValueError, match="not bound"):
        up(random(rng, (SEQ, BATCH, D), "float32"))


def test_shard_map_apply_without_mesh_names_the_fix(rng):
    up, _ = _pair(cpu_mesh(tp=2))
    with pytest.raises(ValueError, match="set_mesh"):
        shard_map_apply(lambda m, x: m(x), up, random(rng, (SEQ, BATCH, D), "float32"),
                        in_specs=(P(),), out_specs=P())
