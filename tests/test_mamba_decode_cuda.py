"""Every block of a Mamba-2 decode step as one CUDA kernel
(models.mamba_decode_cuda): its JAX reference against the model's own decode
on CPU, the kernel against the reference and the model on a GPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import TOLERANCE, cpu_mesh, slow_unless

import jax_flashoverlap
from jax_flashoverlap import models

fused = models.mamba_decode_cuda
ALL_SCHEDULE = sum(fused.SCHEDULE_BITS)


def _config(dtype="bfloat16", **overrides):
    """Small shapes that still take every path: several groups, a head's
    state over several threads, padded in_proj parts (8 heads of dt)."""
    fields = dict(num_layers=2, embed_dim=64, state_dim=16, head_dim=16, num_groups=2,
                  vocab_size=96, max_seq_len=64, dtype=dtype, decode_blocks="layers")
    return models.MambaConfig(**{**fields, **overrides})


def _model(config, mesh):
    with jax.set_mesh(mesh):
        return nnx.jit(lambda: models.Mamba2(config, rngs=nnx.Rngs(0)))()


def _with_blocks(model, decode_blocks, mesh):
    """The same parameters under another ``decode_blocks``."""
    twin = _model(dataclasses.replace(model.config, decode_blocks=decode_blocks), mesh)
    nnx.update(twin, nnx.state(model))
    return twin


def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _generate(model, mesh, prompt, new_tokens):
    with jax.set_mesh(mesh):
        return models.generate(model, prompt, new_tokens, return_logits=True)


@pytest.mark.parametrize("overrides", slow_unless(
    [dict(num_groups=2)],
    [dict(num_groups=2), dict(num_groups=1, head_dim=32, state_dim=32),
     dict(num_groups=4, conv_width=3)]))
def test_reference_follows_the_layers_in_float32(rng, monkeypatch, overrides):
    """Through prefill and 12 decode steps (batch 3, a prompt of 9): the
    kernel's layout and stages in JAX give the layers' logits and tokens.
    In float32, which only the reference runs (the kernel's bf16
    restriction lifted here), so that a layout slip shows above rounding."""
    monkeypatch.setattr(fused, "unsupported_reason", lambda config, **_: None)
    config = _config("float32", **overrides)
    mesh = cpu_mesh(1)
    layers = _model(config, mesh)
    fused_model = _with_blocks(layers, "cuda", mesh)
    prompt = rng.integers(0, config.vocab_size, (3, 9))
    want_tokens, want = _generate(layers, mesh, prompt, 12)
    got_tokens, got = _generate(fused_model, mesh, prompt, 12)
    assert _relative(got, want) < 1e-4
    np.testing.assert_array_equal(got_tokens, want_tokens)


def test_layout_is_the_models_in_proj_reordered(rng):
    """in_proj's items, untiled, are the model's columns in [x, B, C, dt, z]
    order with each part zero-padded to 16."""
    config = _config("float32", num_groups=2)
    model = _model(config, cpu_mesh(1))
    weights = fused.prepare_weights(model.blocks, config)
    at = fused.in_proj_layout(config)
    items = np.asarray(models.transformer_decode_weights.item_order(weights.in_proj[1]))
    got = items.transpose(1, 0, 2).reshape(config.embed_dim, -1)            # [d, columns]
    w = np.asarray(model.blocks[1].mixer.in_proj.kernel[...]).reshape(config.embed_dim, 2, -1)
    hpg, p, n = config.num_heads // 2, config.head_dim, config.state_dim
    z, x, b, c, dt = np.split(w, np.cumsum([hpg * p, hpg * p, n, n]), axis=-1)
    for name, part in (("x", x), ("b", b), ("c", c), ("dt", dt), ("z", z)):
        flat = part.reshape(config.embed_dim, -1)
        np.testing.assert_array_equal(got[:, at[name]:at[name] + flat.shape[1]], flat)
    assert got.shape[1] == at["columns"] and at["columns"] % 16 == 0
    np.testing.assert_array_equal(got[:, at["dt"] + config.num_heads:at["z"]], 0)


@pytest.mark.parametrize("overrides, batch, tensor, why", [
    (dict(dtype="float32"), 1, 1, "bfloat16"),
    ({}, 5, 1, "1 to 4 rows"),
    ({}, 1, 2, "tensor-parallel size 1"),
    (dict(head_dim=16, state_dim=24), 1, 1, "powers of two"),
    (dict(num_groups=2, num_layers=65), 1, 1, "at most 64 layers"),
])
def test_unsupported_steps_are_named(overrides, batch, tensor, why):
    config = _config(**{"dtype": "bfloat16", **overrides})
    reason = fused.unsupported_reason(config, tensor_size=tensor, batch=batch)
    assert reason is not None and why in reason


def test_cuda_blocks_where_the_kernel_cannot_run_raise_naming_why():
    config = _config("float32", decode_blocks="cuda")
    model = _model(config, cpu_mesh(1))
    with pytest.raises(ValueError, match="decode_blocks='layers'.*|bfloat16"):
        with jax.set_mesh(cpu_mesh(1)):
            models.generate(model, np.zeros((1, 4), np.int32), 2)


def test_a_build_without_the_kernel_is_an_error_on_cuda_gpus(monkeypatch):
    """On a CUDA GPU, a build without the kernel fails naming the fix (off
    GPUs the reference runs)."""
    monkeypatch.setattr(models.pallas_gpu, "build_info", lambda: {"ffi_targets": []})
    monkeypatch.setattr(models.pallas_gpu, "on_cuda", lambda: True)
    config = _config("bfloat16", num_layers=1)
    x = jnp.zeros((1, config.embed_dim), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=r"MambaConfig\(decode_blocks='cuda'\): the installed "
                                           r"jax_flashoverlap has no 'jfo_mamba_decode' kernel"):
        fused.decode_blocks(x, 0, None, (), config)


def test_the_trace_needs_the_kernel_on_a_cuda_gpu(monkeypatch):
    monkeypatch.setattr(fused, "on_cuda", lambda: False)
    with pytest.raises(RuntimeError,
                       match="mamba_decode_cuda.traced runs the kernel itself: it needs a CUDA"):
        fused.traced(None, 0, None, (), _config())


def _require_kernel():
    """conftest runs the gpu-marked tests only on a CUDA build with a GPU;
    this kernel must be in that build."""
    if fused.TARGET not in jax_flashoverlap.build_info()["ffi_targets"]:
        pytest.fail(f"{fused.TARGET} is not built")


def _states(rng, config, batch, pos):
    """Random states: the ring [k, b, c] with the rows of positions
    pos-k+1 .. pos-1 filled and NaN in pos's own row (the step writes it),
    the SSM state [b, g, H/g, p, n]."""
    k, g = config.conv_width, config.num_groups
    hpg, p, n = config.num_heads // g, config.head_dim, config.state_dim
    channels = g * (hpg * p + 2 * n)
    states = []
    for _ in range(config.num_layers):
        conv = rng.standard_normal((k, batch, channels)).astype(np.float32)
        conv[pos % k] = np.nan
        ssm = rng.standard_normal((batch, g, hpg, p, n)).astype(np.float32)
        states.append(models.mamba.SSMCache(jnp.asarray(conv, jnp.bfloat16), jnp.asarray(ssm)))
    return tuple(states)


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [
    dict(num_groups=2), dict(num_groups=1, head_dim=64, state_dim=128, embed_dim=256),
    dict(num_groups=4, conv_width=3)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("schedule", [0, ALL_SCHEDULE])
def test_kernel_matches_its_reference(rng, monkeypatch, overrides, batch, schedule):
    """One step of the kernel against the reference on the same bf16
    inputs, its output within twice the reference's own error against
    float32 and its states within bf16's tolerance; the ring's own row
    written, the others untouched. With the default schedule and with every
    choice of it on."""
    _require_kernel()
    monkeypatch.setattr(fused, "SCHEDULE", schedule)
    config = _config("bfloat16", **overrides)
    model = _model(config, jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                                             ("data", "tensor")))
    weights = jax.jit(lambda m: fused.prepare_weights(m.blocks, config))(model)
    pos = 13
    states = _states(rng, config, batch, pos)
    x = jnp.asarray(rng.standard_normal((batch, config.embed_dim)), jnp.bfloat16)
    want, want_states = jax.jit(lambda *a: fused.reference(*a, config=config))(
        x, jnp.int32(pos), weights, states)
    exact, _ = jax.jit(lambda *a: fused.reference(*a, config=dataclasses.replace(
        config, dtype="float32")))(x.astype(jnp.float32), jnp.int32(pos),
                                   jax.tree.map(lambda a: a.astype(jnp.float32), weights),
                                   jax.tree.map(lambda a: a.astype(jnp.float32), states))
    got, got_states = jax.jit(lambda *a: fused._ffi_decode(*a, config=config))(
        x, jnp.int32(pos), weights, states)
    assert _relative(got, exact) <= max(2 * _relative(want, exact), TOLERANCE["bfloat16"])
    for g, w, s in zip(got_states, want_states, states):
        np.testing.assert_allclose(np.asarray(g.ssm), np.asarray(w.ssm), rtol=2e-2, atol=2e-2)
        ring, old = np.asarray(g.conv, np.float32), np.asarray(s.conv, np.float32)
        np.testing.assert_array_equal(np.delete(ring, pos % config.conv_width, 0),
                                      np.delete(old, pos % config.conv_width, 0))
        np.testing.assert_allclose(ring[pos % config.conv_width],
                                   np.asarray(w.conv, np.float32)[pos % config.conv_width],
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [*fused.SCHEDULE_BITS, ALL_SCHEDULE])
def test_a_schedule_moves_work_and_loads_but_not_a_bit(rng, monkeypatch, schedule):
    """Each schedule choice changes which CTA runs an item and when its loads
    are issued, never its arithmetic: the step's output and states are
    schedule 0's, bit for bit."""
    _require_kernel()
    config = _config("bfloat16", num_groups=2, conv_width=3)
    model = _model(config, jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                                             ("data", "tensor")))
    weights = jax.jit(lambda m: fused.prepare_weights(m.blocks, config))(model)
    states = _states(rng, config, 3, 21)
    x = jnp.asarray(rng.standard_normal((3, config.embed_dim)), jnp.bfloat16)
    results = []
    for chosen in (0, schedule):
        monkeypatch.setattr(fused, "SCHEDULE", chosen)
        results.append(jax.jit(lambda *a: fused._ffi_decode(*a, config=config))(
            x, jnp.int32(21), weights, states))
    (want, want_states), (got, got_states) = results
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for g, w in zip(got_states, want_states):
        np.testing.assert_array_equal(np.asarray(g.ssm), np.asarray(w.ssm))
        np.testing.assert_array_equal(np.asarray(g.conv, np.float32),
                                      np.asarray(w.conv, np.float32))


@pytest.mark.gpu
def test_trace_times_every_stage_in_order_and_changes_nothing(rng):
    """A traced step's output and states are the untraced step's, bit for
    bit, and each CTA passes its layer's points in order, layer after layer."""
    _require_kernel()
    config = _config("bfloat16", num_groups=1, head_dim=64, state_dim=128, embed_dim=256)
    model = _model(config, jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                                             ("data", "tensor")))
    weights = jax.jit(lambda m: fused.prepare_weights(m.blocks, config))(model)
    states = _states(rng, config, 2, 9)
    x = jnp.asarray(rng.standard_normal((2, config.embed_dim)), jnp.bfloat16)
    want, want_states = jax.jit(lambda *a: fused._ffi_decode(*a, config=config))(
        x, jnp.int32(9), weights, states)
    got, got_states, words = jax.jit(lambda *a: fused.traced(*a, config))(
        x, jnp.int32(9), weights, states)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for g, w in zip(got_states, want_states):
        np.testing.assert_array_equal(np.asarray(g.ssm), np.asarray(w.ssm))
        np.testing.assert_array_equal(np.asarray(g.conv, np.float32),
                                      np.asarray(w.conv, np.float32))
    words = np.asarray(words, np.int64)
    clocks = words[..., 0] + (words[..., 1] << 32)            # [L, 256, row]
    grid = int((clocks[0, :, 0] > 0).sum())                  # the CTAs come first
    assert grid >= 2 * config.num_heads and (clocks[:, grid:] == 0).all()
    names = fused.TRACE_EVENTS
    order = [names.index(e) for e in ("layer_start", "normed", "in_proj_done", "mixer_done",
                                      "gated_normed", "out_proj_done")]
    passed = clocks[:, :grid][..., order]                      # [L, grid, points]
    assert (passed > 0).all()
    assert (np.diff(passed, axis=-1) >= 0).all()
    assert (passed[1:, :, 0] >= passed[:-1, :, -1]).all()
    ready = clocks[:, :grid, names.index("mixer_ready")]
    assert ((ready > 0).sum(axis=1) == 2 * config.num_heads).all()  # a CTA per mixer item


@pytest.mark.gpu
def test_generation_through_the_kernel_follows_the_layers(rng):
    """bf16 generation (batch 2, prompt 11, 24 new tokens): the kernel's
    logits within twice the layers' own bf16 error against the float32
    model, through prefill and the decode loop."""
    _require_kernel()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    config = _config("bfloat16", num_layers=3, num_groups=1, head_dim=64, state_dim=128,
                     embed_dim=256)
    layers = _model(config, mesh)
    exact_model = _model(dataclasses.replace(config, dtype="float32"), mesh)
    nnx.update(exact_model, nnx.state(layers))
    prompt = rng.integers(0, config.vocab_size, (2, 11))
    want_tokens, want = _generate(layers, mesh, prompt, 24)
    tokens, got = _generate(_with_blocks(layers, "cuda", mesh), mesh, prompt, 24)

    def exact(t):  # the float32 model's logits at the new tokens' positions
        with jax.set_mesh(mesh):
            return exact_model(jnp.asarray(t[:, :-1]))[:, prompt.shape[1] - 1:]

    assert _relative(got, exact(tokens)) <= max(2 * _relative(want, exact(want_tokens)),
                                                TOLERANCE["bfloat16"])
