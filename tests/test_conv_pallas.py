"""The convolution's backward kernel (in_proj's split, the convolution and
its SiLU) against XLA's ops: in Pallas's interpreter on CPU, compiled on GPUs."""

import itertools

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
    slow_unless,
)

from jax_flashoverlap import models

conv_pallas = models.conv_pallas


def _inputs(rng, s, layout, groups, dtype, width=4):
    zxbcdt = random(rng, (s, 2, groups, layout.width), dtype)
    weight = random(rng, (width, groups * layout.conv_channels), dtype)
    return zxbcdt, weight, random(rng, (groups * layout.conv_channels,), dtype)


def _check(s, layout, groups, dtype, rng, interpret):
    """Outputs and gradients against XLA's ops (autodiff of the same
    forward); in bf16, where XLA rounds too, both against XLA's float32 run
    on the same inputs, the kernel no less accurate than XLA's ops."""
    inputs = _inputs(rng, s, layout, groups, dtype)
    probes = [random(rng, out.shape, "float32")
              for out in conv_pallas.split_conv_silu(*inputs, layout, impl="xla")]

    def loss(impl, *t):
        outs = conv_pallas.split_conv_silu(*t, layout, impl=impl, interpret=interpret)
        return sum(jnp.sum(o.astype(jnp.float32) * p) for o, p in zip(outs, probes)), outs

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    with jax.default_matmul_precision("highest"):
        (_, want), want_grads = grad("xla", *inputs)
        (_, got), got_grads = grad("pallas", *inputs)
        (_, exact), exact_grads = grad("xla", *(t.astype(jnp.float32) for t in inputs))
    assert [o.dtype for o in got] == [jnp.dtype(dtype)] * 5
    if dtype == "bfloat16":
        assert_as_accurate((got, got_grads), (want, want_grads), (exact, exact_grads), dtype)
        return
    for name, g, w in zip(("z", "x", "B", "C", "dt", "in_proj's output", "weight", "bias"),
                          (*got, *got_grads), (*want, *want_grads)):
        try:
            assert_close(g, f64(w), dtype)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


_SMALL = conv_pallas.Layout(heads=2, head_dim=16, state=16)


# Tiles of 8 rows one a program (40, 200); one program of 4 tiles of 16
# (64); three programs of 2 tiles of 16 (96). By default float32 at 40 and
# bf16 at 96 (and test_interpreted_kernel_with_uneven_parts at 64).
@pytest.mark.parametrize("dtype, s", slow_unless(
    [("float32", 40), ("bfloat16", 96)],
    list(itertools.product(["float32", "bfloat16"], [40, 64, 96, 200]))))
def test_interpreted_kernel_equals_xla(s, dtype, rng):
    _check(s, _SMALL, 2, dtype, rng, interpret=True)


def test_interpreted_kernel_with_uneven_parts(rng):
    """x's channels span several channel blocks, B and C one each."""
    _check(64, conv_pallas.Layout(heads=4, head_dim=32, state=16), 1, "float32", rng,
           interpret=True)


def test_parameter_gradients_sum_over_the_data_axis(monkeypatch):
    """Inside shard_map, weight and bias are the same on every data shard while
    in_proj's output differs: their gradients must come back of the
    parameters' type (a custom_vjp may not return them data-varying) and
    summed over the shards. Lowered for a GPU;
    test_mamba_trains_alike_with_either_convolution runs it."""
    layout = conv_pallas.Layout(heads=8, head_dim=32, state=64)
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in (
        (512, 4, 2, layout.width), (4, 2 * layout.conv_channels), (2 * layout.conv_channels,))]

    def kernel(*t):
        return sum(jnp.sum(o.astype(jnp.float32))
                   for o in conv_pallas.split_conv_silu(*t, layout))

    traced, text = data_parallel_grad_lowered_for_h200(
        monkeypatch, kernel, args, (jax.P(None, "data"), jax.P(), jax.P()))
    assert [g.shape for g in traced.out_info] == [a.shape for a in args]
    assert "mamba_conv_backward" in text
    # One sum over the shards for each parameter's gradient (grad drops the
    # loss's own psum: its value is not returned).
    assert text.count("stablehlo.all_reduce") == 2, text.count("stablehlo.all_reduce")


@pytest.mark.parametrize("layout, width, message", [
    (conv_pallas.Layout(heads=2, head_dim=16, state=24), 4, "state_dim=24 is not a power of two"),
    (conv_pallas.Layout(heads=2, head_dim=16, state=16), 3, "conv_width=3 is not a power of two"),
    (conv_pallas.Layout(heads=1, head_dim=8, state=16), 4, "8 channels per part is below 16"),
])
def test_unsupported_layouts(layout, width, message):
    assert conv_pallas.unsupported_reason(layout, width) == message
    zxbcdt = jnp.zeros((8, 1, 1, layout.width))
    with pytest.raises(ValueError, match=message + "; use conv_impl='xla'"):
        conv_pallas.split_conv_silu(zxbcdt, jnp.zeros((width, layout.conv_channels)),
                                    jnp.zeros((layout.conv_channels,)), layout)


@pytest.mark.parametrize("tiling, message", [
    (dict(block_rows=3), "block_rows=3 is not a power of two"),
    (dict(steps=0), "steps=0 is not a power of two"),
    (dict(steps=3), "steps=3 is not a power of two"),
])
def test_bad_tilings(tiling, message):
    with pytest.raises(ValueError, match=message):
        conv_pallas.split_conv_silu(jnp.zeros((8, 1, 1, _SMALL.width)), jnp.zeros((4, 64)),
                                    jnp.zeros((64,)), _SMALL, interpret=True, **tiling)


def test_columns_must_match_the_layout():
    with pytest.raises(ValueError, match=r"zxbcdt has 97 columns per group, and the layout "
                                         r"Layout\(heads=2, head_dim=16, state=16\) has 98"):
        conv_pallas.split_conv_silu(jnp.zeros((8, 1, 1, 97)), jnp.zeros((4, 64)),
                                    jnp.zeros((64,)), _SMALL)


def test_compiled_kernel_needs_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs only \(Pallas Triton\), and the "
                                         r"default backend is 'cpu'; use conv_impl='xla'"):
        conv_pallas.split_conv_silu(jnp.zeros((8, 1, 1, _SMALL.width)), jnp.zeros((4, 64)),
                                    jnp.zeros(64), _SMALL)


def test_auto_runs_xla_off_a_gpu(rng):
    """"auto" on CPU: XLA's ops, forward and backward, no kernel."""
    inputs = _inputs(rng, 32, _SMALL, 2, "float32")

    def grads(impl):
        def loss(*t):
            return sum(jnp.sum(o * o) for o in conv_pallas.split_conv_silu(*t, _SMALL, impl=impl))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    want = grads("xla")(*inputs)
    for got, w in zip(grads("auto")(*inputs), want):
        np.testing.assert_array_equal(got, w)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'xla', 'pallas'\), "
                                         r"got 'cuda'"):
        conv_pallas.split_conv_silu(*inputs, _SMALL, impl="cuda")


def test_unsupported_layouts_under_auto_run_xla():
    layout = conv_pallas.Layout(heads=2, head_dim=16, state=24)
    zxbcdt = jnp.ones((8, 1, 1, layout.width))
    args = (zxbcdt, jnp.ones((4, layout.conv_channels)), jnp.ones((layout.conv_channels,)))
    for got, want in zip(conv_pallas.split_conv_silu(*args, layout, impl="auto"),
                         conv_pallas.split_conv_silu(*args, layout, impl="xla")):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl, s, kernel", [("pallas", 8192, True), ("auto", 8192, True),
                                             ("pallas", 8200, True), ("auto", 8200, False),
                                             ("auto", 96, True), ("auto", 480, True)])
def test_kernel_lowers_to_triton_without_a_gpu(impl, s, kernel, monkeypatch):
    """At the 1.4B layer's shape (8 groups of 8 heads of 64, state 128);
    "auto" lowered for CUDA takes the kernel too, but for a sequence that
    splits only into tiles of 8 rows (8200). 96 and 480 rows are 6 and 30
    tiles of 16: programs of 2 tiles, whose rows are a power of two as
    Triton's loads need (3 tiles a program failed to lower)."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    layout = conv_pallas.Layout(heads=8, head_dim=64, state=128)
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in (
        (s, 1, 8, layout.width), (4, 8 * layout.conv_channels), (8 * layout.conv_channels,))]

    def grads(*t):
        return jax.grad(lambda *u: sum(jnp.sum(o.astype(jnp.float32)) for o in
                                       conv_pallas.split_conv_silu(*u, layout, impl=impl)),
                        argnums=(0, 1, 2))(*t)

    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("mamba_conv_backward" in text) == kernel


def test_an_empty_sequence_runs_xla():
    zxbcdt = jnp.zeros((0, 1, 1, _SMALL.width))
    outs = conv_pallas.split_conv_silu(zxbcdt, jnp.zeros((4, 64)), jnp.zeros((64,)), _SMALL,
                                       interpret=True)
    assert [o.shape for o in outs] == [(0, 1, 1, 32), (0, 1, 1, 32), (0, 1, 1, 16),
                                       (0, 1, 1, 16), (0, 1, 1, 2)]


def test_mamba_config_and_flag_choose_the_kernel(capsys):
    from jax_flashoverlap.cli import train

    assert models.MambaConfig().conv_impl == "auto"
    with pytest.raises(ValueError, match=r"MambaConfig: conv_impl must be one of "
                                         r"\('auto', 'xla', 'pallas'\), got 'triton'"):
        models.MambaConfig(conv_impl="triton")
    args = train.parse_args(["--model", "mamba", "--conv", "pallas"])
    assert train.model_config("mamba", "tiny", conv=args.conv).conv_impl == "pallas"
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "transformer", "--conv", "pallas"])
    assert "--conv applies to --model mamba, not transformer" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_equals_xla_on_gpu(dtype, rng):
    """The 1.4B layer's groups (8 of 8 heads of 64, state 128), and a
    sequence in blocks of 8 rows."""
    _check(1000, conv_pallas.Layout(heads=8, head_dim=64, state=128), 8, dtype, rng,
           interpret=False)


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
