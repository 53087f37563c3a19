"""Llama checkpoints in the Hugging Face layout (models/pretrained.py), on CPU."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax_flashoverlap.models import Transformer, TransformerConfig, generate
from jax_flashoverlap.models.config import RopeScaling
from jax_flashoverlap.models.decoding import decoding_params
from jax_flashoverlap.models.layers import rope_frequencies
from jax_flashoverlap.models.pretrained import from_pretrained, llama_config, save_pretrained
from model_support import (
    check_bfloat16_decode,
    check_matches_transformers,
    fine_tune_checkpoint,
    logits_of,
    params_of,
)
from support import cpu_mesh, slow_unless, with_word_tokenizer

# Odd sizes; GQA with 2 query heads per key/value head.
CONFIG = TransformerConfig(vocab_size=97, num_layers=2, embed_dim=48, num_heads=8,
                           num_kv_heads=4, head_dim=12, mlp_dim=40, max_seq_len=64,
                           attention_impl="xla", impl="xla", norm_eps=1e-6)


@pytest.fixture
def tokens(rng):
    return jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 16)), jnp.int32)


# Untied is slow: the default reads an untied head in
# test_logits_and_greedy_tokens_match_transformers[gqa_untied-2].
@pytest.mark.parametrize("config", [
    pytest.param(CONFIG, marks=pytest.mark.slow),
    dataclasses.replace(CONFIG, tie_embeddings=True, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32)),
], ids=["untied", "tied-llama3-rope"])
def test_a_saved_model_loads_back_exactly_at_every_tensor_size(tmp_path, tokens, config):
    with jax.set_mesh(cpu_mesh(tp=1)):
        model = Transformer(config, rngs=nnx.Rngs(3))
        want = logits_of(model, tokens)
        save_pretrained(model, tmp_path, dtype="float32")
        loaded = from_pretrained(tmp_path, attention_impl="xla", impl="xla")
        assert loaded.config == model.config
        assert jax.tree.all(jax.tree.map(np.array_equal, params_of(loaded), params_of(model)))
        np.testing.assert_array_equal(logits_of(loaded, tokens), want)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert ("lm_head.weight" in f.keys()) is not config.tie_embeddings
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["tie_word_embeddings"] is config.tie_embeddings
    for tp in (2, 4):
        with jax.set_mesh(cpu_mesh(tp=tp)):
            sharded = from_pretrained(tmp_path, attention_impl="xla", impl="xla")
            got = logits_of(sharded, tokens)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_bfloat16_checkpoint_round_trips_bit_for_bit(tmp_path, tokens):
    with jax.set_mesh(cpu_mesh(tp=2)):
        model = Transformer(CONFIG, rngs=nnx.Rngs(5))
        save_pretrained(model, tmp_path / "a")
        loaded = from_pretrained(tmp_path / "a", attention_impl="xla", impl="xla")
        save_pretrained(loaded, tmp_path / "b")
        rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32)
                   for k, v in params_of(model).items()}
        assert jax.tree.all(jax.tree.map(np.array_equal, params_of(loaded), rounded))
        greedy = [np.asarray(generate(m, tokens[:, :5], max_new_tokens=8))
                  for m in (loaded, from_pretrained(tmp_path / "b", attention_impl="xla"))]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()
    np.testing.assert_array_equal(*greedy)


def test_bfloat16_parameters_are_what_a_bfloat16_step_reads(tmp_path, tokens):
    """param_dtype="bfloat16": the matrices and the embedding kept in
    bfloat16 (half their bytes), the norms in float32. A bfloat16 model reads
    the same values from them as from float32 parameters, so its logits and
    greedy tokens are the same; saved, it gives back the file's bytes."""
    with jax.set_mesh(cpu_mesh(tp=2)):
        save_pretrained(Transformer(CONFIG, rngs=nnx.Rngs(5)), tmp_path / "a")
        wide, narrow = (from_pretrained(tmp_path / "a", dtype="bfloat16", param_dtype=stored,
                                        attention_impl="xla", impl="xla")
                        for stored in ("float32", "bfloat16"))
        kept, widened = params_of(narrow), params_of(wide)
        for key, value in kept.items():  # norms: (..., "weight"); matrices: "kernel", ...
            norm = key[-1] == "weight"
            assert value.dtype == (np.float32 if norm else ml_dtypes.bfloat16), key
            assert value.nbytes * (1 if norm else 2) == widened[key].nbytes, key
        # Decoding reads the kept matrices themselves, not a copy.
        assert all(d is k for d, k in zip(jax.tree.leaves(decoding_params(narrow)),
                                          jax.tree.leaves(nnx.state(narrow)), strict=True))
        np.testing.assert_array_equal(logits_of(narrow, tokens), logits_of(wide, tokens))
        greedy = [np.asarray(generate(m, tokens[:, :5], max_new_tokens=8)) for m in (wide, narrow)]
        save_pretrained(narrow, tmp_path / "b")
    np.testing.assert_array_equal(*greedy)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()


def test_a_parameter_dtype_the_models_do_not_keep_is_named():
    with pytest.raises(ValueError, match=r"param_dtype must be one of \('float32', 'bfloat16'\)"):
        dataclasses.replace(CONFIG, param_dtype="float16")


def test_llama3_frequencies_follow_the_published_rule():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192)
    got = np.asarray(rope_frequencies(128, 500_000.0, scaling), np.float64)
    base = 500_000.0 ** (-np.arange(0, 128, 2) / 128)
    for f, g in zip(base, got):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:
            want = f
        elif wavelength > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert g == pytest.approx(want, rel=1e-6)


HF = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
      "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
      "max_position_embeddings": 131072, "tie_word_embeddings": True,
      "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def test_the_llama_3_2_1b_config_maps_field_by_field():
    config = llama_config(HF, dtype="bfloat16")
    assert (config.vocab_size, config.num_layers, config.embed_dim, config.num_heads,
            config.num_kv_heads, config.head_dim, config.mlp_dim) == (
                128256, 16, 2048, 32, 8, 64, 8192)
    assert config.tie_embeddings and config.rope_theta == 500000.0 and config.norm_eps == 1e-5
    assert config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert config.dtype == "bfloat16"
    # transformers 5 nests the rope settings under rope_parameters.
    nested = {k: v for k, v in HF.items() if k not in ("rope_theta", "rope_scaling")}
    nested["rope_parameters"] = {"rope_theta": 500000.0, **HF["rope_scaling"]}
    assert llama_config(nested) == llama_config(HF)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type is 'mistral'; only 'llama'"),
    ({"attention_bias": True}, "attention_bias is true; the model has no bias terms"),
    ({"mlp_bias": True}, "mlp_bias is true"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling of type 'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}},
     "rope_scaling has no 'low_freq_factor'"),
    ({"hidden_size": None}, "config.json has no 'hidden_size'"),
])
def test_configs_the_model_cannot_express_name_the_field(change, message):
    hf = {k: v for k, v in {**HF, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        llama_config(hf)


def test_a_checkpoint_that_does_not_match_its_config_is_named(tmp_path):
    with jax.set_mesh(cpu_mesh(tp=1)):
        save_pretrained(Transformer(CONFIG, rngs=nnx.Rngs(0)), tmp_path)
        hf = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 48}))
        with pytest.raises(ValueError, match=r"needs a shard of shape .* the config does not "
                                             r"match the weights"):
            from_pretrained(tmp_path, attention_impl="xla")
        with pytest.raises(TypeError, match=r"pass either config or overrides \(\['dtype'\]\)"):
            from_pretrained(tmp_path, config=CONFIG, dtype="float32")
    with pytest.raises(ValueError, match=r"call it under the mesh the model runs on, "
                                         r"`with jax.set_mesh\(mesh\):`"):
        from_pretrained(tmp_path)
    with jax.set_mesh(cpu_mesh(tp=1)), pytest.raises(FileNotFoundError,
                                                     match="has neither model.safetensors"):
        (tmp_path / "model.safetensors").unlink()
        from_pretrained(tmp_path)


# Made with transformers (tests/data/make_llama_fixtures.py): its logits and
# greedy tokens for small random Llamas.
FIXTURES = Path(__file__).with_name("data") / "llama"
PARITY = [("gqa_untied", 1), ("gqa_untied", 2), ("gqa_untied", 4),
          ("gqa_tied_llama3_rope", 1), ("gqa_tied_llama3_rope", 2),
          ("mha_wide_heads", 1), ("mha_wide_heads", 4),
          ("kernel_llama3_rope", 1), ("kernel_llama3_rope", 2)]


# By default the grouped-query checkpoints at a tensor-parallel size of 2.
@pytest.mark.parametrize("name, tp", slow_unless(
    [("gqa_untied", 2), ("gqa_tied_llama3_rope", 2)], PARITY))
def test_logits_and_greedy_tokens_match_transformers(name, tp):
    """float32 on CPU: the prompt's logits within 1e-4 relative of
    transformers', and 32 greedy tokens (prefill, then the decode loop)
    identical."""
    check_matches_transformers(FIXTURES / name, tp, attention_impl="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("name, decode", [
    *((name, {}) for name in ("gqa_untied", "gqa_tied_llama3_rope", "mha_wide_heads")),
    ("kernel_llama3_rope", {"decode_blocks": "cuda"}),
    ("kernel_llama3_rope", {"decode_blocks": "cuda", "param_dtype": "bfloat16"}),
    ("kernel_llama3_rope", {"decode_blocks": "layers"}),
], ids=["gqa_untied", "gqa_tied_llama3_rope", "mha_wide_heads", "one-kernel",
        "one-kernel-bf16-params", "layers"])
def test_bfloat16_decoding_follows_transformers_on_a_gpu(name, decode):
    """Each checkpoint on one GPU in bfloat16, through the default decode
    path or the one named (kernel_llama3_rope: head width 64, Llama 3.1's
    rope scaling and a tied head, so that every block of each step can run
    in one CUDA kernel); see model_support.check_bfloat16_decode."""
    mesh = jax.make_mesh((1, 1), ("data", "tensor"), devices=jax.devices()[:1])
    check_bfloat16_decode(FIXTURES / name, mesh, {}, **decode)


def test_the_generate_command_reads_a_checkpoint_and_its_tokenizer(tmp_path):
    """jax-flashoverlap-generate --pretrained: text in through the
    checkpoint's tokenizer.json, transformers' greedy continuation out."""
    from jax_flashoverlap.cli import generate as generate_cli

    expected = np.load(FIXTURES / "gqa_untied" / "expected.npz")
    _with_word_tokenizer(tmp_path / "ckpt")
    prompt, greedy = expected["prompts"][0], expected["greedy"][0]
    out = tmp_path / "run.json"
    assert generate_cli.main([
        "--model", "transformer", "--pretrained", str(tmp_path / "ckpt"), "--mesh", "1x2",
        "--prompt", " ".join(f"w{i}" for i in prompt), "--max-new-tokens", "32",
        "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompt_tokens"] == prompt.size
    assert result["texts"] == [" ".join(f"w{i}" for i in greedy[prompt.size:])]


@pytest.mark.slow  # two runs of the command
def test_the_generate_command_keeps_bfloat16_parameters_on_request(tmp_path):
    """--param-dtype bfloat16 under --dtype bfloat16: the same text as with
    float32 parameters, which the bfloat16 steps read as the same values."""
    from jax_flashoverlap.cli import generate as generate_cli

    _with_word_tokenizer(tmp_path / "ckpt")
    prompt = np.load(FIXTURES / "gqa_untied" / "expected.npz")["prompts"][0]
    results = []
    for stored in ("float32", "bfloat16"):
        out = tmp_path / f"{stored}.json"
        assert generate_cli.main([
            "--model", "transformer", "--pretrained", str(tmp_path / "ckpt"), "--mesh", "1x2",
            "--prompt", " ".join(f"w{i}" for i in prompt), "--max-new-tokens", "12",
            "--dtype", "bfloat16", "--param-dtype", stored, "--warmup", "0",
            "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    assert [r["param_dtype"] for r in results] == ["float32", "bfloat16"]
    assert results[0]["texts"] == results[1]["texts"]


CONFIG_VOCAB = 211  # the fixtures' vocabulary (tests/data/make_llama_fixtures.py)


def _with_word_tokenizer(directory):
    with_word_tokenizer(FIXTURES / "gqa_untied", directory, CONFIG_VOCAB)


def test_a_checkpoint_without_a_tokenizer_needs_a_byte_vocabulary(tmp_path):
    from jax_flashoverlap.cli import tokens

    with pytest.raises(ValueError, match=r"has no tokenizer.json, and the model's 211 ids "
                                         r"cannot hold bytes"):
        tokens.for_checkpoint(FIXTURES / "gqa_untied", CONFIG_VOCAB)
    assert isinstance(tokens.for_checkpoint(None, 256), tokens.ByteTokens)


@pytest.mark.slow  # the training command
def test_training_from_a_checkpoint_and_saving_it_back(tmp_path):
    """jax-flashoverlap-train --init-from DIR --save-pretrained OUT: the
    checkpoint's tokenizer reads the data, the first loss is the loaded
    model's, and OUT loads back with the trained weights."""
    _with_word_tokenizer(tmp_path / "ckpt")
    run = fine_tune_checkpoint(tmp_path / "ckpt", tmp_path, steps=3, attention_impl="xla")
    # Step 0's batch, through the loaded model (transformers' weights).
    assert run.first_loss == pytest.approx(run.loaded_loss, rel=1e-4)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (tmp_path / "ckpt" / "tokenizer.json").read_bytes()
    assert not np.allclose(run.loaded[("head",)], run.trained[("head",)])  # it trained


def test_published_shapes_are_the_checkpoints_configs():
    from jax_flashoverlap.models import shapes

    kind, llama = shapes.config_of("llama-3.2-1b")
    assert kind == "transformer"
    assert (llama.vocab_size, llama.embed_dim, llama.num_layers, llama.num_heads,
            llama.num_kv_heads, llama.head_dim, llama.mlp_dim, llama.tie_embeddings) == (
                128256, 2048, 16, 32, 8, 64, 8192, True)
    assert llama.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    _, big = shapes.config_of("llama-3.1-8b")
    assert (big.embed_dim, big.num_layers, big.head_dim, big.mlp_dim, big.tie_embeddings) == (
        4096, 32, 128, 14336, False)
    kind, mamba = shapes.config_of("mamba2-1.3b")
    assert (kind, mamba.vocab_size, mamba.num_groups, mamba.num_layers,
            mamba.tie_embeddings) == ("mamba", 50288, 1, 48, True)
    assert shapes.config_of(str(FIXTURES / "gqa_untied"))[1].vocab_size == CONFIG_VOCAB
    kind, fixture = shapes.config_of(str(FIXTURES.parent / "mamba2" / "groups4_odd_chunk"))
    assert (kind, fixture.num_groups, fixture.chunk_size) == ("mamba", 4, 7)
    with pytest.raises(ValueError, match="is neither one of"):
        shapes.config_of("llama-9")
