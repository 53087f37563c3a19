"""The fused causal convolution + SiLU kernel against XLA's ops: in Pallas's
interpreter on CPU, compiled on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import (
    assert_as_accurate,
    assert_close,
    data_parallel_grad_lowered_for_h200,
    f64,
    random,
)

from jax_flashoverlap import models

conv_pallas = models.conv_pallas


def _reference(x, weight, bias):
    return jax.nn.silu(models.mamba.causal_conv1d(x, weight, bias))


def _check(s, channels, dtype, rng, interpret):
    """Output and gradients against XLA's ops; in bf16, where XLA rounds too,
    both against XLA's float32 run on the same inputs, the fused kernel no
    less accurate than XLA's."""
    x = random(rng, (s, 2, channels), dtype)
    weight, bias = random(rng, (4, channels), dtype), random(rng, (channels,), dtype)
    probe = random(rng, (s, 2, channels), "float32")

    def loss(conv, *t):
        y = conv(*t)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    def fused(*t):
        return conv_pallas.causal_conv1d_silu(*t, interpret=interpret)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    with jax.default_matmul_precision("highest"):
        (_, want), want_grads = grad(_reference, x, weight, bias)
        (_, got), got_grads = grad(fused, x, weight, bias)
        (_, exact), exact_grads = grad(_reference, *(t.astype(jnp.float32)
                                                     for t in (x, weight, bias)))
    assert got.dtype == x.dtype
    if dtype == "bfloat16":
        assert_as_accurate((got, got_grads), (want, want_grads), (exact, exact_grads), dtype)
        return
    assert_close(got, f64(want), dtype)
    for name, g, w in zip(("x", "weight", "bias"), got_grads, want_grads):
        try:
            assert_close(g, f64(w), dtype)
        except AssertionError as e:
            raise AssertionError(f"gradient of {name}: {e}") from None


@pytest.mark.parametrize("s", [64, 100, 200], ids=["one_block", "padded", "three_blocks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpreted_kernel_equals_xla(s, dtype, rng):
    _check(s, 48, dtype, rng, interpret=True)


def test_parameter_gradients_sum_over_the_data_axis(monkeypatch):
    """Inside shard_map, weight and bias are the same on every data shard while x
    differs: their gradients must come back of the parameters' type (a
    custom_vjp may not return them data-varying) and summed over the shards.
    Lowered for a GPU; test_mamba_trains_alike_with_either_convolution runs it."""
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((512, 4, 256), (4, 256), (256,))]
    traced, text = data_parallel_grad_lowered_for_h200(
        monkeypatch, conv_pallas.causal_conv1d_silu, args,
        (jax.P(None, "data"), jax.P(), jax.P()))
    assert [g.shape for g in traced.out_info] == [a.shape for a in args]
    assert "causal_conv1d_silu_backward" in text
    # One sum over the shards for each parameter's gradient (grad drops the
    # loss's own psum: its value is not returned).
    assert text.count("stablehlo.all_reduce") == 2, text.count("stablehlo.all_reduce")


@pytest.mark.parametrize("channels, width, message", [
    (40, 4, "40 channels is not a multiple of 16"),
    (48, 3, "conv_width=3 is not a power of two"),
])
def test_unsupported_convolutions(channels, width, message):
    assert conv_pallas.unsupported_reason(channels, width) == message
    with pytest.raises(ValueError, match=message + "; use conv_impl='xla'"):
        conv_pallas.causal_conv1d_silu(jnp.zeros((8, 1, channels)), jnp.zeros((width, channels)),
                                       jnp.zeros((channels,)))


def test_compiled_kernel_needs_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs only \(Pallas Triton\), and the "
                                         r"default backend is 'cpu'; use conv_impl='xla'"):
        conv_pallas.causal_conv1d_silu(jnp.zeros((8, 1, 16)), jnp.zeros((4, 16)), jnp.zeros(16))


def test_kernels_lower_to_triton_without_a_gpu(monkeypatch):
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((8192, 1, 6144), (4, 6144), (6144,))]

    def grads(*t):
        return jax.grad(lambda *u: jnp.sum(conv_pallas._conv_silu(*u, False)
                                           .astype(jnp.float32)), argnums=(0, 1, 2))(*t)

    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("causal_conv1d_silu", "causal_conv1d_silu_backward"):
        assert kernel in text, kernel


def test_mamba_config_and_flag_choose_the_kernel(capsys):
    from jax_flashoverlap.cli import train

    with pytest.raises(ValueError, match=r"MambaConfig: conv_impl must be one of "
                                         r"\('xla', 'pallas'\), got 'triton'"):
        models.MambaConfig(conv_impl="triton")
    args = train.parse_args(["--model", "mamba", "--conv", "pallas"])
    assert train.model_config("mamba", "tiny", conv=args.conv).conv_impl == "pallas"
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "transformer", "--conv", "pallas"])
    assert "--conv applies to --model mamba, not transformer" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_equals_xla_on_gpu(dtype, rng):
    """The 1.4B layer's channels (6144 per rank at TP=1), a padded sequence."""
    _check(1000, 6144, dtype, rng, interpret=False)


@pytest.mark.gpu
def test_mamba_trains_alike_with_either_convolution():
    from jax_flashoverlap.cli import train

    losses = {}
    for conv in ("xla", "pallas"):
        args = train.parse_args(["--model", "mamba", "--size", "small", "--mesh", "1x1",
                                 "--batch", "2", "--seq-len", "512", "--steps", "5",
                                 "--conv", conv, "--no-progress"])
        losses[conv] = np.asarray(train.train(args).losses)
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=3e-2)


def test_a_mamba_with_the_kernel_says_it_needs_a_gpu():
    from model_support import build, tokens
    from support import cpu_mesh

    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    config = models.MambaConfig(conv_impl="pallas", max_seq_len=32)
    model = build(models.Mamba2, config, cpu_mesh(tp=1))
    with jax.set_mesh(cpu_mesh(tp=1)), pytest.raises(ValueError, match="CUDA GPUs only"):
        model(jnp.asarray(tokens(0, batch=1, seq_len=16)[:, :-1]))
