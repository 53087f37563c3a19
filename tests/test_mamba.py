"""Mamba-2: the SSD scan and convolution, and tensor-parallel runs equal to one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_support import (
    BATCH,
    SEQ_LEN,
    build,
    check_is_causal,
    check_matches_reference,
    reference,
    tokens,
)
from support import assert_close, cpu_mesh, f64, random, slow_unless

from jax_flashoverlap import models

Mamba2, MambaConfig = models.Mamba2, models.MambaConfig
causal_conv1d, ssd = models.mamba.causal_conv1d, models.mamba.ssd
CONFIG = MambaConfig.tiny()


def ssd_recurrence(x, dt, a, b, c, *, final_state=False):
    """The SSM step by step: h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t
    (and with ``final_state``, the last h)."""
    def step(h, inputs):
        x, dt, b, c = inputs  # [batch, g, heads, p], [batch, g, heads], [batch, g, n] x2
        h = (jnp.exp(dt * a)[..., None, None] * h
             + (dt[..., None] * x)[..., None] * b[:, :, None, None, :])
        return h, jnp.einsum("bghpn,bgn->bghp", h, c)

    _, batch, g, heads, p = x.shape
    h0 = jnp.zeros((batch, g, heads, p, b.shape[-1]), jnp.float32)
    h, y = jax.lax.scan(step, h0, (x, dt, b, c))
    return (y, h) if final_state else y


def _ssd_inputs(rng, s=48, batch=2, g=3, heads=2, p=4, n=5):
    x = random(rng, (s, batch, g, heads, p), "float32")
    dt = jax.nn.softplus(random(rng, (s, batch, g, heads), "float32"))
    a = -jnp.exp(random(rng, (g, heads), "float32"))
    return x, dt, a, random(rng, (s, batch, g, n), "float32"), random(rng, (s, batch, g, n),
                                                                      "float32")


@pytest.mark.parametrize("chunk_size", slow_unless([16], [8, 16, 48]))
def test_ssd_equals_the_recurrence(chunk_size, rng):
    inputs = _ssd_inputs(rng)
    assert_close(ssd(*inputs, chunk_size), f64(ssd_recurrence(*inputs)), "float32")


def test_bf16_ssd_equals_the_recurrence(rng):
    """bf16 inputs: the states' products run in bf16, within bf16 tolerance
    of the float32 recurrence on the same (rounded) inputs."""
    x, dt, a, b, c = _ssd_inputs(rng, s=64, p=16, n=16)
    x, b, c = (t.astype(jnp.bfloat16) for t in (x, b, c))
    want = ssd_recurrence(x.astype(jnp.float32), dt, a, b.astype(jnp.float32),
                          c.astype(jnp.float32))
    assert_close(ssd(x, dt, a, b, c, 16, impl="xla"), f64(want), "bfloat16")


def test_ssd_gradients_equal_the_recurrence(rng):
    inputs = _ssd_inputs(rng)
    probe = random(rng, inputs[0].shape, "float32")
    argnums = tuple(range(5))
    got = jax.grad(lambda *t: jnp.sum(ssd(*t, 16) * probe), argnums)(*inputs)
    want = jax.grad(lambda *t: jnp.sum(ssd_recurrence(*t) * probe), argnums)(*inputs)
    for g, w in zip(got, want):
        assert_close(g, f64(w), "float32")


def test_ssd_sequence_not_a_multiple_of_the_chunk(rng):
    inputs = _ssd_inputs(rng, s=24)
    y, h = ssd(*inputs, 16, return_final_state=True)
    want_y, want_h = ssd_recurrence(*inputs, final_state=True)
    assert y.shape == inputs[0].shape
    assert_close(y, f64(want_y), "float32")
    assert_close(h, f64(want_h), "float32")


@pytest.mark.parametrize("keep_chunk_states", [False, True])
def test_ssd_backward_keeps_its_inputs(keep_chunk_states, rng):
    """The chunked form's autodiff would keep [chunks, heads, l, l] blocks
    (24576 elements here); the SSD's vjp keeps its inputs (and recomputes),
    with ``keep_chunk_states`` also each chunk's state and the state
    entering it."""
    s, chunk, batch, g, heads, p, n = 64, 32, 2, 3, 2, 8, 8
    inputs = _ssd_inputs(rng, s=s, batch=batch, g=g, heads=heads, p=p, n=n)
    _, vjp = jax.vjp(lambda *t: ssd(*t, chunk, impl="xla", keep_chunk_states=keep_chunk_states),
                     *inputs)
    kept = sum(leaf.size for leaf in jax.tree.leaves(vjp))
    states = batch * g * heads * (s // chunk) * p * n
    assert kept <= sum(t.size for t in inputs) + (2 * states if keep_chunk_states else 0), kept


def test_kept_chunk_states_are_not_computed_again(rng):
    """Inside a jax.checkpoint whose policy saves SSD_STATES_NAME (as a
    block's does with ssd_keeps_chunk_states), the compiled backward runs
    fewer products with keep_chunk_states: the chunk states and their
    passing are not computed again."""
    import re

    from jax.ad_checkpoint import checkpoint_name

    inputs = _ssd_inputs(rng, s=64, heads=2, p=16, n=16)
    policy = jax.checkpoint_policies.save_only_these_names("y", models.mamba.SSD_STATES_NAME)

    def products(keep):
        def block(*t):
            return checkpoint_name(ssd(jnp.tanh(t[0]), *t[1:], 16, impl="xla",
                                       keep_chunk_states=keep), "y")
        grad = jax.jit(jax.grad(lambda *t: jnp.sum(jax.checkpoint(block, policy=policy)(*t) ** 2),
                                argnums=tuple(range(5))))
        return len(re.findall(r" dot\(", grad.lower(*inputs).compile().as_text()))

    assert products(True) < products(False), (products(True), products(False))


@pytest.mark.parametrize("chunk_size", [16, 48])
def test_ssd_gradients_with_the_chunk_states_kept_equal_recomputed(chunk_size, rng):
    """Kept or computed again, the backward's chunk states are the same
    values: the gradients agree to float32 rounding."""
    inputs = _ssd_inputs(rng)
    probe = random(rng, inputs[0].shape, "float32")

    def grads(keep):
        return jax.jit(jax.grad(lambda *t: jnp.sum(ssd(*t, chunk_size, impl="xla",
                                                       keep_chunk_states=keep) * probe),
                                argnums=tuple(range(5))))(*inputs)

    for kept, recomputed in zip(grads(True), grads(False)):
        np.testing.assert_allclose(kept, recomputed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl, message", [
    ("pallas", r"impl='pallas' cannot run this shape: state_dim=5 is not a power of two"),
    ("triton", r"impl='triton' is not one of \('auto', 'xla', 'pallas'\)"),
])
def test_ssd_impl_errors(rng, impl, message):
    with pytest.raises(ValueError, match=message):
        ssd(*_ssd_inputs(rng), 16, impl=impl)


def test_ssd_pallas_needs_a_gpu(rng):
    inputs = _ssd_inputs(rng, s=32, heads=2, p=16, n=16)
    with pytest.raises(ValueError, match=r"impl='pallas' runs on CUDA GPUs only .* "
                                         r"default backend is 'cpu'"):
        ssd(*inputs, 16, impl="pallas")


def test_ssd_auto_runs_xla_on_cpu(rng):
    """auto stages the Pallas kernels for CUDA only: on CPU the result is
    XLA's, and the compiled program calls no kernel."""
    inputs = _ssd_inputs(rng, s=32, heads=2, p=16, n=16)
    auto = jax.jit(lambda *t: ssd(*t, 16, impl="auto"))
    assert "triton" not in auto.lower(*inputs).compile().as_text().lower()
    np.testing.assert_array_equal(auto(*inputs), jax.jit(lambda *t: ssd(*t, 16, impl="xla"))(
        *inputs))


def test_causal_conv1d(rng):
    s, k, c = 10, 4, 3
    x, w, bias = (random(rng, shape, "float32") for shape in ((s, 2, c), (k, c), (c,)))
    want = np.zeros((s, 2, c))
    for t in range(s):
        for i in range(k):
            if t - (k - 1) + i >= 0:
                want[t] += f64(w)[i] * f64(x)[t - (k - 1) + i]
    assert_close(causal_conv1d(x, w, bias), want + f64(bias), "float32")


@pytest.fixture(scope="module")
def ref():
    return reference(Mamba2, CONFIG, seed=7)


@pytest.mark.parametrize("impl, tp", slow_unless(
    [("decomposed", 2)], [("xla", 2), ("xla", 4), ("decomposed", 2), ("decomposed", 4)]))
def test_loss_and_gradients_match_one_device(ref, tp, impl):
    check_matches_reference(Mamba2, CONFIG, ref, tp=tp, impl=impl)


def test_without_sequence_parallelism_matches_one_device(ref):
    check_matches_reference(Mamba2, CONFIG, ref, tp=2, impl="decomposed",
                            sharding=models.ShardingConfig(sequence_parallel=False))


_LAYERS = [dict(scan_layers=False), dict(remat=True), dict(scan_layers=False, remat=True),
           dict(residuals="all"), dict(scan_layers=False, norm_backward="recompute"),
           dict(residuals="all", norm_backward="recompute"), dict(fuse_skip=False),
           dict(ssd_keeps_chunk_states=True),
           dict(scan_layers=False, ssd_keeps_chunk_states=True)]


# By default three cases that between them set every option but fuse_skip; the others are slow.
@pytest.mark.parametrize("layers", slow_unless([_LAYERS[2], _LAYERS[5], _LAYERS[8]], _LAYERS))
def test_unrolled_and_rematerialised_layers_match_one_device(ref, layers):
    check_matches_reference(Mamba2, CONFIG, ref, tp=2, impl="decomposed", **layers)


def _kept_bytes(config) -> int:
    """Bytes the model's backward keeps from its forward (the vjp's residuals)."""
    mesh = cpu_mesh(tp=1)
    graphdef, state = nnx.split(build(Mamba2, config, mesh))
    batch = jnp.asarray(tokens(0)[:, :-1])
    with jax.set_mesh(mesh):
        _, vjp = jax.vjp(lambda state: nnx.merge(graphdef, state)(batch).sum(), state)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))


def test_named_residuals_keep_less_than_all():
    """"named" keeps three values a block, "all" every residual (with XLA's
    convolution backward: the kernel's custom_vjp keeps the same few values
    under either policy)."""
    kept = {r: _kept_bytes(dataclasses.replace(CONFIG, residuals=r, conv_impl="xla"))
            for r in models.RESIDUALS}
    assert kept["named"] < kept["all"] / 2, kept


def test_kept_chunk_states_pass_the_blocks_checkpoint():
    """ssd_keeps_chunk_states adds each layer's chunk states (float32) and
    entering states (the compute dtype) to what the backward keeps, through
    the blocks' named-residual policy."""
    default = _kept_bytes(CONFIG)
    kept = _kept_bytes(dataclasses.replace(CONFIG, ssd_keeps_chunk_states=True))
    states = (BATCH * CONFIG.num_heads * (SEQ_LEN // CONFIG.chunk_size) * CONFIG.head_dim
              * CONFIG.state_dim)
    per_layer = states * (4 + jnp.dtype(CONFIG.dtype).itemsize)
    assert kept - default == CONFIG.num_layers * per_layer, (default, kept, per_layer)


def test_is_causal():
    check_is_causal(Mamba2, CONFIG)


@pytest.mark.parametrize("tp, batch, seq_len, message", [
    (8, 1, 32, r"num_groups=4 \(of num_heads=8\) does not divide by the tensor-parallel "
               r"size 8"),
    (4, 2, 30, r"sequence length 30 does not divide by the 4 ranks of the tensor axis"),
], ids=["groups", "sequence_tp"])
def test_shapes_the_mesh_cannot_split(tp, batch, seq_len, message):
    model = build(Mamba2, CONFIG, cpu_mesh(tp=1))
    with jax.set_mesh(cpu_mesh(tp=tp)), pytest.raises(ValueError, match=message):
        model(jnp.asarray(tokens(0, batch=batch, seq_len=seq_len)[:, :-1]))


def test_sequence_not_a_multiple_of_the_chunk_matches_one_device():
    """Sequence 24 in chunks of 16 (padded inside the scan) against one device
    in chunks of 8, which divide it: the SSD does not depend on the chunk."""
    divides = reference(Mamba2, dataclasses.replace(CONFIG, chunk_size=8), seed=7, seq_len=24)
    check_matches_reference(Mamba2, CONFIG, divides, tp=2, impl="decomposed")


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads=8 must be a multiple of num_groups=3"):
        MambaConfig(num_groups=3)
    with pytest.raises(ValueError, match="must be a multiple of head_dim=48"):
        MambaConfig(head_dim=48)
    with pytest.raises(ValueError, match=r"ssd_impl must be one of \('auto', 'xla', 'pallas'\)"):
        MambaConfig(ssd_impl="cuda")
    with pytest.raises(ValueError, match=r"norm_backward must be one of \('auto', "
                                         r"'autodiff', 'recompute', 'pallas'\), got 'fused'"):
        MambaConfig(norm_backward="fused")
    with pytest.raises(ValueError, match=r"residuals must be one of \('named', 'all'\), "
                                         r"got 'some'"):
        MambaConfig(residuals="some")
    with pytest.raises(ValueError, match="remat .recompute every block. and "
                                         "residuals='all' exclude each other; set one"):
        MambaConfig(remat=True, residuals="all")
    for chunk_size in (0, 2.5):
        with pytest.raises(ValueError, match=rf"MambaConfig: chunk_size={chunk_size} must be a "
                                             rf"positive int"):
            MambaConfig(chunk_size=chunk_size)
    message = "must be a power of two from 16 that divides chunk_size=16"
    with pytest.raises(ValueError, match=f"SSDTiling: block_cols=32 {message}"):
        MambaConfig(ssd_tiling=models.SSDTiling(block=16, block_cols=32))
    with pytest.raises(ValueError, match="SSDTiling: block=24 must be a power of two"):
        MambaConfig(chunk_size=48, ssd_tiling=models.SSDTiling(block=24))
    with pytest.raises(ValueError, match="SSDTiling: num_stages=0 must be at least 1"):
        MambaConfig(ssd_tiling=models.SSDTiling(num_stages=0))
    with pytest.raises(ValueError, match="SSDTiling: num_warps=0 must be at least 1"):
        MambaConfig(ssd_tiling=models.SSDTiling(num_warps=0))


def test_scan_layers_default_is_per_platform(monkeypatch):
    """None: scanned where compilation dominates (CPU), unrolled on GPUs (the
    faster step); an explicit choice stays."""
    resolve = models.mamba.resolve_scan_layers
    config = models.MambaConfig()
    assert config.scan_layers is None
    assert resolve(config).scan_layers is True
    assert resolve(dataclasses.replace(config, scan_layers=False)).scan_layers is False
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve(config).scan_layers is False
    assert resolve(dataclasses.replace(config, scan_layers=True)).scan_layers is True


def test_train_flags_for_the_backward(capsys):
    from jax_flashoverlap.cli import train

    args = train.parse_args(["--model", "mamba", "--residuals", "all",
                             "--norm-backward", "recompute", "--no-fuse-skip"])
    config = train.model_config("mamba", "tiny", residuals=args.residuals,
                                norm_backward=args.norm_backward, fuse_skip=args.fuse_skip)
    assert config.residuals == "all" and config.norm_backward == "recompute"
    assert not config.fuse_skip
    assert train.parse_args(["--model", "mamba"]).fuse_skip
    args = train.parse_args(["--model", "mamba", "--chunk-size", "128"])
    assert train.model_config("mamba", "1b", chunk_size=args.chunk_size).chunk_size == 128
    assert train.model_config("mamba", "1b").chunk_size == 256   # the size's
    args = train.parse_args(["--model", "mamba", "--ssd-keeps-chunk-states"])
    assert train.model_config("mamba", "tiny", ssd_keeps_chunk_states=args.ssd_keeps_chunk_states
                              ).ssd_keeps_chunk_states
    assert not train.model_config("mamba", "tiny").ssd_keeps_chunk_states
    args = train.parse_args(["--model", "mamba", "--ssd-tiles", "128x64", "--ssd-warps", "8",
                             "--ssd-stages", "2"])
    tiling = train.model_config("mamba", "1b", ssd_tiling=args.ssd_tiling).ssd_tiling
    assert tiling == models.SSDTiling(block=128, block_cols=64, num_warps=8, num_stages=2)
    assert train.parse_args(["--model", "mamba", "--ssd-tiles", "32"]).ssd_tiling == \
        models.SSDTiling(block=32)
    assert train.model_config("mamba", "1b").ssd_tiling == models.SSDTiling()
    for argv, message in [
            (["--chunk-size", "128"], "--chunk-size applies to --model mamba, not transformer"),
            (["--residuals", "all"], "--residuals applies to --model mamba, not transformer"),
            (["--norm-backward", "recompute"],
             "--norm-backward applies to --model mamba, not transformer"),
            (["--no-fuse-skip"], "--fuse-skip applies to --model mamba, not transformer"),
            (["--ssd-keeps-chunk-states"],
             "--ssd-keeps-chunk-states applies to --model mamba, not transformer"),
            (["--ssd-tiles", "128x64"], "--ssd-tiles applies to --model mamba, not transformer"),
            (["--ssd-warps", "8"], "--ssd-warps applies to --model mamba, not transformer"),
            (["--ssd-stages", "2"], "--ssd-stages applies to --model mamba, not transformer"),
            (["--model", "mamba", "--ssd-tiles", "128x"],
             "--ssd-tiles: SSD tiles '128x': write ROWS or ROWSxCOLS, e.g. 128x64"),
            (["--model", "mamba", "--residuals", "all", "--remat"],
             "--residuals all and --remat exclude each other")]:
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert message in capsys.readouterr().err


def test_train_flags_choose_scanned_or_unrolled_layers(capsys):
    from jax_flashoverlap.cli import train

    assert train.parse_args(["--scan-layers"]).scan_layers is True
    assert train.parse_args(["--unroll-layers"]).scan_layers is False
    assert train.parse_args([]).scan_layers is None
    with pytest.raises(SystemExit):
        train.parse_args(["--scan-layers", "--unroll-layers"])
    assert "not allowed with argument" in capsys.readouterr().err
