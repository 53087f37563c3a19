"""prefetch_to_l2: x passed through, the named arrays fetched into L2 on the way."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_support import build
from support import cpu_mesh, poison_allocator

import jax_flashoverlap as jfo
from jax_flashoverlap import _extension, l2_prefetch, models


def _with_kernel(monkeypatch):
    """As if the extension had the kernel: the call lowers to it for CUDA."""
    monkeypatch.setattr(_extension, "cuda_ops_available", lambda target=None: True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_bytes=-1), "max_bytes must be an int >= 0"),
    (dict(max_bytes=1.5), "max_bytes must be an int >= 0"),
    (dict(max_bytes=64, count=l2_prefetch.MAX_ARRAYS + 1), "at most 8 arrays per call"),
])
def test_bad_input_gets_a_clear_error(kwargs, message):
    arrays = [jnp.ones(4)] * kwargs.pop("count", 1)
    with pytest.raises(ValueError, match=message):
        jfo.prefetch_to_l2(jnp.ones(3), arrays, **kwargs)


def test_the_result_is_x_and_its_derivative_the_identity(monkeypatch, rng):
    """Off CUDA the call is x: its value, and (through the custom JVP) the
    gradient of x, with no gradient reaching the prefetched arrays."""
    _with_kernel(monkeypatch)
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 8)), jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(jnp.sin(jfo.prefetch_to_l2(x, [w], max_bytes=1 << 20)))

    value, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(jnp.sum(jnp.sin(x))))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(jnp.cos(x)))
    assert not np.any(np.asarray(dw, np.float32))


def _cuda_hlo(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowered_for_cuda_it_is_one_aliased_call(monkeypatch):
    """For CUDA: one custom call, its result aliasing x (no copy of x), with
    the byte budget as an attribute; nothing at a budget of 0 or without arrays."""
    _with_kernel(monkeypatch)
    x, w, v = jnp.ones((2, 16), jnp.bfloat16), jnp.ones((64, 64)), jnp.ones(32)
    hlo = _cuda_hlo(lambda x, w, v: jfo.prefetch_to_l2(x, [w, v], max_bytes=12345), x, w, v)
    assert hlo.count('custom_call @jfo_prefetch_to_l2') == 1, hlo
    assert "output_operand_aliases" in hlo and "12345" in hlo
    for max_bytes, with_w in ((0, True), (100, False)):
        def nothing(x, w, max_bytes=max_bytes, with_w=with_w):
            return jfo.prefetch_to_l2(x, [w] if with_w else [], max_bytes=max_bytes)
        assert "jfo_prefetch_to_l2" not in _cuda_hlo(nothing, x, w)


def test_the_call_is_typed_inside_shard_map(monkeypatch):
    """Inside shard_map the result varies like x and the arrays together."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    seen = []

    def per_device(x, w):
        y = l2_prefetch._ffi_prefetch(x, w, max_bytes=64)
        seen.append(jax.typeof(y).manual_axis_type.varying)
        return y
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(None, "tensor")),
                      out_specs=P("data", "tensor"))
    jax.jit(f).trace(jnp.ones((4, 16), jnp.bfloat16), jnp.ones((16, 32), jnp.bfloat16))
    assert seen == [frozenset({"data", "tensor"})]


def test_the_transformer_decode_step_prefetches_each_next_gemm(monkeypatch):
    """With decode_prefetch_mib, each block's decode step fetches, at its
    budget: after the QKV GEMM the output projection's and the MLP's
    gate/up weights, after gate/up the down projection's, and after the
    down projection the next block's QKV weights (none after the last)."""
    _with_kernel(monkeypatch)
    calls = []
    real = l2_prefetch._prefetch

    def record(x, arrays, max_bytes):
        calls.append(([a.shape for a in arrays], max_bytes))
        return real(x, arrays, max_bytes)
    monkeypatch.setattr(l2_prefetch, "_prefetch", record)
    model_cls, config = models.Transformer, models.TransformerConfig.tiny()
    config = dataclasses.replace(config, decode_prefetch_mib=3)
    model = build(model_cls, config, cpu_mesh(tp=2))
    with jax.set_mesh(cpu_mesh(tp=2)):
        generator = models.Generator(model, batch=2, prompt_len=4, max_new_tokens=3)
        calls.clear()
        generator.decode_steps(1)  # traced again for one step
    d, f, h = config.embed_dim, config.mlp_dim // 2, config.head_dim
    qkv = (d, (config.num_heads + 2 * config.num_kv_heads) * h // 2)
    out, gate_up, down = (config.num_heads * h // 2, d), (d, 2 * f), (f, d)
    block = [([out, gate_up], 3 << 20), ([down], 3 << 20), ([qkv], 3 << 20)]
    assert calls == block * (config.num_layers - 1) + block[:2]


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="decode_prefetch_mib must be an int >= 0"):
        models.TransformerConfig(decode_prefetch_mib=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("max_bytes", [0, 16, 1000, 200_000, 1 << 30])
def test_on_gpu_the_result_is_x_whatever_the_budget(max_bytes, rng):
    """x's bits come back (out of poisoned memory) at budgets below one
    chunk, between chunks and above every array's size, with arrays of
    sizes that are not multiples of 16 bytes, in a loop."""
    assert _extension.cuda_ops_available("jfo_prefetch_to_l2")
    x = jnp.asarray(rng.standard_normal((3, 1000)), jnp.bfloat16)
    arrays = [jnp.asarray(rng.standard_normal(n), jnp.bfloat16) for n in (77, 300_001, 4096)]

    def steps(x, *arrays):
        def body(i, total):  # x times a power of two each step: exact, and not hoistable
            scale = jnp.exp2(i.astype(jnp.float32)).astype(x.dtype)
            y = jfo.prefetch_to_l2(x * scale, arrays, max_bytes=max_bytes)
            return total + y.astype(jnp.float32)
        return jax.lax.fori_loop(0, 4, body, jnp.zeros(x.shape, jnp.float32))

    poison_allocator(x.nbytes)
    got = jax.jit(steps)(x, *arrays)
    np.testing.assert_array_equal(np.asarray(got), 15 * np.asarray(x, np.float32))
    hlo = jax.jit(steps).lower(x, *arrays).compile().as_text()
    assert ("jfo_prefetch_to_l2" in hlo) == (max_bytes > 0)


@pytest.mark.gpu
def test_on_gpu_decoding_with_prefetch_gives_the_same_tokens_and_logits():
    """The bf16 Transformer's decode loop with decode_prefetch_mib: the
    tokens and logits of the loop without it, bit for bit."""
    model_cls, config = models.Transformer, models.TransformerConfig.small()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]).reshape(1, 1),
                             ("data", "tensor"))
    config = dataclasses.replace(config, dtype="bfloat16")
    plain = build(model_cls, config, mesh)
    prefetching = build(model_cls, dataclasses.replace(config, decode_prefetch_mib=8), mesh,
                        nnx.state(plain))
    prompt = np.random.default_rng(7).integers(0, config.vocab_size, (1, 40), np.int32)
    with jax.set_mesh(mesh):
        want_tokens, want = models.generate(plain, prompt, 12, return_logits=True)
        tokens, logits = models.generate(prefetching, prompt, 12, return_logits=True)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
