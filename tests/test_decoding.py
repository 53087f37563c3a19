"""Generation: decode logits equal the forward pass, tokens equal at every mesh, clear errors."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_support import build
from support import (
    assert_as_accurate,
    assert_close,
    cpu_mesh,
    f64,
    missing_path_in,
    random,
    slow_unless,
)

import jax_flashoverlap as jfo
from jax_flashoverlap import models
from jax_flashoverlap.cli import generate as generate_cli
from jax_flashoverlap.cli import train

MODELS = {"transformer": (models.Transformer, models.TransformerConfig.tiny()),
          "mamba": (models.Mamba2, models.MambaConfig.tiny())}
# 7 prompt tokens (not a multiple of the tensor axis, nor of Mamba's chunk of
# 16) and 10 new ones: the forward pass over the 16 tokens fed back checks them.
PROMPT_LEN, NEW_TOKENS = 7, 10


def _prompt(seed: int, batch: int = 2, length: int = PROMPT_LEN) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, length), np.int32)


def _with_token(token: int) -> np.ndarray:
    prompt = _prompt(0)
    prompt[1, 3] = token
    return prompt


def _forward_logits(model, mesh, tokens, prompt_len: int = PROMPT_LEN):
    """The model's forward over ``tokens[:, :-1]`` at the generated positions."""
    with jax.set_mesh(mesh):
        logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens[:, :-1]))
    return np.asarray(logits, np.float64)[:, prompt_len - 1:]


# By default each model at one tensor-parallel size with the library's own
# collectives; the other sizes and impl="xla" are slow.
@pytest.mark.parametrize("name, impl, tp", slow_unless(
    [("transformer", "decomposed", 2), ("mamba", "decomposed", 2)],
    list(itertools.product(MODELS, ["xla", "decomposed"], [1, 2, 4]))))
def test_logits_equal_the_forward_pass(name, impl, tp, rng):
    """Teacher forcing: each new token's logits are those of the model's own
    forward pass over the generated sequence, at that position."""
    model_cls, config = MODELS[name]
    _check_teacher_forced(model_cls, dataclasses.replace(config, impl=impl),
                          cpu_mesh(tp=tp, dp=2), PROMPT_LEN, rng)


@pytest.mark.parametrize("name", slow_unless(["mamba"], list(MODELS)))
def test_logits_equal_the_forward_pass_without_sequence_parallelism(name, rng):
    """The same with a prefill that is not sequence-parallel, from a prompt
    of 37 tokens: several of Mamba-2's chunks (16), the state carried."""
    model_cls, config = MODELS[name]
    config = dataclasses.replace(config,
                                 sharding=models.ShardingConfig(sequence_parallel=False))
    _check_teacher_forced(model_cls, config, cpu_mesh(tp=2, dp=2), 37, rng)


def _check_teacher_forced(model_cls, config, mesh, prompt_len: int, rng) -> None:
    model = build(model_cls, config, mesh, nnx.state(_random_model(model_cls, config, rng)))
    prompt = _prompt(int(rng.integers(1 << 30)), length=prompt_len)
    with jax.set_mesh(mesh):
        tokens, logits = models.generate(model, prompt, NEW_TOKENS, return_logits=True)
    tokens, logits = np.asarray(tokens), np.asarray(logits, np.float64)
    assert tokens.shape == (2, prompt_len + NEW_TOKENS) and tokens.dtype == np.int32
    assert logits.shape == (2, NEW_TOKENS, 256)
    np.testing.assert_array_equal(tokens[:, :prompt_len], prompt)
    # Greedy: every new token is the argmax of the logits it was chosen from.
    np.testing.assert_array_equal(tokens[:, prompt_len:], logits.argmax(-1))
    want = _forward_logits(model, mesh, tokens, prompt_len)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _attention_as_the_kernel_computes_it(q, k, v, cache_k, cache_v, pos):
    """``decode_attention_pallas.decode_attention``'s contract in jnp ops: the
    Pallas interpreter does not run inside shard_map, so the model's use of
    the kernel is checked through this, the kernel against float64 in
    test_decode_attention_pallas.py."""
    h = q.shape[-1]
    keys = jnp.concatenate([cache_k, k], axis=2)
    values = jnp.concatenate([cache_v, v], axis=2)
    length = cache_k.shape[2]
    seen = jnp.concatenate([jnp.arange(length) < pos, jnp.ones((1,), bool)])
    scores = jnp.einsum("bgqh,bglh->bgql", q, keys) / np.sqrt(h)
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bgql,bglh->bgqh", weights, values).astype(q.dtype)
    return (out, *(jax.lax.dynamic_update_slice(c, t, (0, 0, pos, 0))
                   for c, t in ((cache_k, k), (cache_v, v))))


def _decoding_through(kernel_module, kernel: str, contract, record, name, tp, rng,
                      monkeypatch, **overrides):
    """Generates with ``kernel_module.kernel`` replaced by ``contract`` (it
    runs inside shard_map on CPU, where the Pallas interpreter does not),
    checks the logits against the model's forward pass, and returns (the
    config, the set of ``record(*args)`` over the kernel's calls)."""
    calls = []

    def replaced(*args):
        calls.append(record(*args))
        return contract(*args)

    monkeypatch.setattr(kernel_module, kernel, replaced)
    model_cls, config = MODELS[name]
    config = dataclasses.replace(config, **overrides)
    mesh = cpu_mesh(tp=tp)
    model = build(model_cls, config, mesh, nnx.state(_random_model(model_cls, config, rng)))
    with jax.set_mesh(mesh):
        tokens, logits = models.generate(model, _prompt(int(rng.integers(1 << 30))), NEW_TOKENS,
                                         return_logits=True)
    want = _forward_logits(model, mesh, np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    return config, set(calls)


@pytest.mark.parametrize("tp", slow_unless([2], [1, 2]))
def test_decoding_through_the_attention_kernel_gives_the_forward_pass_logits(tp, rng,
                                                                           monkeypatch):
    """decode_attention="pallas": every layer hands the kernel its query
    heads grouped by KV head and takes back the updated caches; the logits
    are the forward pass's."""
    config, calls = _decoding_through(
        models.decode_attention_pallas, "decode_attention", _attention_as_the_kernel_computes_it,
        lambda q, *_: q.shape, "transformer", tp, rng, monkeypatch, decode_attention="pallas")
    kv = config.num_kv_heads // tp
    assert calls == {(2, kv, config.num_heads // config.num_kv_heads, config.head_dim)}


def test_decode_attention_setting():
    """"auto" is the kernel only on CUDA GPUs and only up to AUTO_MAX_BATCH
    rows per device; heads it cannot take are an error for "pallas" and the
    model's attention for "auto"."""
    config = models.TransformerConfig.tiny()
    assert config.decode_attention == "auto"  # the kernel only where it measured faster
    choose = models.transformer.decode_attention_implementation
    on_cuda = jax.default_backend() == "gpu"
    auto = dataclasses.replace(config, decode_attention="auto")
    small = models.decode_attention_pallas.AUTO_MAX_BATCH
    assert choose(auto, small) == choose(auto) == ("pallas" if on_cuda else "model")
    assert choose(auto, small + 1) == "model"
    assert choose(dataclasses.replace(config, decode_attention="pallas"), 64) == "pallas"
    many_per_kv = dataclasses.replace(config, num_heads=4 * 32, num_kv_heads=4)
    assert choose(dataclasses.replace(many_per_kv, decode_attention="auto")) == "model"
    with pytest.raises(ValueError, match=r"decode_attention='pallas' but query heads per KV "
                                         r"head \(32\) are more than 16; use "
                                         r"decode_attention='model' or 'auto'"):
        choose(dataclasses.replace(many_per_kv, decode_attention="pallas"))
    with pytest.raises(ValueError, match="decode_attention"):
        dataclasses.replace(config, decode_attention="cudnn")


@pytest.mark.parametrize("tp", slow_unless([2], [1, 2]))
def test_decoding_through_the_mixer_kernel_gives_the_forward_pass_logits(tp, rng,
                                                                       monkeypatch):
    """decode_mixer="pallas": every layer hands the kernel in_proj's output
    by group, its states and its parameters; the logits are the forward pass's."""
    config, calls = _decoding_through(
        models.mamba_decode_pallas, "mixer_step", models.mamba_decode_pallas.mixer_step_xla,
        lambda zxbcdt, *args: (zxbcdt.shape, args[-1]), "mamba", tp, rng, monkeypatch,
        decode_mixer="pallas")
    hpg = config.num_heads // config.num_groups
    width = 2 * hpg * config.head_dim + 2 * config.state_dim + hpg
    layout = models.mamba_decode_pallas.Layout(hpg, config.head_dim, config.state_dim)
    assert calls == {((2, config.num_groups // tp, width), layout)}


def test_decode_mixer_setting():
    """XLA's ops by default; a layout the kernel cannot take is an error for
    "pallas", at the model's construction."""
    config = models.MambaConfig.tiny()
    assert config.decode_mixer == "xla"
    choose = models.mamba.decode_mixer_implementation
    assert choose(config) == "xla"
    assert choose(dataclasses.replace(config, decode_mixer="pallas")) == "pallas"
    odd_state = dataclasses.replace(config, state_dim=24, decode_mixer="pallas")
    with pytest.raises(ValueError, match=r"decode_mixer='pallas' but state_dim=24 is not a "
                                         r"power of two from 16; use decode_mixer='xla'"):
        choose(odd_state)
    with (jax.set_mesh(cpu_mesh(tp=1)),
          pytest.raises(ValueError, match="decode_mixer='pallas' but state_dim=24")):
        models.Mamba2(odd_state, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="decode_mixer"):
        dataclasses.replace(config, decode_mixer="auto")


def _random_model(model_cls, config, rng):
    """A model with fresh random parameters (its seed drawn from ``rng``)."""
    with jax.set_mesh(cpu_mesh(tp=1)):
        seed = int(rng.integers(1 << 30))
        return nnx.jit(lambda: model_cls(config, rngs=nnx.Rngs(seed)))()


@pytest.mark.parametrize("name", slow_unless(["transformer"], list(MODELS)))
def test_tokens_are_the_same_on_every_mesh(name, rng):
    """Greedy tokens at TP = 1, 2 and 4, and sampled ones (temperature, top-k)
    with the data axis split in two or four: the draws do not depend on the mesh."""
    model_cls, config = MODELS[name]
    state = nnx.state(_random_model(model_cls, config, rng))
    prompt = _prompt(int(rng.integers(1 << 30)), batch=4)
    key = jax.random.key(int(rng.integers(1 << 30)))
    runs = {}
    for tp, dp in ((1, 1), (4, 2), (2, 4)):
        mesh = cpu_mesh(tp=tp, dp=dp)
        model = build(model_cls, config, mesh, state)
        with jax.set_mesh(mesh):
            greedy = models.generate(model, prompt, NEW_TOKENS)
            sampled = models.generate(model, prompt, NEW_TOKENS, temperature=0.9, top_k=20,
                                      rng=key)
        runs[tp, dp] = np.asarray(greedy), np.asarray(sampled)
    (greedy, sampled), *others = runs.values()
    for layout, (g, s) in zip(list(runs)[1:], others):
        np.testing.assert_array_equal(g, greedy, err_msg=f"greedy, (tp, dp) = {layout}")
        np.testing.assert_array_equal(s, sampled, err_msg=f"sampled, (tp, dp) = {layout}")
    assert not np.array_equal(greedy, sampled)


def test_sampling_keeps_to_the_top_k(rng):
    logits = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    tokens = np.asarray(models.decoding.sample(logits, jax.random.key(0), 3, temperature=2.0,
                                               top_k=5))
    allowed = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
    assert all(t in row for t, row in zip(tokens, allowed))
    assert len(set(tokens.tolist())) > 5  # rows draw apart


def test_sampling_at_a_tiny_temperature_is_greedy(rng):
    """logits / 1e-39 would overflow to +-inf in float32 (and argmax then
    picks token 0); the draw stays the most likely token."""
    logits = jnp.asarray(rng.standard_normal((16, 256)) - 5.0, jnp.float32)
    tokens = models.decoding.sample(logits, jax.random.key(0), 0, temperature=1e-39, top_k=None)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(logits).argmax(-1))


def test_sampling_at_a_huge_temperature_is_uniform(rng):
    """At T = 1e39 every token is as likely (T times the noise would overflow
    to +-inf and favour the first column)."""
    logits = jnp.asarray(rng.standard_normal((4096, 4)), jnp.float32)
    tokens = models.decoding.sample(logits, jax.random.key(1), 0, temperature=1e39, top_k=None)
    shares = np.bincount(np.asarray(tokens), minlength=4) / 4096
    assert np.all(np.abs(shares - 0.25) < 0.03), shares


def test_mamba_prefill_state_is_the_recurrence(rng):
    """ssd's final state, and ssd_step continuing from it, equal the SSM step
    by step (float64 reference)."""
    s, batch, g, heads, p, n = 24, 2, 2, 3, 4, 5
    x, b, c = (random(rng, shape, "float32") for shape in
               ((s + 1, batch, g, heads, p), (s + 1, batch, g, n), (s + 1, batch, g, n)))
    dt = jax.nn.softplus(random(rng, (s + 1, batch, g, heads), "float32"))
    a = -jnp.exp(random(rng, (g, heads), "float32"))
    h = np.zeros((batch, g, heads, p, n))
    ys = []
    for t in range(s + 1):
        h = (np.exp(f64(dt[t]) * f64(a))[..., None, None] * h
             + (f64(dt[t])[..., None] * f64(x[t]))[..., None] * f64(b[t])[:, :, None, None, :])
        ys.append(np.einsum("bghpn,bgn->bghp", h, f64(c[t])))
        if t == s - 1:
            state_s = h
    _, final = models.mamba.ssd(x[:s], dt[:s], a, b[:s], c[:s], 8, return_final_state=True)
    assert_close(final, state_s, "float32")
    y, after = models.mamba.ssd_step(x[s], dt[s], a, b[s], c[s], final)
    assert_close(y, ys[-1], "float32")
    assert_close(after, h, "float32")


@pytest.mark.slow  # the training command, then the generation command
def test_a_checkpoint_of_the_training_command_restores(tmp_path):
    """jax-flashoverlap-train --checkpoint-dir, then generate from it: the
    parameters are the trained ones, and the generation command runs on them."""
    ckpt = tmp_path / "ckpt"
    args = train.parse_args(["--size", "tiny", "--batch", "4", "--seq-len", "32", "--steps",
                             "3", "--mesh", "2x2", "--no-progress", "--checkpoint-dir",
                             str(ckpt)])
    trained = nnx.State(train.train(args).state[0])
    mesh = cpu_mesh(tp=2)
    config = train.model_config("transformer", "tiny")
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: models.Transformer(config, rngs=nnx.Rngs(7)))()
        assert train.restore_model_state(ckpt, model) == 3
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    out = tmp_path / "out.json"
    assert generate_cli.main(["--restore", str(ckpt), "--prompt", "def f(", "--mesh", "1x2",
                              "--max-new-tokens", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompt_tokens"] == 6 and result["new_tokens"] == 5
    assert result["warmup_runs"] == 1 and len(result["texts"]) == 1
    assert result["time_to_first_token_ms"] > 0 and result["per_token_ms"] > 0
    assert (result["decode_blocks"], result["decode_matmul"]) == ("layers", "xla")
    assert result["decode_attention"] == "model"  # what ran: on CPU, the model's own
    # Another model (its parameters missing there), or another size of it
    # (their shapes differ): an error naming the likely cause.
    wider = dataclasses.replace(config, mlp_dim=2 * config.mlp_dim)
    for other, why in ((lambda: models.Mamba2(models.MambaConfig.tiny(), rngs=nnx.Rngs(0)),
                        r"Mamba2: .* It lacks \d+ of its parameters, e.g. \["),
                       (lambda: models.Transformer(wider, rngs=nnx.Rngs(0)),
                        r"Transformer: .* \(0/blocks/0/mlp/[\w/]+: checkpoint \(\d+, \d+\), "
                        r"model \(\d+, \d+\)\)")):
        with jax.set_mesh(mesh):
            model = nnx.jit(other)()
            with pytest.raises(ValueError, match=r"the checkpoint of step 3 in .* does not fit "
                                                 r"this " + why):
                train.restore_model_state(ckpt, model)


def test_restore_without_a_checkpoint(tmp_path):
    with jax.set_mesh(cpu_mesh(tp=1)):
        model = nnx.jit(lambda: models.Transformer(models.TransformerConfig.tiny(),
                                                   rngs=nnx.Rngs(0)))()
        with pytest.raises(FileNotFoundError, match="no checkpoint in .*written by "
                                                    "jax-flashoverlap-train"):
            train.restore_model_state(tmp_path, model)


@pytest.fixture(scope="module")
def tiny():
    mesh = cpu_mesh(tp=2, dp=2)
    config = models.TransformerConfig.preset("tiny", max_seq_len=32)
    return build(models.Transformer, config, mesh), mesh


@pytest.mark.parametrize("prompt, kwargs, error, message", [
    (_prompt(0, length=30), dict(max_new_tokens=3), ValueError,
     r"prompt length 30 \+ max_new_tokens 3 = 33 exceeds the model's max_seq_len=32"),
    (_prompt(0), dict(max_new_tokens=0), ValueError, r"max_new_tokens must be an int >= 1, got 0"),
    (_prompt(0), dict(max_new_tokens=2.5), ValueError, r"max_new_tokens must be an int"),
    (_prompt(0, batch=3), dict(max_new_tokens=2), ValueError,
     r"batch 3 does not divide by the 2 ranks of the data axis"),
    (_with_token(-1), dict(max_new_tokens=2), ValueError,
     r"token id -1 in the prompt is outside the vocabulary \[0, 256\)"),
    (_with_token(256), dict(max_new_tokens=2), ValueError, r"token id 256 in the prompt"),
    (_prompt(0).astype(np.float32), dict(max_new_tokens=2), TypeError,
     r"prompt must hold integer token ids, got dtype float32"),
    (_prompt(0)[0], dict(max_new_tokens=2), ValueError, r"prompt must be 2-D"),
    (_prompt(0, length=0), dict(max_new_tokens=2), ValueError, r"prompt length must be"),
    (_prompt(0), dict(max_new_tokens=2, temperature=-1.0), ValueError,
     r"temperature must be a finite number >= 0"),
    (_prompt(0), dict(max_new_tokens=2, temperature="0.5"), ValueError,
     r"temperature must be a finite number >= 0 \(0: greedy\), got '0.5'"),
    (_prompt(0), dict(max_new_tokens=2, temperature=1.0, top_k=0), ValueError,
     r"top_k must be an int >= 1"),
    (_prompt(0), dict(max_new_tokens=2, temperature=1.0, top_k=300), ValueError,
     r"top_k=300 exceeds the vocabulary \(256 tokens\)"),
    (_prompt(0), dict(max_new_tokens=2, temperature=1.0), ValueError,
     r"temperature > 0 samples tokens and needs rng=jax.random.key\(seed\)"),
    (_prompt(0), dict(max_new_tokens=2, top_k=5), ValueError,
     r"top_k=5 only applies when sampling; at temperature 0"),
    (_prompt(0), dict(max_new_tokens=2, temperature=1.0,
                      rng=lambda: jax.random.key(0, impl="rbg")),
     TypeError, r"rng must be one key, jax.random.key\(seed\) or "
                r"jax.random.PRNGKey\(seed\) \(jax's default implementation, key<fry>\); "
                r"got key<rbg> of shape \(\)"),
    (_prompt(0), dict(max_new_tokens=2, temperature=1.0,
                      rng=lambda: jax.random.split(jax.random.key(0))),
     TypeError, r"rng must be one key.* of shape \(2,\)"),
], ids=["too-long", "no-tokens", "fractional", "batch", "negative-id", "large-id", "float",
        "1-d", "empty", "temperature", "temperature-text", "top-k-0", "top-k-large", "no-rng",
        "top-k-greedy", "rbg-key", "two-keys"])
def test_bad_input_gets_a_clear_error(tiny, prompt, kwargs, error, message):
    model, mesh = tiny
    kwargs = _made(kwargs)
    with jax.set_mesh(mesh), pytest.raises(error, match=message):
        models.generate(model, prompt, **kwargs)


@pytest.mark.parametrize("prompt, kwargs", [
    (_with_token(256), {}),
    (_prompt(0).astype(np.float32), {}),
    (_prompt(0), dict(temperature=1.0)),
    (_prompt(0), dict(temperature=1.0, rng=lambda: jax.random.key(0, impl="rbg"))),
    (_prompt(0), dict(top_k=5)),
], ids=["large-id", "float", "no-rng", "rbg-key", "top-k-greedy"])
def test_argument_errors_come_before_compiling(tiny, monkeypatch, prompt, kwargs):
    """What the arguments alone show to be wrong is an error before the
    programs compile (minutes for the 1B models)."""
    model, mesh = tiny

    def compiling(*args, **kwargs):
        raise AssertionError("compiled before checking the arguments")
    monkeypatch.setattr(models.decoding, "Generator", compiling)
    with jax.set_mesh(mesh), pytest.raises((TypeError, ValueError), match="generate: "):
        models.generate(model, prompt, 2, **_made(kwargs))


def _made(kwargs: dict) -> dict:
    """``kwargs`` with its callables called: keys are made in the test, not
    when the module is collected."""
    return {k: v() if callable(v) else v for k, v in kwargs.items()}


def test_generate_takes_either_kind_of_key(tiny):
    """A legacy jax.random.PRNGKey samples as the typed key of its seed;
    greedy decoding ignores the key."""
    model, mesh = tiny
    prompt = _prompt(0)
    with jax.set_mesh(mesh):
        typed = models.generate(model, prompt, 3, temperature=1.0, rng=jax.random.key(5))
        legacy = models.generate(model, prompt, 3, temperature=1.0, rng=jax.random.PRNGKey(5))
        greedy = models.generate(model, prompt, 3)
        greedy_with_key = models.generate(model, prompt, 3, rng=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(legacy), np.asarray(typed))
    np.testing.assert_array_equal(np.asarray(greedy_with_key), np.asarray(greedy))


def test_generate_refuses_to_be_traced(tiny):
    """generate compiles its own programs: inside jax.jit it says to call it
    outside, rather than failing on the mesh lookup."""
    model, mesh = tiny
    with jax.set_mesh(mesh), pytest.raises(TypeError, match="call it outside"):
        jax.jit(lambda t: models.generate(model, t, 2))(jnp.asarray(_prompt(0)))


def test_generator_bounds_its_cache_and_steps(tiny):
    model, mesh = tiny
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"Generator: cache_len=4 is shorter than the \d+ "
                                             r"positions this generation writes"):
            models.Generator(model, batch=2, prompt_len=8, max_new_tokens=4, cache_len=4)
        generator = models.Generator(model, batch=2, prompt_len=8, max_new_tokens=4)
        with pytest.raises(ValueError, match=r"Generator: steps=4 outside 0..3"):
            generator.decode_steps(4)


def test_on_token_sees_every_decode_step_in_order(tiny):
    """Generator(on_token=...): one host call a decode step, with the step's
    number and the tokens the loop returns."""
    model, mesh = tiny
    seen = []
    with jax.set_mesh(mesh):
        generator = models.Generator(model, batch=2, prompt_len=8, max_new_tokens=5,
                                     on_token=lambda tokens, step: seen.append((step, tokens)))
        seen.clear()  # nothing runs while it compiles, but be sure
        tokens, _ = generator(_prompt(0, length=8))
        jax.block_until_ready(tokens)
        jax.effects_barrier()  # the host callbacks have all run
    seen.sort(key=lambda call: call[0])
    assert [step for step, _ in seen] == [1, 2, 3, 4]
    np.testing.assert_array_equal(np.stack([t for _, t in seen], axis=1),
                                  np.asarray(tokens)[:, 9:])


@pytest.mark.slow  # the command twice; test_generate_command_samples_with_top_k runs it
def test_generate_command_streams_what_it_prints_at_the_end(capsys):
    """--stream prints the text as it decodes: the same text the command
    prints at the end without it."""
    argv = ["--prompt", "def f(", "--mesh", "1x1", "--max-new-tokens", "6", "--warmup", "1"]
    assert generate_cli.main(argv) == 0
    whole = capsys.readouterr().out
    assert generate_cli.main([*argv, "--stream"]) == 0
    streamed = capsys.readouterr().out
    block = whole[whole.index("--- row 0:"):].split("\ntime to first token")[0]
    assert block in streamed
    assert "(streamed: a host callback each step)" in streamed


def test_generate_needs_the_mesh(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"call it under `with jax.set_mesh\(mesh\):`"):
        models.generate(model, _prompt(0), 2)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--prompt", "x", "--max-new-tokens", "2", "--restore", "MISSING"],
     "--restore MISSING: no such directory"),
    (["--prompt-file", "MISSING", "--max-new-tokens", "2"], "MISSING: no such file"),
    (["--max-new-tokens", "2"], "one of the arguments --prompt --prompt-file is required"),
    (["--prompt", "x", "--max-new-tokens", "2", "--mesh", "3"], "expected DATAxTENSOR"),
    (["--prompt", "x", "--max-new-tokens", "2", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--prompt", "x", "--max-new-tokens", "2", "--batch", "0"], "--batch must be at least 1"),
    (["--prompt", "x", "--max-new-tokens", "2", "--batch", "2", "--stream"],
     "--stream prints one row as it decodes: use --batch 1, not 2"),
    (["--prompt", "x", "--max-new-tokens", "2", "--temperature", "-0.5"],
     "--temperature must be >= 0"),
    (["--prompt", "x", "--max-new-tokens", "2", "--heap-mb", "0"],
     "--heap-mb must be at least 1"),
    (["--prompt", "x", "--max-new-tokens", "2", "--temperature", "1", "--top-k", "0"],
     "--top-k must be at least 1"),
    (["--prompt", "x", "--max-new-tokens", "2", "--top-k", "5"],
     "--top-k samples among the k most likely bytes: it needs --temperature > 0"),
    (["--model", "mamba", "--prompt", "x", "--max-new-tokens", "2", "--decode-attention",
      "pallas"], "--decode-attention applies to --model transformer, not mamba"),
    (["--prompt", "x", "--max-new-tokens", "2", "--decode-mixer", "pallas"],
     "--decode-mixer applies to --model mamba, not transformer"),
])
def test_generate_command_rejects_bad_flags(argv, message, capsys, tmp_path):
    argv, message = missing_path_in(argv, message, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_generate_command_without_cuda_kernels_refuses_decode_matmul_cuda(monkeypatch, capsys):
    """A CPU-only build: --decode-matmul cuda is a flag error naming the fix,
    not a traceback from inside the first compilation."""
    from jax_flashoverlap import _extension

    monkeypatch.setattr(_extension, "cuda_ops_available", lambda target=None: False)
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.parse_args(["--prompt", "x", "--max-new-tokens", "2",
                                 "--decode-matmul", "cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert ("built without its CUDA kernels (build_info()['cuda'] is False); "
            "use --decode-matmul xla") in err


@pytest.mark.parametrize("model", ["transformer", "mamba"])
def test_generate_command_names_why_the_decode_kernel_cannot_run(capsys, model):
    """--decode-blocks cuda on a float32 model: one line naming the fix."""
    assert generate_cli.main(["--model", model, "--prompt", "xyz", "--max-new-tokens", "2",
                              "--mesh", "1x1", "--dtype", "float32",
                              "--decode-blocks", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "the decode kernel cannot run this step: it computes in bfloat16" in err
    assert "Use decode_blocks='layers'" in err and "Traceback" not in err


def test_generate_command_refuses_an_empty_prompt(capsys):
    """As every other input error: status 2, one line with the command's "error:" prefix."""
    assert generate_cli.main(["--prompt", "", "--max-new-tokens", "2", "--mesh", "1x1"]) == 2
    assert capsys.readouterr().err == ("jax-flashoverlap-generate: error: the prompt is empty: "
                                       "give text to continue (--prompt or --prompt-file)\n")


def test_generate_command_reports_errors_in_one_line(capsys):
    assert generate_cli.main(["--prompt", "x" * 40, "--max-new-tokens", "8200",
                              "--mesh", "1x1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jax-flashoverlap-generate: error: the prompt's 40 tokens + "
                          "--max-new-tokens 8200 exceed the model's max_seq_len=8192")
    assert "Traceback" not in err


def test_generate_command_samples_with_top_k(tmp_path):
    """--temperature 1 --top-k 1 samples from one token: greedy's text."""
    texts = []
    for flags in ([], ["--temperature", "1.0", "--top-k", "1"]):
        out = tmp_path / f"out{len(texts)}.json"
        assert generate_cli.main(["--prompt", "def f(", "--mesh", "1x1", "--max-new-tokens", "6",
                                  "--warmup", "0", "--json", str(out), *flags]) == 0
        texts.append(json.loads(out.read_text())["texts"])
    assert texts[0] == texts[1]


@pytest.mark.slow  # the command twice
def test_generate_command_passes_the_decode_matmul_to_the_layers(tmp_path, monkeypatch):
    """--decode-matmul cuda reaches every decode matmul (on CPU the kernel's
    platform branch is XLA's dot, so the text is greedy's as with xla)."""
    from jax_flashoverlap import _extension, nn

    monkeypatch.setattr(_extension, "require_cuda_ops", lambda *args: None)
    impls, decode_matmul = [], nn.decode_matmul

    def recording(x, w, *, impl):
        impls.append(impl)
        return decode_matmul(x, w, impl=impl)
    monkeypatch.setattr(nn, "decode_matmul", recording)

    def each(flag):
        assert set(impls) == {flag}
        impls.clear()
    texts = _generated_texts(tmp_path, "--decode-matmul", ("xla", "cuda"), each)
    assert texts[0] == texts[1]


def _generated_texts(tmp_path, flag: str, values, after_each, model="transformer") -> list:
    """The generate command's texts (4 greedy bytes after "def f(", one
    device) with ``flag`` at each of ``values``, calling ``after_each(value)``
    after each run."""
    texts = []
    for value in values:
        out = tmp_path / f"{value}.json"
        assert generate_cli.main(["--model", model, "--prompt", "def f(", "--mesh", "1x1",
                                  "--max-new-tokens", "4", "--warmup", "0", flag, value,
                                  "--json", str(out)]) == 0
        texts.append(json.loads(out.read_text())["texts"])
        after_each(value)
    return texts


@pytest.mark.slow  # the command twice
def test_generate_command_passes_the_decode_attention_to_the_layers(tmp_path, monkeypatch):
    """--decode-attention pallas reaches every attention layer (the kernel
    replaced by its contract in jnp ops, which runs on CPU): greedy's text,
    as with the model's attention."""
    calls = []

    def attend(*args):
        calls.append(args[0].shape)
        return _attention_as_the_kernel_computes_it(*args)

    monkeypatch.setattr(models.decode_attention_pallas, "decode_attention", attend)

    def each(flag):
        assert bool(calls) == (flag == "pallas")
    texts = _generated_texts(tmp_path, "--decode-attention", ("model", "pallas"), each)
    assert texts[0] == texts[1]


@pytest.mark.slow  # the command twice
def test_generate_command_passes_the_decode_mixer_to_the_layers(tmp_path, monkeypatch):
    """--decode-mixer pallas reaches every Mamba-2 mixer (the kernel replaced
    by its contract in jnp ops): greedy's text, as with XLA's ops."""
    calls = []

    def step(*args):
        calls.append(args[-1])
        return models.mamba_decode_pallas.mixer_step_xla(*args)

    monkeypatch.setattr(models.mamba_decode_pallas, "mixer_step", step)

    def each(flag):
        assert bool(calls) == (flag == "pallas")
    texts = _generated_texts(tmp_path, "--decode-mixer", ("xla", "pallas"), each, "mamba")
    assert texts[0] == texts[1]


def test_byte_tokens_round_trip():
    text = "naïve – ok"
    assert generate_cli.decode_text(generate_cli.encode(text)) == text


def _check_bf16_decoding_against_float32(name: str, prompt: np.ndarray, **overrides):
    """On one GPU: the bf16 decode loop's logits after ``prompt`` [batch,
    length] are as close to a float32 forward pass through XLA's ops (for
    Mamba-2 its SSD and norm, not the Pallas kernels) as the bf16 forward
    pass's own."""
    model_cls, config = MODELS[name]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]).reshape(1, 1),
                             ("data", "tensor"))
    bf16 = build(model_cls, dataclasses.replace(config, dtype="bfloat16", **overrides), mesh)
    if isinstance(config, models.MambaConfig):  # the reference runs none of the kernels
        config = dataclasses.replace(config, ssd_impl="xla", norm_backward="autodiff")
    exact = build(model_cls, config, mesh, nnx.state(bf16))
    with jax.set_mesh(mesh):
        tokens, logits = models.generate(bf16, prompt, NEW_TOKENS, return_logits=True)
    tokens = np.asarray(tokens)
    length = prompt.shape[1]
    assert_as_accurate(np.asarray(logits, np.float32),
                       _forward_logits(bf16, mesh, tokens, length).astype(np.float32),
                       _forward_logits(exact, mesh, tokens, length), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("decode_matmul", models.DECODE_MATMUL_IMPLS)
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_decoding_is_as_accurate_as_the_forward_pass(name, decode_matmul):
    """On one GPU (cuDNN attention for the Transformer), with XLA's decode
    matmuls and the library's kernel."""
    _check_bf16_decoding_against_float32(name, _prompt(3), decode_matmul=decode_matmul)


@pytest.mark.gpu
def test_bf16_decoding_through_the_attention_kernel_is_as_accurate():
    """The Transformer with decode_attention="pallas", compiled, against a
    float32 forward pass, as the model's own attention is held."""
    _check_bf16_decoding_against_float32("transformer", _prompt(5), decode_attention="pallas")


@pytest.mark.gpu
def test_the_attention_kernel_updates_the_kv_cache_in_place():
    """The compiled loop with the kernel copies no layer's cache: the
    kernel's outputs alias the donated caches."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]).reshape(1, 1),
                             ("data", "tensor"))
    hlo, model, generator = _compiled_decode_loop("transformer", mesh,
                                                  decode_attention="pallas")
    config = model.config
    _assert_never_copied(hlo, f"bf16[1,{config.num_kv_heads},{generator.shape.cache_len},"
                              f"{config.head_dim}]")


@pytest.mark.gpu
@pytest.mark.parametrize("decode_mixer", ["xla", "pallas"])
def test_bf16_mamba_decoding_is_as_accurate_with_either_mixer(decode_mixer):
    """Mamba-2's decode step through XLA's ops and through the mixer kernel,
    compiled, against a float32 forward pass."""
    _check_bf16_decoding_against_float32("mamba", _prompt(6), decode_mixer=decode_mixer)


@pytest.mark.gpu
def test_the_mixer_kernel_updates_the_states_in_place():
    """The compiled loop with the kernel copies no layer's SSM state or
    convolution ring: the kernel's outputs alias the donated states."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]).reshape(1, 1),
                             ("data", "tensor"))
    hlo, model, _ = _compiled_decode_loop("mamba", mesh, decode_mixer="pallas")
    config = model.config
    hpg = config.num_heads // config.num_groups
    _assert_never_copied(hlo, f"f32[1,{config.num_groups},{hpg},{config.head_dim},"
                              f"{config.state_dim}]")
    channels = config.num_groups * (hpg * config.head_dim + 2 * config.state_dim)
    _assert_never_copied(hlo, f"bf16[{config.conv_width},1,{channels}]")


@pytest.mark.gpu
def test_mamba_prefill_through_the_norm_kernel_is_as_accurate():
    """A prompt of batch x length >= norm_pallas.AUTO_MIN_ROWS: prefill runs
    every gated norm as the Pallas kernel (norm_backward="auto"), decoding
    then XLA's ops, from the states prefill left."""
    length = models.norm_pallas.AUTO_MIN_ROWS // 2 + 5  # 2 sequences: past the threshold
    assert MODELS["mamba"][1].norm_backward == "auto"
    _check_bf16_decoding_against_float32("mamba", _prompt(4, length=length))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("impl", ["cuda", "auto"])
def test_two_gpu_decoding_matches_xla(impl):
    """TP=2 in one process: the decode all-reduces on the CUDA kernels give
    the tokens and (to bf16 rounding) the logits of impl="xla"."""
    model_cls, config = MODELS["transformer"]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:2]).reshape(1, 2),
                             ("data", "tensor"))
    config = dataclasses.replace(config, dtype="bfloat16")
    xla = build(model_cls, dataclasses.replace(config, impl="xla"), mesh)
    fused = build(model_cls, dataclasses.replace(config, impl=impl), mesh, nnx.state(xla))
    prompt = _prompt(4)
    with jax.set_mesh(mesh):
        want_tokens, want = models.generate(xla, prompt, NEW_TOKENS, return_logits=True)
        tokens, logits = models.generate(fused, prompt, NEW_TOKENS, return_logits=True)
    jfo.check_device_errors()
    np.testing.assert_array_equal(np.asarray(tokens)[:, :PROMPT_LEN + 1],
                                  np.asarray(want_tokens)[:, :PROMPT_LEN + 1])
    assert_close(np.asarray(logits)[:, 0], f64(want)[:, 0], "bfloat16")


def _compiled_decode_loop(name: str, mesh, **overrides):
    """(the optimized HLO of ``name``'s bf16 decode loop on ``mesh``, batch 1,
    the model, its Generator)."""
    model_cls, config = MODELS[name]
    model = build(model_cls, dataclasses.replace(config, dtype="bfloat16", **overrides), mesh)
    with jax.set_mesh(mesh):
        generator = models.Generator(model, batch=1, prompt_len=PROMPT_LEN,
                                     max_new_tokens=NEW_TOKENS)
        return generator.decode_steps(NEW_TOKENS - 1).as_text(), model, generator


def _assert_never_copied(hlo: str, shape: str) -> None:
    """A buffer of ``shape`` (e.g. "bf16[1,2,17,16]") is in the program and never copied."""
    assert f"= {shape}" in hlo
    copies = [line for line in hlo.splitlines() if f"= {shape}" in line and " copy(" in line]
    assert not copies, copies


def test_the_decode_loop_updates_the_kv_cache_in_place():
    """No copy of a layer's cache in the compiled loop: the cache is sized
    once by prefill, and each step writes its position into the donated buffer."""
    hlo, model, generator = _compiled_decode_loop("transformer", cpu_mesh(tp=2))
    config = model.config
    _assert_never_copied(hlo, f"bf16[1,{config.num_kv_heads // 2},{generator.shape.cache_len},"
                              f"{config.head_dim}]")


@pytest.mark.parametrize("name", slow_unless(["transformer"], list(MODELS)))
def test_meshes_with_explicit_axes(name, rng):
    """jax.make_mesh's default (Explicit axes) gives the tokens and logits of
    an Auto mesh."""
    model_cls, config = MODELS[name]
    state = nnx.state(_random_model(model_cls, config, rng))
    prompt = _prompt(int(rng.integers(1 << 30)))
    key = jax.random.key(1)
    results = []
    for mesh in (cpu_mesh(tp=2, dp=2), jax.make_mesh((2, 2), ("data", "tensor"))):
        model = build(model_cls, config, mesh, state)
        with jax.set_mesh(mesh):
            results.append([np.asarray(a) for a in models.generate(
                model, prompt, NEW_TOKENS, temperature=0.7, rng=key, return_logits=True)])
    assert jax.make_mesh((2, 2), ("data", "tensor")).are_all_axes_explicit
    (auto_tokens, auto_logits), (tokens, logits) = results
    np.testing.assert_array_equal(tokens, auto_tokens)
    np.testing.assert_allclose(logits, auto_logits, rtol=1e-5, atol=1e-5)


def test_generator_takes_the_prompt_shape_it_was_built_for(tiny):
    model, mesh = tiny
    with jax.set_mesh(mesh):
        generator = models.Generator(model, batch=2, prompt_len=8, max_new_tokens=4)
        with pytest.raises(ValueError, match=r"generate: prompt has shape \(2, 6\), this "
                                             r"generator takes \(2, 8\)"):
            generator.prefill(jnp.zeros((2, 6), jnp.int32))
