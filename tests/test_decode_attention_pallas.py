"""The decode-attention kernel against numpy in float64: in Pallas's
interpreter on CPU, compiled on GPUs."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_close, random, slow_unless

from jax_flashoverlap import models

kernel = models.decode_attention_pallas


@pytest.fixture(params=[False, True], ids=["separate", "packed"])
def inputs_packed(request, monkeypatch):
    """Each test with q, k and v as separate inputs and packed in one
    (``PACKED_INPUTS``)."""
    monkeypatch.setattr(kernel, "PACKED_INPUTS", request.param)
    return request.param


def _case(rng, dtype, b=2, kv=2, q_per_kv=2, h=32, length=200):
    """Random q [b, kv, q_per_kv, h], k and v [b, kv, 1, h], and the two
    caches [b, kv, length, h] as writable numpy arrays."""
    q = random(rng, (b, kv, q_per_kv, h), dtype)
    k, v = (random(rng, (b, kv, 1, h), dtype) for _ in range(2))
    caches = [np.array(random(rng, (b, kv, length, h), dtype)) for _ in range(2)]
    return q, k, v, caches


def _reference(q, k, v, cache_k, cache_v, pos):
    """float64 softmax(q·kᵀ/√h)·v over cache positions 0..pos-1 and the new one."""
    keys = np.concatenate([np.asarray(cache_k[:, :, :pos], np.float64),
                           np.asarray(k, np.float64)], axis=2)       # [b, kv, pos+1, h]
    values = np.concatenate([np.asarray(cache_v[:, :, :pos], np.float64),
                             np.asarray(v, np.float64)], axis=2)
    scores = np.einsum("bgqh,bglh->bgql", np.asarray(q, np.float64), keys) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bgql,bglh->bgqh", weights, values)


def _check(rng, dtype, pos, splits, interpret, **shape):
    q, k, v, (cache_k, cache_v) = _case(rng, dtype, **shape)
    # Poison what must not be read: the new position and every one after it.
    for cache in (cache_k, cache_v):
        cache[:, :, pos:] = np.nan
    want = _reference(q, k, v, cache_k, cache_v, pos)
    run = jax.jit(lambda *t: kernel.decode_attention(*t, splits=splits, interpret=interpret),
                  donate_argnums=(3, 4))
    out, got_k, got_v = run(q, k, v, jnp.asarray(cache_k), jnp.asarray(cache_v),
                            jnp.int32(pos))
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, want, dtype)
    for got, cache, new in ((got_k, cache_k, k), (got_v, cache_v, v)):
        expected = cache.copy()
        expected[:, :, pos] = np.asarray(new)[:, :, 0]
        # Bit for bit, the NaN poison too (numpy's NaN-equality misses bf16).
        bits = f"u{expected.itemsize}"
        np.testing.assert_array_equal(np.asarray(got).view(bits), expected.view(bits))


# By default each position once and each splits twice: 6 of the 18 pairs.
@pytest.mark.parametrize("splits, pos", slow_unless(
    [(None, 0), (1, 1), (3, 63), (None, 64), (1, 150), (3, 199)],
    list(itertools.product([1, 3, None], [0, 1, 63, 64, 150, 199]))))
def test_attention_and_cache_update_match_float64(pos, splits, rng, inputs_packed):
    """Cache length 200 (no multiple of the 64-position block), one to three
    splits; positions from ``pos`` on are NaN and never read."""
    _check(rng, "float32", pos, splits, interpret=True)


@pytest.mark.parametrize("q_per_kv", slow_unless([1, 14, 15, 16], [1, 3, 14, 15, 16]))
def test_query_groups(q_per_kv, rng, inputs_packed):
    """bf16, 1 to 16 query heads per KV head (the padded rows' full tile;
    packed, from 15 on, two tiles)."""
    _check(rng, "bfloat16", 130, None, interpret=True, q_per_kv=q_per_kv, b=1, kv=3)


def test_default_splits_follow_the_split_positions(monkeypatch):
    """About 128 programs, none with fewer than MIN_SPLIT_POSITIONS positions:
    the 1B layer at batch 1 and a cache of 560 (8 KV heads)."""
    assert kernel.MIN_SPLIT_POSITIONS == 128
    assert kernel._tiling(1, 8, 560, None, False).splits == 5          # 560 / 128
    monkeypatch.setattr(kernel, "MIN_SPLIT_POSITIONS", 64)
    tiling = kernel._tiling(1, 8, 560, None, False)
    assert (tiling.splits, tiling.split_len) == (9, 64)
    assert kernel._tiling(32, 8, 560, None, False).splits == 1         # 256 programs already


def test_bad_heads_and_shapes_are_errors():
    q = jnp.zeros((1, 2, 32, 32))
    kv = jnp.zeros((1, 2, 1, 32))
    cache = jnp.zeros((1, 2, 64, 32))
    with pytest.raises(ValueError, match=r"query heads per KV head \(32\) are more than 16; "
                                         r"use decode_attention='model'"):
        kernel.decode_attention(q, kv, kv, cache, cache, 0, interpret=True)
    with pytest.raises(ValueError, match=r"k \(1, 2, 2, 32\) and v \(1, 2, 1, 32\) must be "
                                         r"\(1, 2, 1, 32\)"):
        kernel.decode_attention(jnp.zeros((1, 2, 2, 32)), jnp.zeros((1, 2, 2, 32)), kv, cache,
                                cache, 0, interpret=True)
    with pytest.raises(ValueError, match=r"caches \(1, 2, 64, 16\)"):
        kernel.decode_attention(jnp.zeros((1, 2, 2, 32)), kv, kv, jnp.zeros((1, 2, 64, 16)),
                                jnp.zeros((1, 2, 64, 16)), 0, interpret=True)
    with pytest.raises(ValueError, match="splits=0 must be a positive int"):
        kernel.decode_attention(jnp.zeros((1, 2, 2, 32)), kv, kv, cache, cache, 0, splits=0,
                                interpret=True)


def test_compiled_kernel_needs_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs only \(Pallas Triton\).*use "
                                         r"decode_attention='model'"):
        kernel.decode_attention(jnp.zeros((1, 2, 2, 32)), jnp.zeros((1, 2, 1, 32)),
                                jnp.zeros((1, 2, 1, 32)), jnp.zeros((1, 2, 64, 32)),
                                jnp.zeros((1, 2, 64, 32)), 0)


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_lowers_to_triton_without_a_gpu(splits, monkeypatch, inputs_packed):
    """The 1B Transformer's layer (8 KV heads, 2 query heads each, 128 wide)
    at a cache of 560 positions lowers for an H200, the caches aliased."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    bf16 = jnp.bfloat16
    args = [jax.ShapeDtypeStruct(s, bf16) for s in
            ((1, 8, 2, 128), (1, 8, 1, 128), (1, 8, 1, 128), (1, 8, 560, 128),
             (1, 8, 560, 128))] + [jax.ShapeDtypeStruct((), jnp.int32)]

    def attend(*t):
        return kernel.decode_attention(*t, splits=splits, interpret=False)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    text = jax.jit(attend, donate_argnums=(3, 4)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "decode_attention" in text
    # The kernel writes the caches in place, and the donated caches are the outputs.
    assert "output_operand_aliases" in text and text.count("tf.aliasing_output") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("splits", [1, None])
def test_kernel_matches_float64_on_gpu(dtype, splits, rng, inputs_packed):
    """The 1B Transformer's heads, a cache of 560 positions, at several positions."""
    for pos in (0, 100, 511, 559):
        _check(rng, dtype, pos, splits, interpret=False, b=2, kv=8, q_per_kv=2, h=128,
               length=560)
