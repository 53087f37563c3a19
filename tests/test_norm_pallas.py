"""The fused gated RMSNorm kernels against XLA's ops: in Pallas's
interpreter on CPU, compiled on GPUs."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_support import build, tokens
from support import (
    assert_as_accurate,
    assert_close,
    cpu_mesh,
    data_parallel_grad_lowered_for_h200,
    f64,
    random,
)

from jax_flashoverlap import models

norm_pallas = models.norm_pallas


def _check(shape, group_size, gated, dtype, rng, interpret):
    """Output and gradients of x, the gate and the weight against
    ``layers.rms_norm``'s XLA ops; in bf16, both against XLA's float32 run on
    the same inputs, the kernels no less accurate than XLA's."""
    x = random(rng, shape, dtype)
    gate = random(rng, shape, dtype) if gated else None
    weight = 1.0 + 0.1 * random(rng, shape[-1:], "float32")
    probe = random(rng, shape, "float32")

    def loss(norm, x, gate, weight):
        y = norm(x, gate, weight)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    def reference(x, gate, weight):
        return models.layers.rms_norm(x, weight, eps=1e-5, group_size=group_size, gate=gate)

    def fused(x, gate, weight):
        return norm_pallas.gated_rms_norm(x, gate, weight, eps=1e-5, group_size=group_size,
                                          interpret=interpret)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (_, want), want_grads = grad(reference, x, gate, weight)
    (_, got), got_grads = grad(fused, x, gate, weight)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert [None if g is None else g.dtype for g in got_grads] == \
        [None if g is None else g.dtype for g in want_grads]
    if dtype == "bfloat16":
        exact_inputs = (x.astype(jnp.float32), None if gate is None else gate.astype(jnp.float32),
                        weight)
        (_, exact), exact_grads = grad(reference, *exact_inputs)
        assert_as_accurate((got, got_grads), (want, want_grads), (exact, exact_grads), dtype)
        return
    assert_close(got, f64(want), dtype)
    for name, g, w in zip(("x", "gate", "weight"), got_grads, want_grads):
        if w is None:
            assert g is None, name
            continue
        try:
            assert_close(g, f64(w), dtype)
        except AssertionError as e:
            raise AssertionError(f"gradient of {name}: {e}") from None


@pytest.mark.parametrize("shape, group_size", [
    ((64, 2, 128), 32),    # whole blocks of rows, four groups
    ((37, 3, 64), 64),     # rows padded up to a block, one group
], ids=["groups", "padded"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpreted_kernels_equal_xla(shape, group_size, gated, dtype, rng):
    _check(shape, group_size, gated, dtype, rng, interpret=True)


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_interpreted_kernels_equal_xla_at_any_rows_per_program(rows, rng):
    """37 x 3 rows: a last block padded for every choice but one row."""
    x, gate = random(rng, (37, 3, 64), "float32"), random(rng, (37, 3, 64), "float32")
    weight = 1.0 + 0.1 * random(rng, (64,), "float32")

    def grads(norm):
        return jax.jit(jax.value_and_grad(lambda *t: jnp.sum(jnp.sin(norm(*t))),
                                          argnums=(0, 1, 2)))(x, gate, weight)

    got = grads(lambda *t: norm_pallas.gated_rms_norm(*t, eps=1e-5, group_size=32, rows=rows,
                                                      num_warps=4, interpret=True))
    want = grads(lambda x, g, w: models.layers.rms_norm(x, w, eps=1e-5, group_size=32, gate=g))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, f64(w), "float32")


@pytest.mark.parametrize("name, value", [("rows", 3), ("rows", 0), ("num_warps", 6)])
def test_tiling_must_be_powers_of_two(name, value):
    with pytest.raises(ValueError, match=rf"norm_pallas.gated_rms_norm: {name}={value} must be "
                                         rf"a power of two from 1"):
        norm_pallas.gated_rms_norm(jnp.zeros((4, 64)), None, jnp.ones(64), eps=1e-5,
                                   interpret=True, **{name: value})


def test_rms_norm_dispatches_to_the_kernels(monkeypatch, rng):
    calls = []
    real = norm_pallas.gated_rms_norm

    def spy(*args, **kwargs):
        calls.append(kwargs["group_size"])
        return real(*args, **kwargs, interpret=True)

    monkeypatch.setattr(norm_pallas, "gated_rms_norm", spy)
    x, gate = random(rng, (16, 64), "float32"), random(rng, (16, 64), "float32")
    weight = jnp.ones(64)
    got = models.layers.rms_norm(x, weight, eps=1e-5, group_size=32, gate=gate,
                                 backward="pallas")
    want = models.layers.rms_norm(x, weight, eps=1e-5, group_size=32, gate=gate)
    assert calls == [32]
    assert_close(got, f64(want), "float32")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_auto_runs_xla_on_cpu_keeping_only_the_inputs(gated, rng, monkeypatch):
    """"auto" off a GPU: XLA's ops in a custom_vjp, the same values and
    gradients as autodiff's; a group size the kernels do not take is autodiff."""
    monkeypatch.setattr(norm_pallas, "AUTO_MIN_ROWS", 1)
    x, gate = random(rng, (24, 2, 96), "float32"), random(rng, (24, 2, 96), "float32")
    gate = gate if gated else None
    weight = 1.0 + 0.1 * random(rng, (96,), "float32")

    def run(backward, group_size):
        def loss(x, gate, weight):
            y = models.layers.rms_norm(x, weight, eps=1e-5, group_size=group_size, gate=gate,
                                       backward=backward)
            return jnp.sum(y * jnp.cos(y))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, gate, weight)

    for group_size in (32, 48):   # kernels' shape, and one they do not take
        (got, got_grads), (want, want_grads) = run("auto", group_size), run("autodiff", group_size)
        assert_close(got, f64(want), "float32")
        for g, w in zip(got_grads, want_grads):
            assert (g is None) == (w is None)
            if w is not None:
                assert_close(g, f64(w), "float32")

    def kept(backward):
        """Elements the vjp keeps for the backward at the kernels' group size."""
        _, vjp = jax.vjp(lambda *t: models.layers.rms_norm(
            t[0], t[2], eps=1e-5, group_size=32, gate=t[1], backward=backward), x, gate, weight)
        return sum(leaf.size for leaf in jax.tree.leaves(vjp))
    inputs = x.size + weight.size + (0 if gate is None else gate.size)
    assert kept("auto") <= inputs < kept("autodiff"), (kept("auto"), kept("autodiff"))
    with pytest.raises(ValueError, match=r"norm_pallas.gated_rms_norm_or: group size 48 is not "
                                         r"a power of two from 16"):
        norm_pallas.gated_rms_norm_or(models.layers._rms_norm_output, x, gate, weight,
                                      eps=1e-5, group_size=48)


@pytest.mark.parametrize("rows", [norm_pallas.AUTO_MIN_ROWS, 8])
def test_auto_lowers_the_kernels_for_cuda_from_enough_rows(rows, monkeypatch):
    """Training's and prefill's thousands of rows take the kernels; a decode
    step's few keep XLA's ops."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    args = [jax.ShapeDtypeStruct((rows, 1, 1024), jnp.bfloat16)] * 2 + \
        [jax.ShapeDtypeStruct((1024,), jnp.float32)]

    def grads(x, gate, weight):
        return jax.grad(lambda *t: jnp.sum(models.layers.rms_norm(
            t[0], t[2], eps=1e-5, group_size=512, gate=t[1], backward="auto")
            .astype(jnp.float32)), argnums=(0, 1, 2))(x, gate, weight)

    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("gated_rms_norm", "gated_rms_norm_backward"):
        assert (kernel in text) == (rows >= norm_pallas.AUTO_MIN_ROWS), kernel


def test_weight_gradient_sums_over_the_data_axis(monkeypatch):
    """Inside shard_map the weight is the same on every data shard while x
    differs: its gradient must come back of the weight's type and summed over
    the shards. Lowered for a GPU; test_mamba_trains_alike_with_either_norm
    runs it."""
    args = [jax.ShapeDtypeStruct((512, 4, 1024), jnp.bfloat16)] * 2 + \
        [jax.ShapeDtypeStruct((1024,), jnp.float32)]
    traced, text = data_parallel_grad_lowered_for_h200(
        monkeypatch, functools.partial(norm_pallas.gated_rms_norm, eps=1e-5, group_size=512),
        args, (jax.P(None, "data"), jax.P(None, "data"), jax.P()))
    assert [g.shape for g in traced.out_info] == [a.shape for a in args]
    assert "gated_rms_norm_backward" in text
    assert text.count("stablehlo.all_reduce") == 1, text.count("stablehlo.all_reduce")


@pytest.mark.parametrize("dim, group_size, message", [
    (96, 48, "group size 48 is not a power of two from 16"),
    (96, 8, "group size 8 is not a power of two from 16"),
    (96, 64, "dim=96 is not a multiple of the group size 64"),
])
def test_unsupported_groups(dim, group_size, message):
    assert norm_pallas.unsupported_reason(dim, group_size) == message
    with pytest.raises(ValueError, match=message + "; use norm_backward='autodiff' or "
                                                   "'recompute'"):
        norm_pallas.gated_rms_norm(jnp.zeros((4, dim)), None, jnp.ones(dim), eps=1e-5,
                                   group_size=group_size)


def test_a_gate_of_another_shape_is_an_error():
    with pytest.raises(ValueError, match=r"gate \(4, 32\) is not x's shape \(4, 64\)"):
        norm_pallas.gated_rms_norm(jnp.zeros((4, 64)), jnp.zeros((4, 32)), jnp.ones(64),
                                   eps=1e-5, interpret=True)


def test_compiled_kernels_need_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs only \(Pallas Triton\), and the "
                                         r"default backend is 'cpu'; use "
                                         r"norm_backward='autodiff' or 'recompute'"):
        norm_pallas.gated_rms_norm(jnp.zeros((8, 64)), None, jnp.ones(64), eps=1e-5)


def test_kernels_lower_to_triton_without_a_gpu(monkeypatch):
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    args = [jax.ShapeDtypeStruct((8192, 1, 4096), jnp.bfloat16)] * 2 + \
        [jax.ShapeDtypeStruct((4096,), jnp.float32)]

    def grads(*t):
        tiling = norm_pallas.Tiling(512, 16, 8)
        return jax.grad(lambda *u: jnp.sum(norm_pallas._norm(*u, 1e-5, tiling)
                                           .astype(jnp.float32)), argnums=(0, 1, 2))(*t)

    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("gated_rms_norm", "gated_rms_norm_backward"):
        assert kernel in text, kernel


def test_mamba_runs_every_gated_norm_through_the_kernels(monkeypatch):
    """norm_backward="auto" at training's rows, lowered for an H200: each
    block's gated norm is one backward kernel (its forward a kernel too,
    once more where the block is recomputed); the blocks' own norms stay
    XLA's."""
    from jax._src.pallas.triton import gpu_info

    from jax_flashoverlap.cli.train import loss_fn

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    config = models.MambaConfig.preset("tiny", scan_layers=False)
    assert config.norm_backward == "auto"
    mesh = cpu_mesh(tp=1)
    graphdef, state = nnx.split(build(models.Mamba2, config, mesh))
    batch = tokens(0, batch=1, seq_len=norm_pallas.AUTO_MIN_ROWS)

    def grads(state):
        return jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), batch))(state)

    with jax.set_mesh(mesh):
        text = jax.jit(grads).trace(state).lower(lowering_platforms=("cuda",)).as_text()
    calls = {k: len(re.findall(rf'name = "{k}"', text))
             for k in ("gated_rms_norm", "gated_rms_norm_backward")}
    assert calls["gated_rms_norm_backward"] == config.num_layers, calls
    assert calls["gated_rms_norm"] >= config.num_layers, calls


def test_mamba_config_and_flag_choose_the_kernels():
    from jax_flashoverlap.cli import train

    args = train.parse_args(["--model", "mamba", "--norm-backward", "pallas"])
    config = train.model_config("mamba", "tiny", norm_backward=args.norm_backward)
    assert config.norm_backward == "pallas"


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_equal_xla_on_gpu(gated, dtype, rng):
    """The 1.4B mixer's norm (groups of 512 of 4096 channels), rows padded."""
    _check((1000, 1, 4096), 512, gated, dtype, rng, interpret=False)


@pytest.mark.gpu
def test_mamba_trains_alike_with_either_norm():
    from jax_flashoverlap.cli import train

    losses = {}
    for norm in ("autodiff", "pallas", "auto"):
        args = train.parse_args(["--model", "mamba", "--size", "small", "--mesh", "1x1",
                                 "--batch", "2", "--seq-len", "512", "--steps", "5",
                                 "--norm-backward", norm, "--no-progress"])
        losses[norm] = np.asarray(train.train(args).losses)
    np.testing.assert_allclose(losses["pallas"], losses["autodiff"], rtol=3e-2)
    np.testing.assert_allclose(losses["auto"], losses["pallas"], rtol=1e-3)  # the same kernels
