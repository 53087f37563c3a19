"""The global-array forms under jax.jit, on (data, tensor) meshes."""

import functools
import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import assert_close, cpu_mesh, f64, put, random, slow_unless

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
    with pytest.raises(ValueError, match="sharded.all_reduce: mesh axes are .* there is no "
                                         "'model'"):
        sharded.all_reduce(random(rng, (4, 3), "float32"), axis_name="model", mesh=mesh)


@pytest.mark.parametrize("op, x_shape, w_shape, message", [
    ("all_gather_matmul", (66, 2, 8), (8, 16),
     r"x \(66, 2, 8\) has 66 along dim 0, not divisible by the 4 ranks of \('tensor',\)"),
    ("matmul_reduce_scatter", (8, 2, 6), (6, 16), r"x \(8, 2, 6\) has 6 along dim 2"),
    ("matmul_all_reduce", (8, 10), (10, 12), r"x \(8, 10\) has 10 along dim 1"),
])
def test_a_dim_the_axis_does_not_divide_names_the_op_and_the_fix(op, x_shape, w_shape,
                                                                  message, rng):
    mesh = cpu_mesh(tp=4, dp=2)
    x, w = random(rng, x_shape, "float32"), random(rng, w_shape, "float32")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=f"sharded.{op}: ({message})"):
        jax.jit(lambda x, w: getattr(sharded, op)(x, w, axis_name="tensor"))(x, w)


def test_op_names_reach_the_compiled_program(rng):
    """jax.named_scope names are what jax.profiler traces show."""
    mesh = cpu_mesh(tp=2)
    x = random(rng, (4, 8), "float32")
    w = random(rng, (8, 4), "float32")
    hlo = jax.jit(lambda x, w: sharded.all_gather_matmul(
        x, w, axis_name="tensor", mesh=mesh, impl="decomposed")).lower(x, w).compile().as_text()
    assert "jax_flashoverlap.all_gather_matmul" in hlo


SEQ, BATCH, D, F = 8, 8, 12, 24


def _layer_ops(x, w_col, w_row, z, *, axis_name="tensor", impl="auto"):
    """Every op once, as a sequence-parallel block and a decode step use them."""
    a = sharded.all_gather_matmul(x, w_col, axis_name=axis_name, impl=impl)
    r = sharded.matmul_reduce_scatter(a, w_row, axis_name=axis_name, impl=impl)
    m = sharded.matmul_all_reduce(a, w_row, axis_name=axis_name, impl=impl)
    s = sharded.all_reduce(z, axis_name=axis_name, impl=impl)
    return a, r, m, s


def _reference(x, w_col, w_row, z):
    """_layer_ops in float64."""
    a = f64(x) @ f64(w_col)
    return a, a @ f64(w_row), a @ f64(w_row), f64(z).sum(0)


def _reference_grads(x, w_col, w_row, z, cotangents):
    """Float64 gradients of sum(_layer_ops(...) * cotangents) by each operand."""
    x, w_col, w_row = (f64(t) for t in (x, w_col, w_row))
    ca, cr, cm, cs = (f64(t) for t in cotangents)
    da = ca + (cr + cm) @ w_row.T
    return (da @ w_col.T, np.einsum("sbd,sbf->df", x, da),
            np.einsum("sbf,sbd->fd", x @ w_col, cr + cm), np.broadcast_to(cs, z.shape))


_MESHES = {"2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1)}
_BATCH = {"batch-on-data": True, "batch-whole": False}


# By default 4 of the 24 cases, each dtype, mesh, axis type and batch placement among them.
@pytest.mark.parametrize("dtype, mesh_shape, axis_type, placement", slow_unless(
    [("float32", "2x4", "explicit", "batch-on-data"), ("bfloat16", "4x2", "auto", "batch-whole"),
     ("float32", "8x1", "auto", "batch-on-data"), ("bfloat16", "2x4", "explicit", "batch-whole")],
    list(itertools.product(["float32", "bfloat16"], _MESHES, ["explicit", "auto"], _BATCH))))
def test_every_op_on_make_mesh_meshes(dtype, mesh_shape, axis_type, placement, rng):
    """jax.make_mesh meshes of both axis types (Explicit is jax 0.11's
    default), batch dims on the data axis or whole: forward and jax.grad of
    all four ops against float64."""
    shape, batch_sharded = _MESHES[mesh_shape], _BATCH[placement]
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(shape, ("data", "tensor"), axis_types=(kind, kind),
                         devices=jax.devices("cpu")[:8])
    tp = shape[1]
    batch = "data" if batch_sharded else None
    x = random(rng, (SEQ, BATCH, D), dtype)
    w_col, w_row = random(rng, (D, F), dtype), random(rng, (F, D), dtype)
    z = random(rng, (tp, BATCH, D), dtype)
    cotangents = [random(rng, s, "float32") for s in
                  ((SEQ, BATCH, F), (SEQ, BATCH, D), (SEQ, BATCH, D), (BATCH, D))]
    want = _reference(x, w_col, w_row, z)
    want_grads = _reference_grads(x, w_col, w_row, z, cotangents)

    def loss(x, w_col, w_row, z, cotangents):
        return sum(jnp.sum(out.astype(jnp.float32) * c)
                   for out, c in zip(_layer_ops(x, w_col, w_row, z), cotangents))

    with jax.set_mesh(mesh):
        args = (put(mesh, x, P("tensor", batch)), put(mesh, w_col, P(None, "tensor")),
                put(mesh, w_row, P("tensor")), put(mesh, z, P("tensor", batch)))
        got = jax.jit(_layer_ops)(*args)
        got_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args, cotangents)
    for g, w in zip((*got, *got_grads), (*want, *want_grads)):
        assert g.dtype == jnp.dtype(dtype)
        assert_close(g, w, dtype)
    if axis_type == "explicit" and batch_sharded and shape[0] > 1:
        # The batch stays on the data axis, as the operands' types had it.
        assert jax.typeof(got[2]).sharding.spec[1] == "data"


@pytest.mark.parametrize("impl", ["xla", "decomposed"])
def test_explicit_mesh_with_each_pure_jax_impl(impl, rng):
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=jax.devices("cpu")[:8])
    x = random(rng, (SEQ, BATCH, D), "float32")
    w_col, w_row = random(rng, (D, F), "float32"), random(rng, (F, D), "float32")
    z = random(rng, (4, BATCH, D), "float32")
    want = _reference(x, w_col, w_row, z)
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(_layer_ops, impl=impl))(
            put(mesh, x, P("tensor", "data")), w_col, w_row, put(mesh, z, P("tensor")))
    for g, w in zip(got, want):
        assert_close(g, w, "float32")


def test_all_reduce_dim_0_must_be_the_axis_size(rng):
    mesh = cpu_mesh(tp=4, dp=2)
    with pytest.raises(ValueError, match="dim 0 must be the 4 ranks"):
        sharded.all_reduce(random(rng, (8, 3), "float32"), axis_name="tensor", mesh=mesh)


@pytest.mark.parametrize("axis", [-1, 2, 1.0])
def test_bad_gather_axis(axis, rng):
    mesh = cpu_mesh(tp=4, dp=2)
    x, w = random(rng, (8, 2, 4), "float32"), random(rng, (4, 8), "float32")
    with pytest.raises((ValueError, TypeError), match="gather_axis"):
        sharded.all_gather_matmul(x, w, axis_name="tensor", mesh=mesh, gather_axis=axis)


# A bf16 sum inside a shard_map that is manual over only the tensor axis, on
# XLA's CPU backend: plain jax, and the same through the library.
_PARTIAL_MANUAL_BF16 = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P
mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
x = jnp.ones((16, 16), jnp.bfloat16)
with jax.set_mesh(mesh):
    if {library}:
        from jax_flashoverlap import sharded
        y = jax.jit(lambda x: sharded.matmul_reduce_scatter(
            x, x, axis_name="tensor", impl="xla"))(x)
        y = y.sum() + jax.jit(lambda x: sharded.all_reduce(
            x[:4], axis_name="tensor", impl="xla"))(x).sum()
    else:
        y = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "tensor"), in_specs=P("tensor"),
                                  out_specs=P(), axis_names={{"tensor"}}))(x)
print("finished", float(y.sum()))
"""


def _run_child(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)


def test_16_bit_sums_on_cpu_avoid_the_xla_abort():
    """The library's "xla" (and so "auto") sums run in float32 on CPU, where
    XLA aborts the process on the bf16 ones (_primitives._widened_16_bit)."""
    proc = _run_child(_PARTIAL_MANUAL_BF16.format(library=True))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # x @ x of 16x16 ones: 16 in each of 16 * 16 elements; the all_reduce of 4
    # rows of 16 ones: 4 in each of 16.
    assert f"finished {16 * 16 * 16 + 4 * 16:.1f}" in proc.stdout


def test_the_upstream_abort_is_still_there():
    """Plain jax still aborts on CPU; when this fails, XLA has fixed it and
    _primitives._widened_16_bit can go."""
    proc = _run_child(_PARTIAL_MANUAL_BF16.format(library=False))
    assert proc.returncode != 0 and "Invalid binary instruction opcode copy" in proc.stderr, (
        proc.returncode, proc.stderr[-2000:])
