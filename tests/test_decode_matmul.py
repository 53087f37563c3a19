"""decode_matmul: the decode step's few-row matmul, XLA's and the CUDA kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_close, f64, poison_allocator

import jax_flashoverlap as jfo
from jax_flashoverlap import _extension
from jax_flashoverlap.decode_matmul import TILE_COLUMNS, _kernel_applies, _kernel_dot


def _operands(rng, rows, k, n, dtype=jnp.bfloat16, lead=()):
    x = jnp.asarray(rng.standard_normal((*lead, rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return x, w


def _reference(x, w):
    return f64(x.astype(jnp.float32)) @ f64(w.astype(jnp.float32))


@pytest.mark.parametrize("rows", [1, 3])
def test_xla_impl_is_the_dot(rows, rng):
    x, w = _operands(rng, rows, 24, 40, jnp.float32, lead=(2,))
    assert_close(jfo.decode_matmul(x, w), _reference(x, w), jnp.float32)


@pytest.mark.parametrize("rows, k, n, padded", [
    (1, 2048, 4096, True),     # the 1B Transformer's QKV: XLA would reduce it unpadded
    (1, 2048, 2048, True),
    (1, 8192, 2048, False),    # its down and gate/up projections stay GEMMs unpadded
    (1, 2048, 16384, False),
    (2, 2048, 2048, False),    # two rows are a GEMM already
])
def test_one_row_dots_are_padded_below_the_bound(rows, k, n, padded):
    """A one-row product is padded to two rows (behind a barrier) only when
    its weight has fewer than ONE_ROW_PAD_BELOW elements."""
    from jax_flashoverlap.decode_matmul import ONE_ROW_PAD_BELOW
    assert (k * n < ONE_ROW_PAD_BELOW) == (padded or rows > 1)
    jaxpr = str(jax.make_jaxpr(jfo.decode_matmul)(
        jax.ShapeDtypeStruct((1, rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n),
                                                                              jnp.bfloat16)))
    assert ("pad[" in jaxpr) == padded and ("optimization_barrier" in jaxpr) == padded, jaxpr


@pytest.mark.parametrize("kwargs, message", [
    (dict(impl="triton"), "impl='triton' is not one of"),
    (dict(w_shape=(24,)), "needs x [..., k] and w [k, n] of one dtype"),
    (dict(w_shape=(20, 16)), "needs x [..., k] and w [k, n] of one dtype"),
    (dict(w_dtype=jnp.float32), "needs x [..., k] and w [k, n] of one dtype"),
])
def test_bad_input_gets_a_clear_error(kwargs, message, rng):
    x = jnp.ones((2, 24), jnp.bfloat16)
    w = jnp.ones(kwargs.pop("w_shape", (24, 16)), kwargs.pop("w_dtype", jnp.bfloat16))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        jfo.decode_matmul(x, w, **kwargs)


def test_integer_operands_are_refused():
    with pytest.raises(TypeError, match=r"decode_matmul: takes floating-point operands "
                                        r"\(float32, bfloat16, float16\), got int32"):
        jfo.decode_matmul(jnp.ones((2, 24), jnp.int32), jnp.ones((24, 16), jnp.int32))


def test_cuda_impl_without_the_extension_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_extension, "_module", lambda: None)
    with pytest.raises(RuntimeError, match=r"decode_matmul\(impl='cuda'\).*Reinstall"):
        jfo.decode_matmul(jnp.ones((1, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16),
                          impl="cuda")


@pytest.mark.parametrize("rows, n, applies", [(1, 16, True), (8, 16, True), (9, 16, False),
                                              (2, 12, False)])
def test_the_kernel_applies_to_few_bf16_rows(rows, n, applies):
    w = jnp.ones((8, n), jnp.bfloat16)
    assert _kernel_applies(rows, w) is applies
    assert _kernel_applies(rows, w.astype(jnp.float32)) is False


def test_cuda_impl_elsewhere_than_cuda_is_the_dot_and_differentiable(monkeypatch, rng):
    """On CPU the kernel's platform branch is XLA's dot: values and gradients
    (through the custom JVP) equal the plain dot's."""
    monkeypatch.setattr(_extension, "require_cuda_ops", lambda *args: None)
    x, w = _operands(rng, 3, 32, 48, lead=(2,))

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w).astype(jnp.float32)))

    cuda = jax.jit(jax.value_and_grad(loss(lambda x, w: jfo.decode_matmul(x, w, impl="cuda")),
                                      argnums=(0, 1)))
    plain = jax.jit(jax.value_and_grad(loss(jnp.dot), argnums=(0, 1)))
    (value, grads), (want, want_grads) = cuda(x, w), plain(x, w)
    np.testing.assert_allclose(f64(value), f64(want), rtol=1e-6)
    for got, expected in zip(grads, want_grads):  # bf16 sums over reshaped rows
        assert_close(got, f64(expected), jnp.bfloat16)


def test_the_kernel_call_is_typed_inside_shard_map():
    """Inside shard_map the FFI call's result varies over the manual axes
    its operands vary over (the weight is cast to the activations')."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from jax_flashoverlap.decode_matmul import _ffi_dot

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    seen = []

    def per_device(x, w):
        y = _ffi_dot(x, w)
        seen.append(jax.typeof(y).manual_axis_type.varying)
        return y
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(None, "tensor")),
                      out_specs=P("data", "tensor"))
    jax.jit(f).trace(jnp.ones((4, 16), jnp.bfloat16), jnp.ones((16, 32), jnp.bfloat16))
    assert seen == [frozenset({"data", "tensor"})]


# Shapes: the 1B Transformer's decode matmuls (qkv, out, gate/up, down), and
# uneven ones: n not a multiple of the 64-column tile, k not a multiple of
# the splits, k too short to split.
GPU_SHAPES = [(2048, 4096), (2048, 2048), (2048, 16384), (8192, 2048), (1000, 200),
              (16, 8), (333, 72)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILE_COLUMNS)
@pytest.mark.parametrize("k, n", GPU_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_kernel_equals_float64_on_gpu(rows, k, n, tile, rng):
    """Every output element written (poisoned memory first), as close to the
    float64 product as XLA's own bf16 dot is, at each tile width."""
    x, w = _operands(rng, rows, k, n)
    poison_allocator(rows * n * 2)
    got = jax.jit(lambda x, w: _kernel_dot(x, w, tile))(x, w)
    xla = jax.jit(jnp.dot)(x, w)
    want = _reference(x, w)
    assert_close(got, want, jnp.bfloat16)
    err = np.linalg.norm(f64(got) - want) / np.linalg.norm(want)
    xla_err = np.linalg.norm(f64(xla) - want) / np.linalg.norm(want)
    assert err <= max(1.5 * xla_err, 2.0 ** -9), (err, xla_err)


@pytest.mark.gpu
def test_kernel_in_a_replayed_loop_on_gpu(rng):
    """Inside a loop (captured into a command buffer by XLA where it can),
    each step's product is the float64 one, in a program that also
    differentiates through the kernel."""
    x, w = _operands(rng, 4, 512, 256)

    def steps(x, w):
        def body(i, total):  # x scaled by a power of two each step: exact, and not hoistable
            scale = jnp.exp2((i % 3).astype(jnp.float32))
            y = jfo.decode_matmul((x * scale).astype(x.dtype), w, impl="cuda")
            return total + y.astype(jnp.float32) / scale
        return jax.lax.fori_loop(0, 8, body, jnp.zeros((4, 256), jnp.float32))

    got = jax.jit(steps)(x, w)
    assert_close(got / 8, _reference(x, w), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(
        jfo.decode_matmul(x, w, impl="cuda").astype(jnp.float32))))(w)
    want = np.broadcast_to(f64(x.astype(jnp.float32)).sum(0)[:, None], w.shape)
    assert_close(grad, want, jnp.bfloat16)
