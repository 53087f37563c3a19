"""The SSD's Pallas kernels against the XLA SSD: in Pallas's interpreter on
CPU, compiled on GPUs."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_as_accurate, assert_close, f64, random, slow_unless

from jax_flashoverlap import models

scan = models.ssd


def _inputs(rng, s, heads, p, n, dtype, batch=1, groups=2):
    """ssd's (x, dt, a, b, c); dt and a as the model makes them."""
    x = random(rng, (s, batch, groups, heads, p), dtype)
    dt = jax.nn.softplus(random(rng, (s, batch, groups, heads), "float32") - 3.0)
    a = -jnp.exp(random(rng, (groups, heads), "float32"))
    b, c = (random(rng, (s, batch, groups, n), dtype) for _ in range(2))
    return x, dt, a, b, c


def _check_against_xla(inputs, chunk_size, dtype, rng):
    """Forward (y and the final state) and the gradients of every input.

    float32: against XLA's SSD. bf16: as close to XLA's SSD run in float32 on
    the same (rounded) inputs as XLA's bf16 SSD is. The kernels round C·B^T
    and the entering states to bf16 for the tensor cores, as flash attention
    rounds its probabilities, where XLA's einsums keep them in float32; over
    8192 positions the sums in a's gradient show that rounding.
    """
    probe = random(rng, inputs[0].shape, "float32")
    probe_h = random(rng, inputs[0].shape[1:] + (inputs[3].shape[-1],), "float32")

    def loss(impl, *t):
        y, h = scan.ssd(*t, chunk_size, return_final_state=True, impl=impl)
        return jnp.sum(y * probe) + jnp.sum(h * probe_h), (y, h)

    def outputs(impl, args):
        """{name: result} of the forward and the gradients."""
        (_, (y, h)), grads = jax.jit(jax.value_and_grad(
            functools.partial(loss, impl), argnums=tuple(range(5)), has_aux=True))(*args)
        return dict(y=y, final_state=h, **{f"gradient of {name}": g for name, g in
                                           zip(("x", "dt", "a", "b", "c"), grads)})

    with jax.default_matmul_precision("highest"):
        got, want = outputs("pallas", inputs), outputs("xla", inputs)
        exact = (None if jnp.dtype(dtype) == jnp.float32 else
                 outputs("xla", [t.astype(jnp.float32) for t in inputs]))
    for name in want:
        try:
            if exact is None:
                assert_close(got[name], f64(want[name]), dtype)
            else:
                assert_as_accurate(got[name], want[name], exact[name], dtype)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.fixture
def interpreted(monkeypatch):
    """impl="pallas" runs the kernels in Pallas's interpreter (on CPU); the
    other impls stay what they are (the reference is XLA's SSD)."""
    chunked_for = scan._chunked_ssd_for

    def interpreted_for(impl, *args, tiling=None):
        if impl == "pallas":
            return functools.partial(scan._chunked_ssd_pallas, interpret=True, tiling=tiling)
        return chunked_for(impl, *args)
    monkeypatch.setattr(scan, "_chunked_ssd_for", interpreted_for)


_SHAPES = {"chunk16": (64, 16), "chunk32": (64, 32), "padded": (40, 16), "two_blocks": (256, 128)}


# By default each dtype at one shape: float32 in two blocks, bf16 padded.
@pytest.mark.parametrize("dtype, shape", slow_unless(
    [("float32", "two_blocks"), ("bfloat16", "padded")],
    list(itertools.product(["float32", "bfloat16"], _SHAPES))))
def test_interpreted_kernels_equal_xla(interpreted, shape, dtype, rng):
    s, chunk_size = _SHAPES[shape]
    _check_against_xla(_inputs(rng, s, heads=2, p=16, n=16, dtype=dtype), chunk_size, dtype,
                       rng)


@pytest.mark.parametrize("a_scale", [-40.0, pytest.param(0.5, marks=pytest.mark.slow)],
                         ids=["fast_decay", "growth"])
def test_interpreted_outer_product_decays_at_extreme_decays(a_scale, monkeypatch, rng):
    """Decays that underflow to zero inside a tile (a near -40) and states
    that grow (a > 0, cum increasing): the tiles wholly below the diagonal,
    whose decays are products of two exponentials, give finite results equal
    to the same kernels taking every decay as one exponential of a
    difference. (At a near -40 the gradient of a is 2e-5 off XLA's in
    float32 either way: its sums cancel.)"""
    x, dt, a, b, c = _inputs(rng, 256, heads=2, p=16, n=16, dtype="float32")
    inputs = (x, dt, a_scale * jnp.exp(0.1 * random(rng, a.shape, "float32")), b, c)
    probe = random(rng, x.shape, "float32")
    chunked = functools.partial(scan._chunked_ssd_pallas, interpret=True)

    def outputs():
        def loss(*t):
            y = scan._ssd(*t, None, 128, chunked)[0]
            return jnp.sum(y * probe), y
        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)),
                                                   has_aux=True))(*inputs)
        return dict(y=y, **{f"gradient of {name}": g for name, g in
                            zip(("x", "dt", "a", "b", "c"), grads)})

    with jax.default_matmul_precision("highest"):
        got = outputs()
        monkeypatch.setattr(models.ssd_pallas, "_decay_below",
                            lambda rows, cols, last: jnp.exp(rows[:, None] - cols[None, :]))
        want = outputs()
    for name in want:
        try:
            assert_close(got[name], f64(want[name]), "float32")
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_interpreted_kernels_keeping_the_chunk_states_give_the_same_gradients(interpreted,
                                                                            rng):
    """keep_chunk_states hands the forward's chunk states to the backward
    (through the kernels' own custom_vjp): the same gradients as recomputing
    them."""
    inputs = _inputs(rng, 64, heads=2, p=16, n=16, dtype="float32")
    probe = random(rng, inputs[0].shape, "float32")

    def grads(keep):
        def loss(*t):
            return jnp.sum(scan.ssd(*t, 32, impl="pallas", keep_chunk_states=keep) * probe)
        return jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*inputs)

    for kept, recomputed in zip(grads(True), grads(False)):
        np.testing.assert_allclose(kept, recomputed, rtol=1e-5, atol=1e-6)


def _check_skip_against_xla(inputs, chunk_size, dtype, rng):
    """d_skip: y is the SSD plus D·x in x's dtype, from the output kernel on
    the Pallas path; against the XLA SSD with the skip added here, forward and
    the gradients of all six inputs."""
    x, a = inputs[0], inputs[2]
    d = random(rng, a.shape, "float32")
    probe = random(rng, x.shape, "float32")

    def fused(*t):
        y = scan.ssd(*t[:5], chunk_size, impl="pallas", d_skip=t[5])
        return jnp.sum(y.astype(jnp.float32) * probe), y

    def reference(*t):
        y = scan.ssd(*t[:5], chunk_size, impl="xla") + t[5][..., None] * t[0].astype(
            jnp.float32)
        return jnp.sum(y * probe), y

    with jax.default_matmul_precision("highest"):
        (_, y), grads = jax.jit(jax.value_and_grad(fused, argnums=tuple(range(6)),
                                                   has_aux=True))(*inputs, d)
        (_, want_y), want_grads = jax.jit(jax.value_and_grad(
            reference, argnums=tuple(range(6)), has_aux=True))(*inputs, d)
    assert y.dtype == x.dtype
    assert_close(y, f64(want_y), dtype)
    for name, got, want in zip(("x", "dt", "a", "b", "c", "d"), grads, want_grads):
        try:
            assert_close(got, f64(want), dtype)
        except AssertionError as e:
            raise AssertionError(f"gradient of {name}: {e}") from None


@pytest.mark.parametrize("dtype", slow_unless(["float32"], ["float32", "bfloat16"]))
def test_interpreted_kernels_with_the_skip_equal_xla_plus_the_skip(interpreted, dtype, rng):
    _check_skip_against_xla(_inputs(rng, 40, heads=2, p=16, n=16, dtype=dtype), 16, dtype, rng)


@pytest.mark.parametrize("chunk_size, head_dim, heads, n, message", [
    (48, 64, 8, 128, "chunk_size=48 is not a power of two"),
    (8, 64, 8, 128, "chunk_size=8 is below 16"),
    (64, 64, 6, 128, "heads per group=6 is not a power of two"),
    (64, 64, 8, 96, "state_dim=96 is not a power of two"),
])
def test_unsupported_shapes(chunk_size, head_dim, heads, n, message):
    assert models.ssd_pallas.unsupported_reason(chunk_size, head_dim, heads, n) == message
    x = jnp.zeros((chunk_size, 1, 1, heads, head_dim))
    b = jnp.zeros((chunk_size, 1, 1, n))
    with pytest.raises(ValueError, match=message):
        models.ssd_pallas.chunk_states(x, b, chunk_size=chunk_size)
    dt = jnp.zeros((chunk_size, 1, 1, heads))
    with pytest.raises(ValueError, match=rf"{message}; use the XLA SSD \(ssd_impl='xla'\)"):
        models.ssd_pallas.chunk_output(jnp.zeros((1, 1, 1, chunk_size, chunk_size)), x, dt, dt,
                                       b, jnp.zeros((1, 1, heads, 1, head_dim, n)),
                                       chunk_size=chunk_size)


def test_chunk_output_needs_a_state_per_chunk():
    x, dt = jnp.zeros((128, 1, 1, 2, 16)), jnp.zeros((128, 1, 1, 2))
    with pytest.raises(ValueError, match="3 chunks of state for a sequence of 128 = 2 chunks"):
        models.ssd_pallas.chunk_output(jnp.zeros((1, 1, 2, 64, 64)), x, dt, dt,
                                       jnp.zeros((128, 1, 1, 16)),
                                       jnp.zeros((1, 1, 2, 3, 16, 16)), chunk_size=64)


def test_kernels_lower_to_triton_without_a_gpu(monkeypatch):
    """The forward and both backward kernels lower for an H200 (Triton's
    lowering runs in Python; it failed on a loop carrying a literal before
    any GPU saw it). jax asks the local GPU for its generation: say H200."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    s, chunk = 512, 256
    rng = np.random.default_rng(0)
    inputs = _inputs(rng, s, heads=8, p=64, n=128, dtype="bfloat16")
    inputs += (random(rng, inputs[2].shape, "float32"),)  # D, added inside the output kernel

    def grads(*t):
        return jax.grad(lambda *u: jnp.sum(scan._ssd(*u, chunk, scan._chunked_ssd_pallas)[0]
                                           .astype(jnp.float32)),
                        argnums=tuple(range(6)))(*t)

    text = jax.jit(grads).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("ssd_chunk_output", "ssd_intra_chunk_backward_columns",
                   "ssd_intra_chunk_backward_rows", "ssd_chunk_states", "ssd_state_rows",
                   "ssd_state_group_rows"):
        assert kernel in text, kernel


def test_without_the_triton_backend_auto_runs_xla(monkeypatch):
    """jax 0.11 marks Pallas's Triton backend deprecated: where a jax lacks
    it, "auto" runs the einsums and "pallas" says why it cannot."""
    monkeypatch.setattr(models.ssd_tiles, "plgpu", None)
    assert scan._chunked_ssd_for("auto", 64, 64, 8, 128) is scan._chunked_ssd_xla
    with pytest.raises(ValueError, match="this jax has no Pallas Triton backend"):
        scan._chunked_ssd_for("pallas", 64, 64, 8, 128)


def test_tile_side_errors():
    x, dt, b = jnp.zeros((128, 1, 1, 2, 16)), jnp.zeros((128, 1, 1, 2)), jnp.zeros((128, 1, 1, 16))
    with pytest.raises(ValueError, match="block=48 must be a power of two from 16 that "
                                         "divides chunk_size=64"):
        models.ssd_pallas.chunk_output(jnp.zeros((1, 1, 2, 64, 64)), x, dt, dt, b,
                                       jnp.zeros((1, 1, 2, 2, 16, 16)), chunk_size=64, block=48)
    with pytest.raises(ValueError, match="sequence length 128 is not a multiple of "
                                         "chunk_size=256"):
        models.ssd_pallas.chunk_states(x, b, chunk_size=256)
    with pytest.raises(ValueError, match="num_stages=0 must be at least 1"):
        models.ssd_pallas.chunk_states(x, b, chunk_size=64, num_stages=0)


# (sequence, chunk, head_dim, dtype): each chunk size, both head dims and
# dtypes, a sequence that is not a multiple of the chunk, and the 1.4B
# layer's long sequence.
GPU_SHAPES = [(s, chunk, p, dtype) for s, chunk, p in
              ((1024, 64, 64), (1024, 128, 128), (1024, 256, 64), (1000, 256, 64))
              for dtype in ("float32", "bfloat16")] + [(8192, 256, 64, "bfloat16")]


@pytest.mark.gpu
@pytest.mark.parametrize("s, chunk_size, head_dim, dtype", GPU_SHAPES,
                         ids=[f"s{s}_l{c}_p{p}_{d}" for s, c, p, d in GPU_SHAPES])
def test_kernels_equal_xla_on_gpu(s, chunk_size, head_dim, dtype, rng):
    _check_against_xla(_inputs(rng, s, heads=8, p=head_dim, n=128, dtype=dtype), chunk_size,
                       dtype, rng)


GPU_TILINGS = [models.SSDTiling(128, 64, 8, 2), models.SSDTiling(64, 32, 4, 2),
               models.SSDTiling(128, 32, 8, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", GPU_TILINGS, ids=lambda t: f"{t.block}x{t.block_cols}_"
                         f"w{t.num_warps}_s{t.num_stages}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_at_rectangular_tilings_equal_xla_on_gpu(tiling, dtype, monkeypatch, rng):
    """The kernels compiled at the tilings benchmarks/ssd.py sweeps, at the
    1.4B layer's heads (chunk 256, 8 heads of 64 a group, state 128)."""
    chunked_for, asked = scan._chunked_ssd_for, tiling

    def at_tiling(impl, *args, tiling=None):
        return chunked_for(impl, *args, tiling=asked if impl == "pallas" else tiling)
    monkeypatch.setattr(scan, "_chunked_ssd_for", at_tiling)
    _check_against_xla(_inputs(rng, 1024, heads=8, p=64, n=128, dtype=dtype), 256, dtype, rng)


@pytest.mark.gpu
def test_kernels_with_the_skip_equal_xla_on_gpu(rng):
    """The 1.4B layer's shape (sequence 8192, 8 heads of 64 per group, bf16)."""
    _check_skip_against_xla(_inputs(rng, 8192, heads=8, p=64, n=128, dtype="bfloat16"), 256,
                            "bfloat16", rng)


@pytest.mark.gpu
def test_mamba_1b_trains_alike_with_either_ssd():
    """Ten training steps of Mamba-2 1.4B (bf16, sequence 2048): the losses
    with the Pallas SSD follow XLA's, the first (same parameters) within
    bf16 rounding, the later within the drift of a bf16 trajectory."""
    from jax_flashoverlap.cli import train

    losses = {}
    for ssd in ("xla", "pallas"):
        args = train.parse_args(["--model", "mamba", "--size", "1b", "--mesh", "1x1",
                                 "--batch", "1", "--seq-len", "2048", "--steps", "10",
                                 "--lr", "1e-4", "--ssd", ssd, "--no-progress",
                                 "--scan-layers"])  # one block to compile, twice
        losses[ssd] = np.asarray(train.train(args).losses)
    assert np.all(np.isfinite(losses["pallas"])), losses
    assert losses["xla"][-1] < losses["xla"][0], losses  # it trains
    np.testing.assert_allclose(losses["pallas"][0], losses["xla"][0], rtol=2e-3)
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=3e-2)


@pytest.mark.parametrize("block, block_cols", slow_unless(
    [(32, 16)], [(32, 16), (16, 32), (64, 16), (16, 64)]))
def test_interpreted_rectangular_tiles_equal_square_tiles(block, block_cols, rng):
    """The chunk output with [block, block_cols] tiles (forward, and the
    gradients of all six operands, whose backward kernels walk the diagonal
    by rows and by columns) equals its result with square 16-tiles."""
    s, chunk, heads, p, n = 128, 64, 2, 16, 16
    x, dt, a, b, c = _inputs(rng, s, heads=heads, p=p, n=n, dtype="float32")
    chunked = [t.reshape(s // chunk, chunk, *t.shape[1:]) for t in (x, dt, b, c)]
    cum = jnp.cumsum(chunked[1] * a, axis=1)
    operands = models.ssd_pallas.chunk_operands(chunked[0], chunked[1], cum, *chunked[2:])
    state = random(rng, (1, 2, heads, s // chunk, p, n), "float32")
    probe = random(rng, x.shape, "float32")

    def run(**tiles):
        def loss(*t):
            y = models.ssd_pallas.chunk_output(*t, chunk_size=chunk, interpret=True, **tiles)
            return jnp.sum(y * probe), y
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
                *operands, state)

    (_, got_y), got = run(block=block, block_cols=block_cols)
    (_, want_y), want = run(block=16)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("cb", "x", "dt", "cum", "c", "state"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("block, block_cols", [(128, 64), (32, 64)])
def test_rectangular_tiles_lower_to_triton_without_a_gpu(block, block_cols, monkeypatch):
    """The chunk output's kernels with rectangular tiles and a pipeline
    depth of their own lower for an H200, at the 1.4B model's head shape."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    s, chunk, groups, heads, p, n = 512, 256, 2, 8, 64, 128
    shapes = [((1, groups, s // chunk, chunk, chunk), "bfloat16"),
              ((s, 1, groups, heads, p), "bfloat16"), ((s, 1, groups, heads), "float32"),
              ((s, 1, groups, heads), "float32"), ((s, 1, groups, n), "bfloat16"),
              ((1, groups, heads, s // chunk, p, n), "bfloat16")]
    args = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in shapes]

    def grads(*t):
        return jax.grad(lambda *u: jnp.sum(models.ssd_pallas.chunk_output(
            *u, chunk_size=chunk, block=block, block_cols=block_cols, num_stages=2)),
            argnums=tuple(range(6)))(*t)

    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("ssd_chunk_output", "ssd_intra_chunk_backward_columns",
                   "ssd_intra_chunk_backward_rows"):
        assert kernel in text, kernel
    assert "num_stages = 2" in text


def test_interpreted_ssd_runs_its_kernels_at_the_tiling_asked(interpreted, monkeypatch, rng):
    """ssd(tiling=...) hands the tiling to both kernels (chunk_states without
    the columns) and gives the default tiling's result."""
    seen = {}

    def spy_on(name, kernel):
        def spy(*args, **kwargs):
            seen[name] = {k: kwargs.get(k) for k in ("block", "block_cols", "num_warps",
                                                        "num_stages")}
            return kernel(*args, **kwargs)
        monkeypatch.setattr(models.ssd_pallas, name, spy)

    for name in ("chunk_output", "chunk_states"):
        spy_on(name, getattr(models.ssd_pallas, name))
    inputs = _inputs(rng, 64, heads=2, p=16, n=16, dtype="float32")
    tiling = models.SSDTiling(block=16, block_cols=32, num_warps=8, num_stages=2)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *t: scan.ssd(*t, 32, impl="pallas", tiling=tiling))(*inputs)
        assert seen == {"chunk_output": dict(block=16, block_cols=32, num_warps=8, num_stages=2),
                        "chunk_states": dict(block=16, block_cols=None, num_warps=8,
                                             num_stages=2)}
        want = jax.jit(lambda *t: scan.ssd(*t, 32, impl="pallas"))(*inputs)
    assert seen["chunk_output"] == dict(block=None, block_cols=None, num_warps=None,
                                        num_stages=None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_auto_ssd_lowers_its_kernels_at_the_tiling_asked(monkeypatch):
    """impl="auto" compiled for CUDA: the kernels carry the tiling's warps
    and stages (the model's MambaConfig.ssd_tiling takes this path)."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    inputs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in
              _inputs(np.random.default_rng(0), 512, heads=8, p=64, n=128, dtype="bfloat16")]
    tiling = models.SSDTiling(block=128, block_cols=64, num_warps=8, num_stages=2)
    text = jax.jit(lambda *t: scan.ssd(*t, 256, impl="auto", tiling=tiling)).trace(
        *inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert "ssd_chunk_output" in text
    assert "num_warps = 8" in text and "num_stages = 2" in text
    assert "num_warps = 4" not in text
