"""The training command: learning, checkpoints, profiles, flags, and the CPU fallback."""

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import missing_path_in

from jax_flashoverlap import dispatch, models
from jax_flashoverlap.cli import train
from jax_flashoverlap.cli.data import batch_at, load_corpus

STEPS = 24
RUN = ["--size", "tiny", "--batch", "4", "--seq-len", "64", "--lr", "3e-3", "--no-progress"]


@pytest.fixture(scope="module")
def transformer_run(tmp_path_factory):
    """A short (2 x 2)-mesh run that checkpoints and profiles."""
    tmp = tmp_path_factory.mktemp("run")
    args = train.parse_args([*RUN, "--model", "transformer", "--mesh", "2x2",
                             "--steps", str(STEPS), "--checkpoint-dir", str(tmp / "ckpt"),
                             "--profile", str(tmp / "profile")])
    return args, train.train(args)


def _decreases(losses):
    # Byte-level loss starts near ln(256) = 5.5; a few dozen steps reach ~3.
    return np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0


def test_transformer_loss_decreases(transformer_run):
    _, result = transformer_run
    assert len(result.losses) == STEPS and np.all(np.isfinite(result.losses))
    assert _decreases(result.losses), result.losses


@pytest.mark.slow  # a second training run; transformer_run is the default's
def test_mamba_loss_decreases():
    args = train.parse_args([*RUN, "--model", "mamba", "--mesh", "1x4", "--impl", "decomposed",
                             "--steps", str(STEPS)])
    result = train.train(args)
    assert _decreases(result.losses), result.losses


def test_the_step_lowers_inside_the_models_auto_xla_ops(monkeypatch):
    """Mamba-2 leaves matmul_reduce_scatter to XLA under "auto": its first step
    (where jit lowers it) runs inside dispatch.prefer_xla of those ops."""
    entered = []

    @contextlib.contextmanager
    def recording(ops):
        entered.append(tuple(ops))
        yield

    monkeypatch.setattr(dispatch, "prefer_xla", recording)
    args = train.parse_args([*RUN, "--model", "mamba", "--mesh", "1x2", "--steps", "1"])
    trainer = train.build(args)
    corpus = load_corpus(None, args.seq_len)
    with jax.set_mesh(trainer.mesh):
        trainer.step(trainer.state, trainer.tokens(corpus, 0))
    assert entered == [("matmul_reduce_scatter",)]
    assert models.MambaConfig().auto_xla_ops == ("matmul_reduce_scatter",)
    assert models.TransformerConfig().auto_xla_ops == ()


def test_auto_xla_ops_must_name_ops():
    with pytest.raises(ValueError, match=r"MambaConfig: auto_xla_ops \['reduce_scatter'\] are "
                                         r"not ops.*matmul_reduce_scatter"):
        models.MambaConfig(auto_xla_ops=("reduce_scatter",))


def test_checkpoint_round_trip(transformer_run):
    """Restoring the final checkpoint gives back exactly the final parameters."""
    args, result = transformer_run
    restored = train.train(argparse.Namespace(**{**vars(args), "restore": True}))
    assert restored.start_step == STEPS and restored.losses == []
    saved, back = jax.tree.leaves(result.state), jax.tree.leaves(restored.state)
    assert len(saved) == len(back)
    for a, b in zip(saved, back):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_profile_names_the_ops(transformer_run):
    args, _ = transformer_run
    traces = list(Path(args.profile).rglob("*.xplane.pb"))
    assert traces, f"no trace under {args.profile}"
    data = b"".join(p.read_bytes() for p in traces)
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        assert f"jax_flashoverlap.{op}".encode() in data


def test_summary_reports_throughput(transformer_run):
    _, result = transformer_run
    summary = result.summary
    assert summary["tokens_per_s"] > 0 and summary["mfu"] is None  # no GPU: MFU n/a
    assert summary["params"] > 0 and summary["final_loss"] == result.losses[-1]


def test_traced_steps_stay_out_of_the_step_time(transformer_run):
    """Steps 1-3 are traced and step 4 starts on an idle device after the
    trace: the median is over steps 5..23."""
    _, result = transformer_run
    summary = result.summary
    assert summary["traced_steps_untimed"] and summary["timed_steps"] == STEPS - 5
    expected = np.median(result.step_times[5:])
    assert summary["tokens_per_s"] == pytest.approx(4 * 64 / expected)


def test_a_run_without_profile_starts_no_trace(tmp_path):
    """A profiler session left open would make the next start_trace raise."""
    args = train.parse_args([*RUN, "--model", "transformer", "--mesh", "1x2", "--steps", "2"])
    train.train(args)
    jax.profiler.start_trace(str(tmp_path))  # raises if the run left a trace open
    jax.profiler.stop_trace()
    assert list(tmp_path.rglob("*.xplane.pb")), "the fresh trace wrote nothing"


def test_bad_flags_name_the_fix():
    with pytest.raises(SystemExit):
        train.parse_args(["--mesh", "2by4"])
    with pytest.raises(SystemExit):
        train.parse_args(["--restore"])
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "mamba", "--attention", "cudnn"])
    with pytest.raises(ValueError, match="attention_impl='cudnn' but cuDNN attention needs a "
                                         "CUDA GPU"):
        train.build(train.parse_args([*RUN, "--attention", "cudnn"]))
    with pytest.raises(ValueError, match="needs 16 devices"):
        train.train(train.parse_args([*RUN, "--mesh", "4x4"]))
    with pytest.raises(ValueError, match="sequence length 30 does not divide by the 4"):
        train.train(train.parse_args([*RUN, "--mesh", "1x4", "--seq-len", "30"]))


@pytest.mark.slow  # the command in a fresh process
def test_command_runs_on_cpu_devices(tmp_path):
    """``python -m jax_flashoverlap.cli.train`` gives itself 8 CPU devices and says so."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.cli.train", "--steps", "2", "--batch", "4",
         "--seq-len", "32", "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh 4x2 (data x tensor) of 8 CPU devices (no GPU found)" in out.stdout
    assert "sequence parallelism, attention xla" in out.stdout
    assert "done: 2 steps of transformer/tiny" in out.stdout


def test_the_commands_without_the_models_extra_name_it(tmp_path):
    """Installed without [models], the train and generate commands say which
    extra to install instead of failing on a bare import."""
    code = "import sys; sys.modules['flax'] = None; import jax_flashoverlap.cli.generate"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert ("flax is not installed: the models and the train and generate commands need the "
            "'models' extra: pip install 'jax-flashoverlap[models]'") in proc.stderr


def test_library_notes_print_above_the_progress_bar(capsys):
    """A warning of the library's logger during training (e.g. "auto" finding
    no tuning table) starts its own line, instead of being appended to the
    bar's line."""
    import logging
    from types import SimpleNamespace

    from jax_flashoverlap.cli.progress import TrainingProgress

    trainer = SimpleNamespace(args=SimpleNamespace(progress=True, steps=3, batch=1, seq_len=8),
                              flops_per_step=1.0, peak_flops=None)
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)  # as orbax's absl gives the root logger
    root.addHandler(console)
    try:
        progress = TrainingProgress(trainer, 0)
        progress.finished(jnp.float32(1.0), jnp.float32(0.5))
        logging.getLogger("jax_flashoverlap").warning("a note from the library")
        progress.close()
    finally:
        root.removeHandler(console)
    err = capsys.readouterr().err
    assert "train:" in err and err.count("a note from the library") == 1, err
    before = err[:err.index("a note from the library")]
    assert before.rsplit("\r", 1)[-1].rsplit("\n", 1)[-1] == "", repr(before[-200:])


@pytest.mark.parametrize("flags, check", [
    (["--dtype", "bfloat16"], lambda t: t.config.dtype == "bfloat16"),
    (["--remat"], lambda t: t.config.remat),
    (["--unroll-layers"], lambda t: t.config.scan_layers is False),
    (["--no-sequence-parallel"], lambda t: not t.config.sharding.sequence_parallel),
], ids=["dtype", "remat", "unroll-layers", "no-sequence-parallel"])
def test_model_flags_reach_the_config(flags, check):
    trainer = train.build(train.parse_args([*RUN, "--mesh", "1x2", "--steps", "2", *flags]))
    assert check(trainer)


def test_seed_picks_the_parameters_and_the_batches():
    def first_kernel(seed):
        trainer = train.build(train.parse_args([*RUN, "--mesh", "1x2", "--seed", str(seed)]))
        return np.asarray(jax.tree.leaves(trainer.state[0])[0])

    assert np.array_equal(first_kernel(1), first_kernel(1))
    assert not np.array_equal(first_kernel(1), first_kernel(2))
    corpus = np.arange(1000, dtype=np.uint8)
    batches = [batch_at(corpus, 3, batch=2, seq_len=8, seed=s) for s in (1, 1, 2)]
    assert np.array_equal(batches[0], batches[1]) and not np.array_equal(batches[0], batches[2])


def test_data_flag_reads_the_file(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes(bytes(range(256)) * 4)
    assert np.array_equal(load_corpus(data, 64)[:256], np.arange(256))
    data.write_bytes(b"short")
    with pytest.raises(ValueError,
                       match=r"corpus.txt: 5 bytes, need more than --seq-len \+ 1 = 65"):
        load_corpus(data, 64)


def test_optimizer_flags_warmup_weight_decay_and_clip():
    """Zero gradients: the update is the weight decay alone, on matrices only,
    at the learning rate the warmup has reached; a tiny clip shrinks what
    adam makes of a gradient below its epsilon."""
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    zeros = jax.tree.map(jnp.zeros_like, params)

    def updates(flags, grads, steps):
        tx = train._optimizer(train.parse_args([*RUN, "--steps", "10", *flags]))
        state = tx.init(params)
        for _ in range(steps):
            out, state = tx.update(grads, state, params)
        return out

    first = updates(["--warmup", "1", "--weight-decay", "0.5"], zeros, 1)
    assert float(jnp.abs(first["w"]).max()) == 0.0  # lr 0 at the warmup's start
    after = updates(["--warmup", "1", "--weight-decay", "0.5"], zeros, 2)
    np.testing.assert_allclose(after["w"], -3e-3 * 0.5 * np.ones((2, 2)), rtol=1e-5)
    assert float(jnp.abs(after["b"]).max()) == 0.0  # no decay on vectors
    grads = {"w": jnp.full((2, 2), 1e-3), "b": jnp.full((2,), 1e-3)}
    free = updates(["--warmup", "1", "--weight-decay", "0", "--clip", "1.0"], grads, 2)
    clipped = updates(["--warmup", "1", "--weight-decay", "0", "--clip", "1e-12"], grads, 2)
    assert float(jnp.abs(clipped["w"]).max()) < 1e-2 * float(jnp.abs(free["w"]).max())


def test_restore_takes_the_directory_as_generate_does(tmp_path):
    """`--restore DIR` is `--checkpoint-dir DIR --restore`."""
    for argv in (["--restore", str(tmp_path)],
                 ["--checkpoint-dir", str(tmp_path), "--restore"],
                 ["--restore", str(tmp_path), "--checkpoint-dir", str(tmp_path)]):
        args = train.parse_args([*RUN, *argv])
        assert args.restore is True and args.checkpoint_dir == tmp_path, argv
    assert train.parse_args(RUN).restore is None


@pytest.mark.slow  # three training runs
def test_checkpoint_every_saves_on_schedule(tmp_path, capsys):
    args = train.parse_args([*RUN, "--mesh", "1x2", "--steps", "3", "--checkpoint-dir",
                             str(tmp_path), "--checkpoint-every", "2"])
    train.train(args)
    saved = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
    assert saved == [2, 3]  # every 2 steps, and the last
    # A fresh run into the same directory would mix two runs' steps (and,
    # with as many steps, not save at all): refused, naming --restore.
    assert train.main([*RUN, "--mesh", "1x2", "--steps", "3", "--seed", "7",
                       "--checkpoint-dir", str(tmp_path)]) == 2
    assert (f"--checkpoint-dir {tmp_path} already holds a checkpoint (step 3): pass --restore "
            f"to continue that run, or give an empty directory") in capsys.readouterr().err
    # Resuming it as another model: one line naming the likely cause.
    assert train.main([*RUN, "--mesh", "1x2", "--steps", "4", "--model", "mamba",
                       "--restore", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"--restore: the checkpoint of step 3 in {tmp_path} does not fit this mamba: was it "
            f"written for another model or size (--model, --size)?") in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "3x3"], "jax-flashoverlap-train: error: --mesh 3x3 needs 9 devices; there are 8"),
    (["--data", "MISSING"], "--data MISSING: no such file"),
    (["--mesh", "0x2"], "--mesh '0x2': sizes must be positive"),
    (["--mesh", "2by4"], "--mesh '2by4': expected DATAxTENSOR, e.g. 4x2"),
    (["--restore"], "--restore needs a directory: --restore DIR, or --checkpoint-dir DIR"),
    (["--restore", "a", "--checkpoint-dir", "b"],
     "--restore a and --checkpoint-dir b: a run resumes from and saves to one directory"),
    (["--model", "transformer", "--ssd", "pallas"], "--ssd applies to --model mamba, not "
                                                     "transformer"),
    (["--model", "mamba", "--attention", "xla"], "--attention applies to --model transformer, "
                                                 "not mamba"),
])
def test_bad_flags_and_files_get_one_line_errors(argv, message, capsys, tmp_path):
    argv, message = missing_path_in(argv, message, tmp_path)
    try:
        status = train.main([*RUN, "--steps", "1", *argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_shows_the_defaults(capsys):
    """Options show their defaults; switches do not (`--no-progress` would
    read "(default: True)")."""
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "peak learning rate (default: 0.001)" in text
    assert "global batch (sequences) (default: 8)" in text
    assert "no progress bar (the summary still prints)" in text
    assert "still prints) (default" not in text
    assert "(default: True)" not in text and "(default: False)" not in text
    for phrase in ("tokens per training sequence (default: 256)",
                   "implementation of the overlap ops (default: auto)",
                   "AdamW's decoupled weight decay (default: 0.1)",
                   "the batches' order (default: 0)", "a preset (default: tiny;",
                   "default: transformer, or the model of a Hugging Face checkpoint"):
        assert phrase in text, phrase


def test_every_command_documents_its_options(capsys):
    """Each option of generate and tune says what it is (and so its default)."""
    from jax_flashoverlap.cli import generate, tune

    for parse in (generate.parse_args, tune.parse_args):
        with pytest.raises(SystemExit):
            parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens to generate after the prompt (at least 1)" in text
    assert "the ops to measure (default:" in text
    assert "timed runs of each shape and impl (their median counts) (default: 3)" in text


def test_without_pydoc_data_the_corpus_names_data(monkeypatch):
    import importlib.util

    from jax_flashoverlap.cli import data

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="this Python ships no pydoc_data.topics; pass "
                                                "--data FILE"):
        data.default_corpus()
