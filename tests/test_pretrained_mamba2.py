"""Mamba-2 checkpoints in the Hugging Face layout (models/pretrained_mamba2.py), on CPU."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax_flashoverlap.models import Mamba2, MambaConfig, generate
from jax_flashoverlap.models.pretrained import (
    from_pretrained,
    mamba2_config,
    pretrained_config,
    save_pretrained,
)
from model_support import (
    check_bfloat16_decode,
    check_matches_transformers,
    fine_tune_checkpoint,
    logits_of,
    params_of,
)
from support import cpu_mesh, slow_unless, with_word_tokenizer

# Two B/C groups of two heads each, a chunk that does not divide the sequence.
CONFIG = MambaConfig(vocab_size=97, num_layers=2, embed_dim=24, state_dim=8, head_dim=12,
                     num_groups=2, expand=2, chunk_size=5, max_seq_len=64, impl="xla")
FIXTURES = Path(__file__).with_name("data") / "mamba2"


@pytest.fixture
def tokens(rng):
    return jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 10)), jnp.int32)


# Untied is slow: the default reads an untied head in
# test_logits_and_greedy_tokens_match_transformers[groups2_untied-2].
@pytest.mark.parametrize("config", [pytest.param(CONFIG, marks=pytest.mark.slow),
                                    dataclasses.replace(CONFIG, tie_embeddings=True)],
                         ids=["untied", "tied"])
def test_a_saved_model_loads_back_exactly_at_every_tensor_size(tmp_path, tokens, config):
    with jax.set_mesh(cpu_mesh(tp=1)):
        model = Mamba2(config, rngs=nnx.Rngs(3))
        want = logits_of(model, tokens)
        save_pretrained(model, tmp_path, dtype="float32")
        loaded = from_pretrained(tmp_path, max_seq_len=64, impl="xla")
        assert isinstance(loaded, Mamba2)
        assert loaded.config == model.config
        assert jax.tree.all(jax.tree.map(np.array_equal, params_of(loaded), params_of(model)))
        np.testing.assert_array_equal(logits_of(loaded, tokens), want)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert ("lm_head.weight" in f.keys()) is not config.tie_embeddings
        assert f.get_tensor("backbone.layers.0.mixer.in_proj.weight").shape == (
            2 * 48 + 2 * 2 * 8 + 4, 24)  # z, x, B, C of every group, dt of every head
    with jax.set_mesh(cpu_mesh(tp=2)):  # each rank reads one group
        got = logits_of(from_pretrained(tmp_path, max_seq_len=64, impl="xla"), tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_bfloat16_checkpoint_round_trips_bit_for_bit(tmp_path, tokens):
    with jax.set_mesh(cpu_mesh(tp=2)):
        model = Mamba2(CONFIG, rngs=nnx.Rngs(5))
        save_pretrained(model, tmp_path / "a")
        loaded = from_pretrained(tmp_path / "a", impl="xla")
        save_pretrained(loaded, tmp_path / "b")
        rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32)
                   for k, v in params_of(model).items()}
        assert jax.tree.all(jax.tree.map(np.array_equal, params_of(loaded), rounded))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()


HF = {"model_type": "mamba2", "vocab_size": 97, "hidden_size": 24, "state_size": 8,
      "num_hidden_layers": 2, "num_heads": 4, "head_dim": 12, "n_groups": 2, "expand": 2,
      "conv_kernel": 4, "chunk_size": 5, "layer_norm_epsilon": 1e-5,
      "time_step_limit": [0.0, {"__float__": "Infinity"}]}


def test_the_config_maps_field_by_field():
    config = mamba2_config(HF, impl="xla", max_seq_len=64)
    assert config == CONFIG


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mamba"}, r"model_type is 'mamba'; only 'mamba2' checkpoints load"),
    ({"use_bias": True}, r"use_bias is true; the model's projections have no bias terms"),
    ({"use_conv_bias": False}, r"use_conv_bias is false; the model's convolution has a bias"),
    ({"hidden_act": "gelu"}, r"hidden_act is 'gelu'; the model activates with silu"),
    ({"rms_norm": False}, r"rms_norm is false; the model's norms are RMSNorm"),
    ({"time_step_limit": [0.0, 0.1]}, r"time_step_limit is \[0.0, 0.1\]; the model does not "
                                      r"clamp its step sizes"),
    ({"num_heads": 3}, r"num_heads=3 x head_dim=12 must be the inner width expand x "
                       r"hidden_size = 48"),
    ({"state_size": None}, r"config.json has no 'state_size'"),
    ({"d_model": 24, "hidden_size": None}, r"mamba_ssm's layout \(d_model, n_layer\); convert "
                                           r"the checkpoint"),
])
def test_configs_the_model_cannot_express_name_the_field(change, message):
    hf = {k: v for k, v in {**HF, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        mamba2_config(hf)


def test_an_unknown_architecture_names_the_ones_that_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"model_type is 'gpt2'; the models load "
                                         r"\['llama', 'mamba2'\] checkpoints"):
        pretrained_config(tmp_path)
    with pytest.raises(TypeError, match="a dict has no Hugging Face layout"):
        from_pretrained(tmp_path, config={})


# Made with transformers (tests/data/make_mamba2_fixtures.py): its logits and
# greedy tokens for small random Mamba-2s.
PARITY = [("groups2_untied", 1), ("groups2_untied", 2), ("groups1_tied", 1),
          ("groups4_odd_chunk", 1), ("groups4_odd_chunk", 4)]


# By default two checkpoints, each at a tensor-parallel size above 1 (the
# default's test_a_saved_model_loads_back_exactly_at_every_tensor_size[tied]
# reads a tied head).
@pytest.mark.parametrize("name, tp", slow_unless(
    [("groups2_untied", 2), ("groups4_odd_chunk", 4)], PARITY))
def test_logits_and_greedy_tokens_match_transformers(name, tp):
    """float32 on CPU: the prompt's logits within 1e-4 relative of
    transformers', and 32 greedy tokens (prefill, then the recurrent decode
    loop) identical."""
    check_matches_transformers(FIXTURES / name, tp, max_seq_len=64)


def test_bfloat16_parameters_are_what_a_bfloat16_step_reads(tokens):
    """param_dtype="bfloat16": in_proj, out_proj and the embedding kept in
    bfloat16, the convolution, the SSM's vectors and the norms in float32;
    a bfloat16 model's logits and greedy tokens are those it computes from
    float32 parameters."""
    with jax.set_mesh(cpu_mesh(tp=2)):
        wide, narrow = (from_pretrained(FIXTURES / "groups2_untied", dtype="bfloat16",
                                        param_dtype=stored, max_seq_len=64)
                        for stored in ("float32", "bfloat16"))
        kept_narrow = {key[-2] if key[-1] == "kernel" else key[-1]
                       for key, value in params_of(narrow).items()
                       if value.dtype == ml_dtypes.bfloat16}
        assert kept_narrow == {"in_proj", "out_proj", "embedding", "head"}
        np.testing.assert_array_equal(logits_of(narrow, tokens), logits_of(wide, tokens))
        greedy = [np.asarray(generate(m, tokens[:, :5], max_new_tokens=8)) for m in (wide, narrow)]
    np.testing.assert_array_equal(*greedy)


@pytest.mark.gpu
@pytest.mark.parametrize("name, decode", [
    ("groups1_tied", {}), ("groups2_untied", {}), ("groups4_odd_chunk", {}),
    ("groups2_untied", {"param_dtype": "bfloat16"}),
], ids=["groups1_tied", "groups2_untied", "groups4_odd_chunk", "bf16-params"])
def test_bfloat16_decoding_follows_transformers_on_a_gpu(name, decode):
    """Each checkpoint on one GPU in bfloat16, through the default decode
    path or the one named; see model_support.check_bfloat16_decode."""
    mesh = jax.make_mesh((1, 1), ("data", "tensor"), devices=jax.devices()[:1])
    check_bfloat16_decode(FIXTURES / name, mesh, {"max_seq_len": 64}, **decode)


VOCAB = 211  # the fixtures' (tests/data/make_mamba2_fixtures.py)


def test_the_generate_command_reads_a_mamba2_checkpoint_and_its_tokenizer(tmp_path):
    """jax-flashoverlap-generate --pretrained on a Mamba-2 checkpoint (its
    model_type picks --model mamba): transformers' greedy continuation."""
    from jax_flashoverlap.cli import generate as generate_cli

    expected = np.load(FIXTURES / "groups2_untied" / "expected.npz")
    with_word_tokenizer(FIXTURES / "groups2_untied", tmp_path / "ckpt", VOCAB)
    prompt, greedy = expected["prompts"][0], expected["greedy"][0]
    out = tmp_path / "run.json"
    assert generate_cli.main([
        "--pretrained", str(tmp_path / "ckpt"), "--mesh", "1x2",
        "--prompt", " ".join(f"w{i}" for i in prompt), "--max-new-tokens", "32",
        "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "mamba"
    assert result["texts"] == [" ".join(f"w{i}" for i in greedy[prompt.size:])]


def test_another_model_than_the_checkpoints_is_an_error_naming_both(capsys):
    from jax_flashoverlap.cli import generate as generate_cli
    from jax_flashoverlap.cli import train as train_cli

    with pytest.raises(SystemExit):
        generate_cli.parse_args(["--model", "transformer", "--prompt", "x", "--max-new-tokens",
                                 "4", "--pretrained",
                                 str(FIXTURES / "groups1_tied")])
    assert ("holds a mamba2 checkpoint, which --model mamba reads, not --model transformer"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--init-from", str(FIXTURES.parent)])
    assert "no config.json there" in capsys.readouterr().err


@pytest.mark.slow  # the training command
def test_training_a_mamba2_checkpoint_and_saving_it_back(tmp_path):
    """jax-flashoverlap-train --init-from DIR --save-pretrained OUT on a
    Mamba-2 checkpoint: the first loss is the loaded model's, and OUT loads
    back with the trained weights."""
    with_word_tokenizer(FIXTURES / "groups2_untied", tmp_path / "ckpt", VOCAB)
    run = fine_tune_checkpoint(tmp_path / "ckpt", tmp_path, steps=2, impl="xla")
    assert run.args.model == "mamba"
    assert run.first_loss == pytest.approx(run.loaded_loss, rel=1e-4)
    assert not np.allclose(run.loaded[("head",)], run.trained[("head",)])
