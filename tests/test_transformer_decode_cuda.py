"""All blocks of a Transformer decode step as one CUDA kernel
(models.transformer_decode_cuda): its JAX reference against the model's own
decode on CPU, the kernel against both on a GPU."""

import dataclasses
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import TOLERANCE, cpu_mesh, random, slow_unless

import jax_flashoverlap
from jax_flashoverlap import models
from jax_flashoverlap.nn import shard_map_apply

fused = models.transformer_decode_cuda
layout = models.transformer_decode_weights
# Llama 3.1's frequency stretch, at a short original context so that the
# tests' positions reach past it.
SCALED = models.RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position=32)


def _config(dtype, head_dim=64, heads=4, kv_heads=2, layers=2, **overrides):
    return models.TransformerConfig(num_layers=layers, embed_dim=128, num_heads=heads,
                                    num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=256,
                                    dtype=dtype, max_seq_len=256, decode_attention="model",
                                    **{"decode_blocks": "layers", **overrides})


def _model(config, mesh):
    return _model_of(models.Transformer, config, mesh)


def _model_of(cls, config, mesh):
    with jax.set_mesh(mesh):
        return nnx.jit(lambda: cls(config, rngs=nnx.Rngs(0)))()


def _caches(rng, config, batch, length, pos, dtype, poison=np.nan):
    """Random caches [b, kv, length, h] per layer, ``poison`` from ``pos`` on
    (never read: the step writes ``pos``)."""
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    caches = []
    for _ in range(config.num_layers):
        pair = []
        for _ in range(2):
            c = np.array(random(rng, shape, jnp.float32))
            c[:, :, pos:] = poison
            pair.append(jnp.asarray(c, dtype))
        caches.append(models.transformer.KVCache(*pair))
    return tuple(caches)


def _step(model, mesh, token, caches, pos, weights=None):
    """decode_step under shard_map: (float32 logits [b, v], caches)."""
    spec = model.cache_specs()
    extra, extra_specs = ((weights,), (model.decode_weights_specs(),)) if weights else ((), ())
    with jax.set_mesh(mesh):
        return jax.jit(lambda m, t, c, p, *w: shard_map_apply(
            type(m).decode_step, m, t, c, p, *w,
            in_specs=(jax.sharding.PartitionSpec("data"), spec, jax.sharding.PartitionSpec(),
                      *extra_specs),
            out_specs=(jax.sharding.PartitionSpec("data", None), spec)))(
                model, token, caches, jnp.int32(pos), *extra)


def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bf16_bound(want, exact):
    """How far (``_relative``) a bf16 result may stray from the float32
    ``exact``: twice the bf16 reference ``want``'s own error, at least bf16's
    tolerance."""
    return max(2 * _relative(want, exact), TOLERANCE["bfloat16"])


@pytest.mark.parametrize("head_dim, heads, kv_heads, rope_scaling", slow_unless(
    [(128, 4, 1, None), (64, 4, 2, SCALED)],
    [(64, 4, 2, None), (128, 4, 1, None), (64, 2, 2, None), (64, 4, 2, SCALED)]))
def test_reference_matches_the_models_decode_in_float32(rng, head_dim, heads, kv_heads,
                                                        rope_scaling):
    """The kernel's layout and stages, in JAX, against each block's own decode."""
    config = _config("float32", head_dim, heads, kv_heads, rope_scaling=rope_scaling)
    mesh = cpu_mesh(1)
    model = _model(config, mesh)
    batch, length, pos = 3, 24, 17
    token = jnp.asarray(rng.integers(0, config.vocab_size, batch), jnp.int32)
    # Finite poison: the model's XLA attention multiplies what lies past pos
    # by a zero weight (NaN would stay NaN).
    caches = _caches(rng, config, batch, length, pos, jnp.float32, poison=1e4)
    with jax.set_mesh(mesh):
        weights = jax.jit(lambda m: fused.prepare_weights(m.blocks, config))(model)
    want, want_caches = _step(model, mesh, token, caches, pos)
    got, got_caches = _step(model, mesh, token, caches, pos, weights)
    assert _relative(got, want) < 1e-5
    for got_cache, want_cache in zip(got_caches, want_caches):
        for g, w in zip(got_cache, want_cache):
            g, w = np.asarray(g), np.asarray(w)
            np.testing.assert_array_equal(g[:, :, pos + 1:], w[:, :, pos + 1:])
            np.testing.assert_allclose(g[:, :, :pos + 1], w[:, :, :pos + 1], rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.parametrize("tp, dp", slow_unless([(2, 2)], [(2, 1), (4, 1), (2, 2)]))
def test_reference_splits_over_the_tensor_axis_as_the_layers(rng, tp, dp):
    """Each rank's shard of the layout is the layout of its own weights, and
    the reference, per rank with its partials summed over the tensor axis,
    follows each block's own tensor-parallel decode in float32."""
    config = _config("float32", 64, heads=8, kv_heads=4)
    mesh = cpu_mesh(tp, dp)
    model = _model(config, mesh)
    batch, length, pos = 2 * dp, 24, 17
    token = jnp.asarray(rng.integers(0, config.vocab_size, batch), jnp.int32)
    caches = _caches(rng, config, batch, length, pos, jnp.float32, poison=1e4)
    with jax.set_mesh(mesh):
        sharded = jax.jit(lambda m: shard_map_apply(
            lambda m: fused.prepare_weights(m.blocks, config), m, in_specs=(),
            out_specs=fused.weight_specs(config)))(model)
    with jax.set_mesh(cpu_mesh(1)):
        whole = jax.jit(lambda m: fused.prepare_weights(m.blocks, config))(
            _model(config, cpu_mesh(1)))
    for got, want in zip(sharded, whole):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # rank_shards (the one-GPU emulation's operands) cuts as the specs do.
    stacked, stacked_caches = fused.rank_shards(whole, caches, tp)
    for field in ("qkv", "out", "gate_up", "down"):
        for shard in getattr(sharded, field).addressable_shards:
            rank = int(np.argwhere(mesh.devices == shard.device)[0][1])
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          np.asarray(getattr(stacked, field)[rank]))
    np.testing.assert_array_equal(np.asarray(stacked_caches[0].k[1]),
                                  np.asarray(caches[0].k)[:, 4 // tp:2 * 4 // tp])
    want, want_caches = _step(model, mesh, token, caches, pos)
    got, got_caches = _step(model, mesh, token, caches, pos, sharded)
    assert _relative(got, want) < 1e-5
    for got_cache, want_cache in zip(got_caches, want_caches):
        for g, w in zip(got_cache, want_cache):
            np.testing.assert_allclose(np.asarray(g)[:, :, :pos + 1],
                                       np.asarray(w)[:, :, :pos + 1], rtol=1e-5, atol=1e-5)


def test_prepared_layout_inverts_to_the_models_weights(rng):
    """Item i of the QKV layout holds channels j0..j0+15 of its head's two halves."""
    w = jnp.asarray(rng.standard_normal((128, 2 * (2 + 2) * 64)), jnp.float32)
    items = np.asarray(layout._qkv_items(w, 4, 64))        # [2 * 4 * 2, 128, 32]
    w = np.asarray(w).reshape(128, 2, 4, 64)                # [d, kv, role, h]
    for item in range(items.shape[0]):
        g, role, block = item // 8, item % 8 // 2, item % 2
        j0 = 16 * block
        np.testing.assert_array_equal(items[item, :, :16], w[:, g, role, j0:j0 + 16])
        np.testing.assert_array_equal(items[item, :, 16:], w[:, g, role, 32 + j0:32 + j0 + 16])


def test_items_are_stored_as_the_tensor_cores_fragments(rng):
    """Lane l = 4 g + t of 16x16 tile (kt, ct) holds, in order, the item's
    [k, column] at (2t, g), (2t+1, g), (2t, g+8), (2t+1, g+8), then the same
    at k + 8: mma.m16n8k16's A fragment for the tile transposed (PTX ISA).
    Tiles run k-tile major, so a chunk of rows is a run of whole tiles."""
    items = rng.standard_normal((3, 48, 32)).astype(np.float32)   # 3 k-tiles x 2 column tiles
    stored = np.asarray(layout._fragment_order(jnp.asarray(items))).reshape(3, 3, 2, 32, 8)
    for kt in range(3):
        for ct in range(2):
            for lane in range(32):
                g, t = divmod(lane, 4)
                k, c = 16 * kt + 2 * t, 16 * ct + g
                want = [items[1, k + 8 * half + pair, c + 8 * col]
                        for half in (0, 1) for col in (0, 1) for pair in (0, 1)]
                np.testing.assert_array_equal(stored[1, kt, ct, lane], want)
    np.testing.assert_array_equal(np.asarray(layout.item_order(jnp.asarray(stored.reshape(
        3, 48, 32)))), items)


@pytest.mark.parametrize("overrides, batch, tp, message", [
    ({}, 2, 2, r"it runs at tensor-parallel size 1 \(the mesh's is 2\)"),
    ({"dtype": "float32"}, 2, 1, "it computes in bfloat16"),
    ({}, 8, 1, r"it takes 1 to 4 rows per device \(got 8\)"),
    ({"head_dim": 32}, 2, 1, r"it takes head_dim in \(64, 128\) \(got 32\)"),
], ids=["tensor-2", "float32", "batch-8", "head-dim-32"])
def test_unsupported_steps_get_a_clear_error(overrides, batch, tp, message):
    config = _config(overrides.pop("dtype", "bfloat16"), decode_blocks="cuda", **overrides)
    mesh = cpu_mesh(tp)
    model = _model(config, mesh)
    prompt = np.zeros((batch, 4), np.int32)
    with jax.set_mesh(mesh), pytest.raises(
            ValueError, match=r"decode_blocks='cuda'\): the decode kernel cannot run this step: "
                              + message):
        models.generate(model, prompt, 2)


def _gpu(capability="9.0", free=2**34):
    """A stand-in for a CUDA jax.Device: what decode_blocks="auto" asks of one."""
    return types.SimpleNamespace(
        platform="gpu", client=types.SimpleNamespace(platform_version="cuda 13.0"),
        compute_capability=capability,
        memory_stats=lambda: {"bytes_limit": free + 2**30, "bytes_in_use": 2**30})


@pytest.mark.parametrize("overrides, batch, tp, device, weight_bytes, want", [
    ({}, 1, 1, _gpu(), 2**20, "cuda"),
    ({}, fused.AUTO_MAX_BATCH, 1, _gpu(), 2**20, "cuda"),
    ({}, fused.AUTO_MAX_BATCH + 1, 1, _gpu(), 2**20, "layers"),
    ({}, 1, 2, _gpu(), 2**20, "layers"),
    ({"dtype": "float32"}, 1, 1, _gpu(), 2**20, "layers"),
    ({"head_dim": 32}, 1, 1, _gpu(), 2**20, "layers"),
    ({}, 1, 1, _gpu("8.0"), 2**20, "layers"),
    ({}, 1, 1, _gpu(free=2**21), 2**20, "cuda"),
    ({}, 1, 1, _gpu(free=2**21), 2**20 + 1, "layers"),
    ({}, 1, 1, jax.devices("cpu")[0], 2**20, "layers"),
    ({"decode_blocks": "layers"}, 1, 1, _gpu(), 2**20, "layers"),
    ({"decode_blocks": "cuda"}, 4, 1, _gpu("8.0", 1), 2**40, "cuda"),
], ids=["hopper-batch-1", "hopper-auto-batch", "batch-past-auto", "tensor-2", "float32",
        "head-dim-32", "ampere", "copy-half-the-free-memory", "copy-past-half", "cpu", "layers",
        "cuda"])
def test_auto_runs_the_kernel_where_it_runs_and_was_faster(overrides, batch, tp, device,
                                                           weight_bytes, want):
    """decode_blocks="auto" (the default): the kernel on Hopper GPUs up to
    fused.AUTO_MAX_BATCH rows where it runs and its copy of the weights fits
    in half the free memory; "layers" and "cuda" as asked."""
    config = _config(overrides.pop("dtype", "bfloat16"), **{"decode_blocks": "auto",
                                                            **overrides})
    assert models.decode_blocks_implementation(
        config, batch=batch, tensor_size=tp, weight_bytes=weight_bytes, device=device) == want


def test_auto_decodes_layer_by_layer_off_gpus(rng):
    """The default config on CPU prepares nothing: each layer decodes on its own."""
    config = models.TransformerConfig(num_layers=1, embed_dim=128, num_heads=4, num_kv_heads=2,
                                      head_dim=64, mlp_dim=256, dtype="bfloat16")
    assert config.decode_blocks == "auto"
    mesh = cpu_mesh(1)
    model = _model(config, mesh)
    with jax.set_mesh(mesh):
        generator = models.Generator(model, batch=1, prompt_len=4, max_new_tokens=2)
    assert generator.decode_weights is None


class _LayersOnly(models.Mamba2):
    """A model whose layers decode on their own: CausalLM's defaults."""

    decode_weights_specs = models.CausalLM.decode_weights_specs
    _decode_layers_with = models.CausalLM._decode_layers_with


def test_only_a_model_with_decode_weights_takes_them():
    """A model without a decode kernel (CausalLM's defaults): weights given
    to its step, or their specs asked for, are an error naming the model."""
    model = _model_of(_LayersOnly, models.MambaConfig.preset("tiny"), cpu_mesh(1))
    with pytest.raises(NotImplementedError, match="_LayersOnly has no decode_weights"):
        model.decode_step(jnp.zeros((1,), jnp.int32), (), jnp.int32(0), weights=object())
    with pytest.raises(NotImplementedError, match="_LayersOnly has no decode_weights"):
        model.decode_weights_specs()


def test_a_build_without_the_kernel_is_an_error_on_cuda_gpus(monkeypatch):
    """On a CUDA GPU, a build without the kernel fails naming the fix (off
    GPUs the reference runs)."""
    monkeypatch.setattr(models.pallas_gpu, "build_info", lambda: {"ffi_targets": []})
    monkeypatch.setattr(models.pallas_gpu, "on_cuda", lambda: True)
    config = _config("bfloat16", layers=1)
    x = jnp.zeros((1, config.embed_dim), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=r"the installed jax_flashoverlap has no "
                                           r"'jfo_transformer_decode' kernel"):
        fused.decode_blocks(x, 0, None, (), config)


def test_generate_with_the_kernels_blocks_follows_the_layers(rng):
    """bf16 generation with decode_blocks="cuda" (the reference off GPUs, the
    kernel on them): logits within bf16 rounding of the layers' decode."""
    config = _config("bfloat16", head_dim=128 if jax.default_backend() == "gpu" else 64)
    mesh = cpu_mesh(1) if jax.default_backend() == "cpu" else jax.make_mesh(
        (1, 1), ("data", "tensor"), devices=jax.devices()[:1])
    layers = _model(config, mesh)
    blocks = _model(dataclasses.replace(config, decode_blocks="cuda"), mesh)
    prompt = rng.integers(0, config.vocab_size, (2, 6)).astype(np.int32)
    with jax.set_mesh(mesh):
        _, want = models.generate(layers, prompt, 1, return_logits=True)
        tokens, got = models.generate(blocks, prompt, 8, return_logits=True)
        # Teacher-forced: the model's forward over the tokens the kernel chose.
        forward = nnx.jit(lambda m, t: m(t))(layers, tokens[:, :-1])
    forward = np.asarray(forward, np.float64)[:, -8:]
    np.testing.assert_array_equal(np.asarray(got)[:, 0], np.asarray(want)[:, 0])  # prefill
    assert _relative(got, forward) < 4 * TOLERANCE["bfloat16"]


@pytest.mark.parametrize("tp", slow_unless([2], [2, 4]))
def test_generate_at_tensor_parallel_sizes_follows_the_layers(rng, monkeypatch, tp):
    """bf16 generation with the kernel's experimental tensor-parallel form
    (its reference on CPU): logits within bf16 rounding of the layers'
    tensor-parallel decode; "auto" keeps the layers there."""
    monkeypatch.setattr(fused, "TENSOR_PARALLEL", True)
    config = _config("bfloat16", heads=8, kv_heads=4)
    mesh = cpu_mesh(tp)
    layers = _model(config, mesh)
    assert models.decode_blocks_implementation(
        dataclasses.replace(config, decode_blocks="auto"), batch=2, tensor_size=tp,
        device=_gpu()) == "layers"
    blocks = _model(dataclasses.replace(config, decode_blocks="cuda"), mesh)
    # 12 positions in the forward pass: sequence parallelism splits them.
    prompt = rng.integers(0, config.vocab_size, (2, 5)).astype(np.int32)
    with jax.set_mesh(mesh):
        tokens, got = models.generate(blocks, prompt, 8, return_logits=True)
        forward = nnx.jit(lambda m, t: m(t))(layers, tokens[:, :-1])
    forward = np.asarray(forward, np.float64)[:, -8:]
    assert _relative(got, forward) < 4 * TOLERANCE["bfloat16"]


@pytest.mark.parametrize("tp, dp", slow_unless([(2, 2)], [(2, 1), (4, 1), (2, 2)]))
def test_tensor_ranks_lower_with_their_groups(rng, tp, dp):
    """Lowered for CUDA (here, on CPU devices): one kernel call a step,
    each rank with its heads, KV heads and MLP units, and the CUDA ordinals
    of every tensor group by rank, from which it finds its peers."""
    if fused.TARGET not in jax_flashoverlap.build_info()["ffi_targets"]:
        pytest.skip("a build without CUDA runs the reference on every platform")
    config = _config("bfloat16", 128, heads=8, kv_heads=4)
    # Devices in reverse: a rank is not its device's number.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:tp * dp][::-1]).reshape(dp, tp),
                             ("data", "tensor"))
    model = _model(config, mesh)
    caches = _caches(rng, config, 2 * dp, 64, 10, jnp.bfloat16)
    spec, specs = model.cache_specs(), fused.weight_specs(config)
    with jax.set_mesh(mesh):
        weights = jax.jit(lambda m: shard_map_apply(
            lambda m: fused.prepare_weights(m.blocks, config), m, in_specs=(),
            out_specs=specs))(model)
        step = jax.jit(lambda m, t, c, w: shard_map_apply(
            type(m).decode_step, m, t, c, jnp.int32(10), w,
            in_specs=(jax.sharding.PartitionSpec("data"), spec, jax.sharding.PartitionSpec(),
                      specs),
            out_specs=(jax.sharding.PartitionSpec("data", None), spec)))
        text = step.trace(model, jnp.zeros((2 * dp,), jnp.int32), caches, weights).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @jfo_transformer_decode" in line]
    assert len(calls) == 1, calls
    want = ", ".join(str(d.local_hardware_id) for row in np.asarray(mesh.devices) for d in row)
    assert want.startswith(str(tp * dp - 1)), want
    for attribute in (rf"\bheads = {8 // tp} : i32", rf"\bkv_heads = {4 // tp} : i32",
                      rf"\bn = {tp} : i32", r"\bemulated_ranks = 1 : i32",
                      rf"\bgroup_ordinals = dense<\[{want}\]>"):
        assert re.search(attribute, calls[0]), (attribute, calls[0])
    # Every cache updated in place: 2 per layer.
    assert calls[0].count("#stablehlo.output_operand_alias") == 2 * config.num_layers


@pytest.mark.gpu
@pytest.mark.parametrize("options", [0, fused.ALL_OPTIONS])
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("head_dim, heads, kv_heads, rope_scaling", [
    (128, 4, 2, None), (64, 8, 2, None), (128, 2, 2, None), (64, 8, 2, SCALED)])
def test_kernel_matches_the_reference(rng, monkeypatch, options, batch, head_dim, heads,
                                      kv_heads, rope_scaling):
    """One step of the kernel against the reference in float32 and in bf16, at
    positions 0, mid-cache and the cache's last; the cache past the position
    is NaN (never read) and stays so, the new position is written. With and
    without the kernel's optional paths (fused.OPTIONS), and with Llama 3.1's
    rope scaling."""
    monkeypatch.setattr(fused, "OPTIONS", options)
    config = _config("bfloat16", head_dim, heads, kv_heads, layers=3, rope_scaling=rope_scaling)
    mesh, weights, whole = _prepared_on_one_device(config)
    length = 300
    for pos in (0, 137, length - 1):
        with jax.set_mesh(mesh):
            got, got_caches, want, want_caches, exact = _kernel_and_references(
                rng, config, batch, length, pos, weights, whole)
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        bound = _bf16_bound(want, exact)
        assert _relative(got, exact) <= bound, (pos, _relative(got, exact), bound)
        for got_cache, want_cache in zip(got_caches, want_caches):
            for g, w in zip(got_cache, want_cache):
                g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
                np.testing.assert_array_equal(np.isnan(g[:, :, pos + 1:]), True)
                np.testing.assert_array_equal(g[:, :, :pos], w[:, :, :pos])
                np.testing.assert_allclose(g[:, :, pos], w[:, :, pos], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("ring_slots", [2, 3])
def test_a_short_ring_matches_the_reference(rng, monkeypatch, ring_slots):
    """With 2 or 3 weight slots (fused.RING_SLOTS) the slots are refilled
    several times a launch: the step still matches the float32 reference."""
    monkeypatch.setattr(fused, "RING_SLOTS", ring_slots)
    config = _config("bfloat16", 128, 4, 2, layers=3)
    mesh, weights, whole = _prepared_on_one_device(config)
    with jax.set_mesh(mesh):
        got, _, want, _, exact = _kernel_and_references(rng, config, 2, 300, 137, weights, whole)
    assert _relative(got, exact) <= _bf16_bound(want, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("ring_slots", [1, 17])
def test_a_ring_that_cannot_be_is_an_error(rng, monkeypatch, ring_slots):
    """One slot (no copy ahead), or more than fit in shared memory, is refused."""
    monkeypatch.setattr(fused, "RING_SLOTS", ring_slots)
    config = _config("bfloat16", 128, 4, 2, layers=1)
    mesh, weights, whole = _prepared_on_one_device(config)
    with jax.set_mesh(mesh), pytest.raises(
            jax.errors.JaxRuntimeError, match=r"ring_slots must be 0 \(as many as fit\) or 2 to"):
        jax.block_until_ready(_kernel_and_references(rng, config, 1, 64, 5, weights, whole))


def _prepared_on_one_device(config):
    """A model's blocks on one GPU: the mesh, their weights in the kernel's
    layout, and the sharding that keeps an array whole on it."""
    mesh = jax.make_mesh((1, 1), ("data", "tensor"), devices=jax.devices()[:1])
    model = _model(config, mesh)
    with jax.set_mesh(mesh):
        weights = jax.jit(lambda m: fused.prepare_weights(m.blocks, config))(model)
    return mesh, weights, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _kernel_and_references(rng, config, batch, length, pos, weights, whole):
    """One step of decode_blocks, of the reference, and of the reference in
    float32, on fresh x and caches (every array whole on the weights' mesh)."""
    x = jax.device_put(random(rng, (batch, config.embed_dim), jnp.bfloat16), whole)
    caches = jax.device_put(_caches(rng, config, batch, length, pos, jnp.bfloat16), whole)
    pos = jnp.int32(pos)
    got, got_caches = jax.jit(lambda *a: fused.decode_blocks(*a, config))(
        x, pos, weights, caches)
    want, want_caches = jax.jit(lambda *a: fused.reference(*a, config=config))(
        x, pos, weights, caches)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                       (x, weights, caches))
    exact_config = dataclasses.replace(config, dtype="float32")
    exact, _ = jax.jit(lambda *a: fused.reference(*a, config=exact_config))(
        f32[0], pos, f32[1], f32[2])
    return got, got_caches, want, want_caches, exact


# The tensor ranks' tests last: a wait inside a GPU that times out traps
# (a wait for another rank ends in NaN instead), and a trap ends the CUDA
# context for every test after it in the process.


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("CUDA_LAUNCH_BLOCKING") == "1",
                    reason="emulated ranks must run side by side")
@pytest.mark.parametrize("ranks, batch, head_dim, width", [
    (2, 1, 128, 128), (4, 3, 128, 128), (2, 4, 64, 2048), (4, 1, 128, 2048)])
def test_emulated_tensor_ranks_match_the_reference(rng, monkeypatch, ranks, batch, head_dim,
                                                   width):
    """The kernel's exchange between tensor ranks, on one GPU: each rank a
    launch on its share of the SMs. Three steps in a row (both parities of
    the receive areas, one of them twice): every rank's output is the same,
    within bf16 rounding of the float32 reference, and each step's k and v
    rows land in the rank's KV heads. At width 2048, out and down have 128
    items, more than a rank's CTAs: a CTA exchanges several in turn. A
    wrong exchange ends in NaN after 2 s."""
    monkeypatch.setenv("JAX_FLASHOVERLAP_TIMEOUT_MS", "2000")
    config = dataclasses.replace(_config("bfloat16", head_dim, heads=8, kv_heads=4, layers=3),
                                 embed_dim=width, mlp_dim=2 * width)
    mesh, weights, whole = _prepared_on_one_device(config)
    length, pos = 64, 37
    caches = jax.device_put(_caches(rng, config, batch, length, pos, jnp.bfloat16), whole)
    emulate = jax.jit(lambda *a: fused.emulate_tensor_ranks(*a, config, ranks))
    exact_config = dataclasses.replace(config, dtype="float32")
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                       (weights, caches))
    for step in range(3):
        x = jax.device_put(random(rng, (batch, config.embed_dim), jnp.bfloat16), whole)
        with jax.set_mesh(mesh):
            got, got_caches = emulate(x, jnp.int32(pos + step), weights, caches)
            want, want_caches = jax.jit(lambda *a: fused.reference(*a, config=config))(
                x, jnp.int32(pos + step), weights, caches)
            exact, exact_caches = jax.jit(lambda *a: fused.reference(*a, config=exact_config))(
                x.astype(jnp.float32), jnp.int32(pos + step), *f32)
        got = np.asarray(got, np.float32)
        for rank in range(1, ranks):
            np.testing.assert_array_equal(got[rank], got[0])
        bound = _bf16_bound(want, exact)
        assert _relative(got[0], exact) <= bound, (step, _relative(got[0], exact), bound)
        at = pos + step
        # The new rows as the output: within twice the bf16 reference's own
        # error of float32. Not element by element: the ranks sum partials
        # rounded to bf16 each, so a later layer's k and v stray from the
        # bf16 reference's by a few of its roundings, ~0.02 where a dot cancels.
        for caches_of_layer in zip(got_caches, want_caches, exact_caches, caches):
            for g, w, e, o in zip(*caches_of_layer):
                g, w, e, o = (np.asarray(t, np.float32) for t in (g, w, e, o))
                np.testing.assert_array_equal(g[:, :, :at], o[:, :, :at])
                row_bound = _bf16_bound(w[:, :, at], e[:, :, at])
                assert _relative(g[:, :, at], e[:, :, at]) <= row_bound, (step, row_bound)
                np.testing.assert_array_equal(np.isnan(g[:, :, at + 1:]), True)
        caches = got_caches
        f32 = (f32[0], jax.tree.map(lambda a: a.astype(jnp.float32), caches))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("CUDA_LAUNCH_BLOCKING") == "1",
                    reason="emulated ranks must run side by side")
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_that_starts_too_late_makes_the_step_nan_and_an_error(rng, monkeypatch, ranks):
    """The last emulated rank starts 1 s late (an injected stall), after its
    peers' 200 ms bound: the step still ends, with NaN in every rank's
    output; check_device_errors() names the rank that waited and the one it
    waited for; the next step fails on the host; after reset() a fresh step
    is right again."""
    monkeypatch.setenv("JAX_FLASHOVERLAP_TIMEOUT_MS", "200")
    config = _config("bfloat16", 128, heads=8, kv_heads=4)
    mesh, weights, whole = _prepared_on_one_device(config)
    batch, length, pos = 2, 64, 37
    caches = jax.device_put(_caches(rng, config, batch, length, pos, jnp.bfloat16), whole)
    x = jax.device_put(random(rng, (batch, config.embed_dim), jnp.bfloat16), whole)

    def step():  # a fresh program: XLA does not run one again after it failed
        with jax.set_mesh(mesh):
            emulate = jax.jit(lambda *a: fused.emulate_tensor_ranks(*a, config, ranks))
            return emulate(x, jnp.int32(pos), weights, caches)[0]

    jax_flashoverlap.reset()
    jax_flashoverlap.faults.inject_fault("stall", device=jax.devices()[0], stall_ms=1000)
    assert np.isnan(np.asarray(step(), np.float32)).all()
    with pytest.raises(RuntimeError, match=rf"tensor rank \d \(CUDA device 0\) timed out in "
                                           rf"layer 0 waiting for tensor rank {ranks - 1}'s "
                                           rf"partial sums"):
        jax_flashoverlap.check_device_errors()
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="every step of the group fails until jax_flashoverlap.reset"):
        np.asarray(step())
    jax_flashoverlap.reset()
    jax_flashoverlap.check_device_errors()  # nothing left to report
    got = np.asarray(step(), np.float32)
    with jax.set_mesh(mesh):
        want = jax.jit(lambda *a: fused.reference(*a, config=config))(
            x, jnp.int32(pos), weights, caches)[0]
    for rank in range(ranks):
        np.testing.assert_array_equal(got[rank], got[0])
    assert _relative(got[0], want) < 4 * TOLERANCE["bfloat16"]


@pytest.mark.parametrize("layout", [
    pytest.param("in_order", marks=pytest.mark.gpus(2)),
    pytest.param("reversed", marks=pytest.mark.gpus(2)),
    pytest.param("data_x_tensor", marks=pytest.mark.gpus(4))])
def test_generate_on_tensor_ranks_follows_the_layers(rng, monkeypatch, layout):
    """The kernel's tensor-parallel form on GPUs of one process (its
    experimental TENSOR_PARALLEL): bf16 logits within bf16 rounding of the
    model's forward pass over the tokens it chose (test_emulated_tensor_ranks_
    match_the_reference checks that the ranks' outputs agree). With the
    devices reversed a rank is not its GPU's number; on 2 x 2 each GPU finds
    its own group of two. A wrong exchange ends in NaN after 2 s."""
    monkeypatch.setattr(fused, "TENSOR_PARALLEL", True)
    monkeypatch.setenv("JAX_FLASHOVERLAP_TIMEOUT_MS", "2000")
    config = _config("bfloat16", 128, heads=8, kv_heads=4)
    devices = np.asarray(jax.devices()[:4 if layout == "data_x_tensor" else 2])
    if layout == "reversed":
        devices = devices[::-1]
    mesh = jax.sharding.Mesh(devices.reshape(-1, 2), ("data", "tensor"))
    layers = _model(config, mesh)
    blocks = _model(dataclasses.replace(config, decode_blocks="cuda"), mesh)
    prompt = rng.integers(0, config.vocab_size, (2 * mesh.shape["data"], 5)).astype(np.int32)
    with jax.set_mesh(mesh):
        tokens, got = models.generate(blocks, prompt, 8, return_logits=True)
        forward = nnx.jit(lambda m, t: m(t))(layers, tokens[:, :-1])
    forward = np.asarray(forward, np.float64)[:, -8:]
    assert np.all(np.isfinite(np.asarray(got)))
    assert _relative(got, forward) < 4 * TOLERANCE["bfloat16"]
