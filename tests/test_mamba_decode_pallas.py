"""Mamba-2's decode-step mixer kernel against numpy in float64: in Pallas's
interpreter on CPU, compiled on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_close, random

from jax_flashoverlap import models

kernel = models.mamba_decode_pallas


def _case(rng, dtype, layout, batch=2, groups=2, width=4, pos=9):
    """Random inputs of ``kernel.mixer_step`` (see its docstring) at
    position ``pos``; the ring's row of position pos-k, which the step
    overwrites, is NaN."""
    hpg, p, n = layout
    c = hpg * p + 2 * n
    heads = groups * hpg
    zxbcdt = random(rng, (batch, groups, 2 * hpg * p + 2 * n + hpg), dtype)
    ring = np.array(random(rng, (width, batch, groups * c), dtype))
    ring[pos % width] = np.nan
    weight = random(rng, (width, groups * c), jnp.float32) * 0.5
    bias = random(rng, (groups * c,), jnp.float32)
    dt_bias = jnp.asarray(rng.uniform(-4, -1, heads), jnp.float32)
    a_log = jnp.asarray(np.log(rng.uniform(1, 16, heads)), jnp.float32)
    d_skip = random(rng, (heads,), jnp.float32)
    ssm = random(rng, (batch, groups, hpg, p, n), jnp.float32)
    return (zxbcdt, jnp.asarray(ring), weight, bias, dt_bias, a_log, d_skip, ssm,
            jnp.int32(pos))


def _reference(zxbcdt, ring, weight, bias, dt_bias, a_log, d_skip, ssm, pos, layout):
    """float64 (y, state, ring after the step), written out per group."""
    hpg, p, n = layout
    zxbcdt, ring, weight, bias, dt_bias, a_log, d_skip, ssm = (
        np.asarray(t, np.float64) for t in (zxbcdt, ring, weight, bias, dt_bias, a_log,
                                            d_skip, ssm))
    batch, groups, _ = zxbcdt.shape
    width = ring.shape[0]
    pos = int(pos)
    xbc = zxbcdt[..., hpg * p:2 * hpg * p + 2 * n].reshape(batch, -1)      # [b, g·c]
    window = np.stack([ring[t % width] for t in range(pos - width + 1, pos)] + [xbc])
    pre = bias + np.einsum("kc,kbc->bc", weight, window)
    act = (pre / (1 + np.exp(-pre))).reshape(batch, groups, -1)
    x = act[..., :hpg * p].reshape(batch, groups, hpg, p)
    b, c = act[..., hpg * p:hpg * p + n], act[..., hpg * p + n:]
    dt = np.logaddexp(0, zxbcdt[..., -hpg:] + dt_bias.reshape(groups, hpg))  # softplus
    decay = np.exp(-dt * np.exp(a_log.reshape(groups, hpg)))
    state = (decay[..., None, None] * ssm
             + (dt[..., None] * x)[..., None] * b[:, :, None, None, :])
    y = np.einsum("bghpn,bgn->bghp", state, c) + d_skip.reshape(groups, hpg, 1) * x
    after = ring.copy()
    after[pos % width] = xbc
    return y, state, after


LAYOUTS = {"one block a head": kernel.Layout(2, 16, 32),
           "a head in blocks": kernel.Layout(1, 128, 64),      # at batch 2: 8 blocks of 16
           "the 1.4B model's": kernel.Layout(8, 64, 128)}


def _check(rng, dtype, layout, interpret, step=kernel.mixer_step, **shape):
    args = _case(rng, dtype, layout, **shape)
    want_y, want_state, want_ring = _reference(*args, layout)
    options = {} if step is kernel.mixer_step_xla else {"interpret": interpret}
    run = jax.jit(lambda *t: step(*t, layout, **options), donate_argnums=(1, 7))
    y, state, ring = run(*args)
    assert y.dtype == jnp.dtype(dtype) and state.dtype == jnp.float32
    assert_close(y, want_y, dtype)
    assert_close(state, want_state, "float32" if dtype == "float32" else dtype)
    # The ring's update is a copy: exact, the other rows untouched.
    np.testing.assert_array_equal(np.asarray(ring, np.float64), want_ring)


@pytest.mark.parametrize("layout", ["one block a head", "a head in blocks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixer_step_matches_float64(layout, dtype, rng):
    _check(rng, dtype, LAYOUTS[layout], interpret=True, batch=2, groups=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_xla_step_matches_float64(dtype, rng):
    """mixer_step_xla, the kernel's contract in XLA's ops."""
    _check(rng, dtype, LAYOUTS["one block a head"], interpret=False,
           step=kernel.mixer_step_xla)


@pytest.mark.parametrize("pos", [0, 2, 3, 4, 7])
def test_every_ring_row(pos, rng):
    """The new position's row, and the window's, at every row of the ring
    (k = 4), from the first position on. The rows of positions before 0 are
    read as the ring holds them (prefill writes zeros there; here they are
    random, and the reference reads the same rows)."""
    _check(rng, "float32", LAYOUTS["one block a head"], interpret=True, pos=pos)


@pytest.mark.parametrize("channels", [16, 32])
def test_channel_blocks(channels, rng):
    """A head of 128 channels in blocks of 16 and 32 (the default takes the
    whole head where that makes enough programs)."""
    layout = LAYOUTS["a head in blocks"]
    args = _case(rng, "float32", layout)
    want_y, want_state, _ = _reference(*args, layout)
    y, state, _ = kernel.mixer_step(*args, layout, channels=channels, interpret=True)
    assert_close(y, want_y, "float32")
    assert_close(state, want_state, "float32")
    assert kernel._channels(64, 64) == 16 and kernel._channels(64, 2048) == 64


def test_the_models_layout_matches_float64(rng):
    """The 1.4B model's layout, one group (the interpreter runs a program at a time)."""
    _check(rng, "bfloat16", LAYOUTS["the 1.4B model's"], interpret=True, batch=1, groups=1)


def test_unsupported_layouts_and_shapes_are_errors():
    layout = kernel.Layout(2, 16, 32)
    args = _case(np.random.default_rng(0), "float32", layout)
    with pytest.raises(ValueError, match=r"state_dim=24 is not a power of two from 16; use "
                                         r"decode_mixer='xla'"):
        kernel.mixer_step(*args, kernel.Layout(2, 16, 24), interpret=True)
    with pytest.raises(ValueError, match=r"a group's x channels \(1x16\) are not a multiple "
                                         r"of state_dim=32"):
        kernel.mixer_step(*args, kernel.Layout(1, 16, 32), interpret=True)
    with pytest.raises(ValueError, match=r"conv is \(4, 2, 192\), expected \(4, 2, 128\)"):
        kernel.mixer_step(*args, kernel.Layout(2, 16, 16), interpret=True)
    with pytest.raises(ValueError, match=r"channels=24 must be a power of two up to "
                                         r"head_dim=16"):
        kernel.mixer_step(*args, layout, channels=24, interpret=True)
    assert kernel.unsupported_reason(kernel.Layout(2, 12, 32)) == \
        "head_dim=12 is not a power of two from 16"


def test_compiled_kernel_needs_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    layout = kernel.Layout(2, 16, 32)
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs only \(Pallas Triton\).*use "
                                         r"decode_mixer='xla'"):
        kernel.mixer_step(*_case(np.random.default_rng(0), "float32", layout), layout)


@pytest.mark.parametrize("batch", [1, 32])
def test_kernel_lowers_to_triton_without_a_gpu(batch, monkeypatch):
    """The 1.4B model's layer (8 groups of 8 heads of 64, state 128) lowers
    for an H200, the SSM state aliased."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    layout = LAYOUTS["the 1.4B model's"]
    args = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in
            _case(np.random.default_rng(0), "bfloat16", layout, batch=batch, groups=8)]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    text = jax.jit(lambda *t: kernel.mixer_step(*t, layout), donate_argnums=(1, 7)).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mamba_decode_mixer" in text
    # The kernel updates both states in place, and the donated states are the outputs.
    assert "output_operand_aliases" in text and text.count("tf.aliasing_output") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 5])
def test_kernel_matches_float64_on_gpu(dtype, batch, rng):
    """The 1.4B model's layout, and a head split into blocks."""
    _check(rng, dtype, LAYOUTS["the 1.4B model's"], interpret=False, batch=batch, groups=8)
    _check(rng, dtype, LAYOUTS["a head in blocks"], interpret=False, batch=batch, groups=2)
