"""Helpers of the model tests: one model's state on several meshes, loss and gradients."""

import dataclasses

import jax
import numpy as np
from flax import nnx
from support import TOLERANCE, assert_close, cpu_mesh

from jax_flashoverlap.cli.train import loss_fn

BATCH, SEQ_LEN = 2, 32


def tokens(seed: int, batch: int = BATCH, seq_len: int = SEQ_LEN) -> np.ndarray:
    """Random byte tokens [batch, seq_len + 1] (inputs and shifted targets)."""
    return np.random.default_rng(seed).integers(0, 256, (batch, seq_len + 1), np.int32)


def build(model_cls, config, mesh, state=None):
    """``model_cls(config)`` on ``mesh``; with ``state``, holding exactly those values."""
    with jax.set_mesh(mesh):
        if state is None:
            return nnx.jit(lambda: model_cls(config, rngs=nnx.Rngs(0)))()
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model_cls(config,
                                                                        rngs=nnx.Rngs(0))))
        placed = jax.device_put(jax.tree.map(np.asarray, state),
                                nnx.get_named_sharding(abstract, mesh))
        return nnx.merge(graphdef, placed)


def loss_and_grads(model, batch, mesh):
    """(loss, gradient State) as numpy float64."""
    with jax.set_mesh(mesh):
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, batch)
    return np.float64(loss), jax.tree.map(lambda g: np.asarray(g, np.float64), nnx.state(grads))


def reference(model_cls, config, seed, seq_len: int = SEQ_LEN):
    """The TP=1 single-device model: its state, a batch, its loss and gradients."""
    mesh = cpu_mesh(tp=1)
    model = build(model_cls, config, mesh)
    batch = tokens(seed, seq_len=seq_len)
    return nnx.state(model), batch, *loss_and_grads(model, batch, mesh)


def check_matches_reference(model_cls, config, ref, *, tp: int, dp: int = 2, **overrides):
    """The model at (dp, tp) with the reference's parameters gives its loss and gradients."""
    state, batch, ref_loss, ref_grads = ref
    mesh = cpu_mesh(tp=tp, dp=dp)
    model = build(model_cls, dataclasses.replace(config, **overrides), mesh, state)
    loss, grads = loss_and_grads(model, batch, mesh)
    assert_close(loss, ref_loss, "float32")
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)]
    for path, got, want in zip(paths, jax.tree.leaves(grads), jax.tree.leaves(ref_grads),
                               strict=True):
        try:
            assert_close(got, want, "float32")
        except AssertionError as e:
            raise AssertionError(f"gradient of {path}: {e}") from None


def check_is_causal(model_cls, config):
    """Changing token 20 leaves the logits of positions < 20 exactly as they were."""
    mesh = cpu_mesh(tp=2, dp=2)
    model = build(model_cls, config, mesh)
    batch = tokens(1)[:, :-1]
    changed = batch.copy()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with jax.set_mesh(mesh):
        before, after = (np.asarray(nnx.jit(lambda m, t: m(t))(model, t)) for t in (batch, changed))
    np.testing.assert_array_equal(before[:, :20], after[:, :20])
    assert np.abs(before[:, 20:] - after[:, 20:]).max() > 0


def logits_of(model, tokens) -> np.ndarray:
    """The model's logits on ``tokens`` [b, s] (under the current mesh), float64."""
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens), np.float64)


def params_of(model) -> dict:
    """The model's parameters by path, as numpy arrays."""
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def relative_error(got, want) -> float:
    """||got - want|| / ||want||."""
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_matches_transformers(fixture, tp: int, **overrides) -> None:
    """A checkpoint that ``transformers`` made (tests/data/make_*_fixtures.py),
    loaded at tensor size ``tp``: the prompts' float32 logits within 1e-4
    relative of its own, and 32 greedy tokens (prefill, then the decode
    loop) identical to its own."""
    import jax.numpy as jnp
    from jax_flashoverlap.models import from_pretrained, generate

    expected = np.load(fixture / "expected.npz")
    prompts = jnp.asarray(expected["prompts"], jnp.int32)
    with jax.set_mesh(cpu_mesh(tp=tp)):
        model = from_pretrained(fixture, impl="xla", **overrides)
        logits = logits_of(model, prompts)
        tokens = np.asarray(generate(model, prompts, max_new_tokens=32))
    err = relative_error(logits, expected["logits"].astype(np.float64))
    assert err < 1e-4, err
    np.testing.assert_array_equal(tokens, expected["greedy"])


def check_bfloat16_decode(fixture, mesh, load: dict, **decode) -> tuple[float, float]:
    """A checkpoint that ``transformers`` made, on ``mesh``: in float32 its
    prompts' logits within 1e-4 relative of its own; in bfloat16 (``decode``:
    the config fields of the decode path, such as ``decode_blocks``), the
    logits of each generated token within twice the error of the same
    model's bfloat16 forward pass over the same tokens (at least the
    bfloat16 tolerance), both against the float32 forward pass. ``load``:
    from_pretrained's overrides for both models.

    Returns (the decode loop's error, the bfloat16 forward pass's).
    """
    import jax.numpy as jnp
    from jax_flashoverlap.models import from_pretrained, generate

    expected = np.load(fixture / "expected.npz")
    prompts = jnp.asarray(expected["prompts"], jnp.int32)
    new = expected["greedy"].shape[1] - prompts.shape[1]
    with jax.set_mesh(mesh):
        exact = from_pretrained(fixture, dtype="float32", impl="xla", **load)
        assert relative_error(logits_of(exact, prompts),
                              expected["logits"].astype(np.float64)) < 1e-4
        model = from_pretrained(fixture, dtype="bfloat16", impl="xla", **load, **decode)
        tokens, logits = generate(model, prompts, max_new_tokens=new, return_logits=True)
        tokens, logits = np.asarray(tokens), np.asarray(logits, np.float64)
        np.testing.assert_array_equal(tokens[:, prompts.shape[1]:], logits.argmax(-1))
        # The logits that chose token i come from position prompt_len - 1 + i.
        chosen = slice(prompts.shape[1] - 1, tokens.shape[1] - 1)
        reference = logits_of(exact, jnp.asarray(tokens))[:, chosen]
        forward = logits_of(model, jnp.asarray(tokens))[:, chosen]
    errors = relative_error(logits, reference), relative_error(forward, reference)
    assert errors[0] <= max(2 * errors[1], TOLERANCE["bfloat16"]), errors
    return errors


def fine_tune_checkpoint(checkpoint, tmp_path, *, steps: int, **load):
    """``jax-flashoverlap-train --init-from checkpoint --save-pretrained
    tmp_path/out`` for ``steps`` steps (batch 2 of 16 tokens, mesh 1x2) on
    400 random words "w<i>" of its tokenizer (tests/support.py's
    with_word_tokenizer). ``load``: from_pretrained's overrides for the
    checks at tensor size 1.

    Returns a namespace: ``args`` (parsed), ``first_loss`` (the run's step
    0), ``loaded_loss`` (step 0's batch through the checkpoint as loaded),
    ``loaded`` and ``trained`` (params_of the checkpoint and of out).
    """
    import types

    import jax.numpy as jnp
    from jax_flashoverlap.models import from_pretrained, pretrained_config

    from jax_flashoverlap.cli import train as train_cli

    vocab = pretrained_config(checkpoint).vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, 400)
    (tmp_path / "data.txt").write_text(" ".join(f"w{i}" for i in ids))
    args = train_cli.parse_args([
        "--init-from", str(checkpoint), "--save-pretrained", str(tmp_path / "out"),
        "--data", str(tmp_path / "data.txt"), "--steps", str(steps), "--batch", "2",
        "--seq-len", "16", "--mesh", "1x2", "--no-progress", "--lr", "1e-2"])
    result = train_cli.train(args)
    first = train_cli.batch_at(ids, 0, batch=2, seq_len=16, seed=0)
    with jax.set_mesh(cpu_mesh(tp=1)):
        loaded = from_pretrained(checkpoint, **load)
        logits = logits_of(loaded, jnp.asarray(first[:, :-1]))
        trained = from_pretrained(tmp_path / "out", **load)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return types.SimpleNamespace(
        args=args, first_loss=result.losses[0],
        loaded_loss=-np.take_along_axis(logp, first[:, 1:, None], -1).mean(),
        loaded=params_of(loaded), trained=params_of(trained))
