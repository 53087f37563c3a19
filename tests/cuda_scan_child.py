"""Run by tests/test_cuda_ops.py in a fresh process (a crash fails one test,
not the session): the collective matmuls at the Mamba-2 1B step's shapes.

    python tests/cuda_scan_child.py CASE

CASE: "reduce_scatter_k5152" (matmul_reduce_scatter alone, k = 5152 per
device, against float64), or "unrolled" / "scan": two blocks of the Mamba
mixer's skeleton (all_gather_matmul in, matmul_reduce_scatter out, residual)
unrolled or in one ``lax.scan``, loss and gradients of impl="cuda" in bf16
against impl="xla" in bf16 and in float32 (support.assert_as_accurate).
Prints ``MATCH CASE`` when they agree.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import assert_as_accurate, assert_close, f64

import jax_flashoverlap as jfo

# The float32 reference without TF32 (as conftest sets for the other tests).
jax.config.update("jax_default_matmul_precision", "highest")

ROWS, D, IN_COLS, OUT_K = 8192, 2048, 10304, 4096  # global: seq, d_model, in_proj, out_proj k
LAYERS = 2


def reduce_scatter_k5152(mesh):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ROWS, 2 * 5152), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2 * 5152, D), np.float32) / 100, jnp.bfloat16)
    specs = (P(None, "tp"), P("tp", None))
    f = jax.jit(jax.shard_map(functools.partial(jfo.matmul_reduce_scatter, axis_name="tp",
                                                impl="cuda"),
                              mesh=mesh, in_specs=specs, out_specs=P("tp")))
    y = f(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)))
    jfo.check_device_errors()
    assert_close(y, f64(x) @ f64(w), "bfloat16")


def blocks(mesh, scan):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (ROWS, 1, D), jnp.float32)
    w_in = jax.random.normal(keys[1], (LAYERS, D, IN_COLS), jnp.float32) * D ** -0.5
    w_out = jax.random.normal(keys[2], (LAYERS, OUT_K, D), jnp.float32) * OUT_K ** -0.5
    specs = (P("tp"), P(None, None, "tp"), P(None, "tp", None))

    def loss(impl, dtype):
        def block(h, w_in, w_out):
            u = jfo.all_gather_matmul(h, w_in.astype(dtype), "tp", impl=impl)
            u = jax.nn.silu(u[..., : OUT_K // 2])
            return h + jfo.matmul_reduce_scatter(u, w_out.astype(dtype), "tp", impl=impl)

        def per_device(x, w_in, w_out):
            h = x.astype(dtype)
            if scan:
                h = jax.lax.scan(lambda h, w: (block(h, *w), None), h, (w_in, w_out))[0]
            else:
                for i in range(LAYERS):
                    h = block(h, w_in[i], w_out[i])
            return jax.lax.psum(jnp.sum(h.astype(jnp.float32) ** 2), "tp")

        f = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P())
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w_in, w_out), specs)]
    got = loss("cuda", jnp.bfloat16)(*args)
    jfo.check_device_errors()
    assert_as_accurate(got, loss("xla", jnp.bfloat16)(*args), loss("xla", jnp.float32)(*args),
                       "bfloat16")


def main():
    case = sys.argv[1]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:2]), ("tp",))
    if case == "reduce_scatter_k5152":
        reduce_scatter_k5152(mesh)
    else:
        blocks(mesh, scan={"scan": True, "unrolled": False}[case])
    from jax_flashoverlap import _module_loading
    print(f"MATCH {case} (CUDA module loading: {_module_loading.driver_mode()})", flush=True)


if __name__ == "__main__":
    main()
