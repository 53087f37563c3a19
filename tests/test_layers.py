"""What both models share: layers made by a scan equal layers made by a loop."""

import jax
import numpy as np
import pytest
from flax import nnx
from support import cpu_mesh

from jax_flashoverlap import models

make_layers = models.layers.make_layers


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
