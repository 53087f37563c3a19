"""The training command: learning, checkpoints, profiles, flags, and the CPU fallback."""

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_flashoverlap import dispatch, models, train

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
    corpus = train.load_corpus(None, args.seq_len)
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
    jax.profiler.start_trace(str(tmp_path))
    jax.profiler.stop_trace()


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


def test_command_runs_on_cpu_devices(tmp_path):
    """``python -m jax_flashoverlap.train`` gives itself 8 CPU devices and says so."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.train", "--steps", "2", "--batch", "4",
         "--seq-len", "32", "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh 4x2 (data x tensor) of 8 CPU devices (no GPU found)" in out.stdout
    assert "sequence parallelism, attention xla" in out.stdout
    assert "done: 2 steps of transformer/tiny" in out.stdout
