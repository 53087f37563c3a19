"""What both models share: layers made by a scan equal layers made by a loop;
rms_norm's two backwards (autodiff, and the custom_vjp that keeps only the
inputs) against float32 autodiff, alone and inside shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import assert_as_accurate, assert_close, cpu_mesh, f64, random

from jax_flashoverlap import models

make_layers = models.layers.make_layers
rms_norm = models.layers.rms_norm


def _values(tree):
    """Leaves as numpy (key data for PRNG keys), for exact comparison."""
    def value(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return [value(x) for x in jax.tree.leaves(tree)]


def test_make_layers_equals_the_python_loop():
    """Bit-for-bit the loop's parameters, placed as their metadata says; rngs advanced alike."""
    config = models.MambaConfig.tiny()
    make = lambda rngs: models.mamba.Mamba2Block(config, rngs=rngs)  # noqa: E731
    mesh = cpu_mesh(tp=2)

    def create(scan: bool):
        rngs = nnx.Rngs(3)
        layers = (make_layers(make, 3, rngs=rngs) if scan
                  else [make(rngs=rngs) for _ in range(3)])
        return nnx.state(nnx.List(layers)), rngs.params()  # The key after the layers.

    with jax.set_mesh(mesh):
        loop, scan = jax.jit(lambda: create(False))(), jax.jit(lambda: create(True))()
    assert jax.tree.structure(scan) == jax.tree.structure(loop)
    for got, want in zip(_values(scan), _values(loop)):
        np.testing.assert_array_equal(got, want)
    specs = nnx.get_partition_spec(scan[0])  # From the variables' out_sharding metadata.
    for param, spec in zip(jax.tree.leaves(scan[0]), jax.tree.leaves(specs)):
        assert param.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), param.ndim)


def test_a_model_without_caches_says_it_does_not_decode():
    with jax.set_mesh(cpu_mesh(tp=1)):
        model = models.CausalLM(models.TransformerConfig.tiny(),
                                lambda rngs: nnx.Linear(4, 4, rngs=rngs), rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="CausalLM does not decode"):
        model.cache_specs()


def _value_and_grads(backward, x, gate, weight, group_size, probe):
    """rms_norm's output and the gradients of sum(output * probe) for x, gate
    and weight."""
    def loss(x, gate, weight):
        y = rms_norm(x, weight, eps=1e-5, group_size=group_size, gate=gate, backward=backward)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, gate, weight)
    return y, grads


@pytest.mark.parametrize("group_size", [8, None], ids=["grouped", "whole"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recomputed_backward_equals_autodiff(dtype, gated, group_size, rng):
    x = random(rng, (6, 3, 32), dtype)
    gate = random(rng, (6, 3, 32), dtype) if gated else None
    weight, probe = random(rng, (32,), "float32"), random(rng, (6, 3, 32), "float32")
    got = _value_and_grads("recompute", x, gate, weight, group_size, probe)
    want = _value_and_grads("autodiff", x, gate, weight, group_size, probe)
    exact = _value_and_grads("autodiff", x.astype(jnp.float32),
                             None if gate is None else gate.astype(jnp.float32), weight,
                             group_size, probe)
    assert got[0].dtype == x.dtype and (gate is None) == (got[1][1] is None)
    if dtype == "bfloat16":
        assert_as_accurate(got, want, exact, dtype)
        return
    for name, g, w in zip(("output", "x", "gate", "weight"), (got[0], *got[1]),
                          (want[0], *want[1])):
        if w is not None:
            try:
                assert_close(g, f64(w), dtype)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None


def test_recomputed_backward_sums_the_weight_gradient_over_data_shards(rng):
    """Inside shard_map over (data, tensor), the weight is split over tensor and
    the same on every data shard: its gradient is the sum over the data shards,
    as with autodiff."""
    mesh = cpu_mesh(tp=2, dp=2)
    x, gate = random(rng, (8, 4, 32), "float32"), random(rng, (8, 4, 32), "float32")
    weight = random(rng, (32,), "float32")

    def loss(backward, x, gate, weight):
        def local(x, gate, weight):
            y = rms_norm(x, weight, eps=1e-5, group_size=8, gate=gate, backward=backward)
            return jax.lax.psum(jnp.sum(y * y), ("data", "tensor"))
        spec = jax.P(None, "data", "tensor")
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, jax.P("tensor")),
                             out_specs=jax.P())(x, gate, weight)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    got, want = grad("recompute", x, gate, weight), grad("autodiff", x, gate, weight)
    for name, g, w in zip(("x", "gate", "weight"), got, want):
        try:
            assert_close(g, f64(w), "float32")
        except AssertionError as e:
            raise AssertionError(f"gradient of {name}: {e}") from None


def test_unknown_backward():
    with pytest.raises(ValueError, match=r"rms_norm: backward must be one of \('auto', "
                                         r"'autodiff', 'recompute', 'pallas'\), got 'fused'"):
        rms_norm(jnp.ones((2, 8)), jnp.ones(8), eps=1e-5, backward="fused")
