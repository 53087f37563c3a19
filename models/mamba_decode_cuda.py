"""Every block of a Mamba-2 decode step as one CUDA kernel.

XLA runs a Mamba-2 decode block as a dozen kernels (the norm, in_proj's
GEMM, the convolution, the SSM state's update, the gated norm, out_proj's
GEMM), and at one token per step each boundary leaves HBM idle while the
next kernel starts: on one H100 the 1.3B shape's step took 2.2x the time its
weights take to read. ``jfo_mamba_decode`` (``ffi/src/mamba_decode.cu``)
runs all blocks of a step as one persistent kernel with the Transformer
decode kernel's weight stream and polled handoffs
(:mod:`.transformer_decode_cuda`), three stages a block: the norm and
in_proj; per (batch row, head) the convolution, the state's update, the
skip and the gate; the gated norm, out_proj and the residual add.

It reads the weights in its own layout (:class:`MambaDecodeWeights`,
prepared once per generation by :func:`prepare_weights`), and the
convolution's state as a ring of ``conv_width`` rows (as
:mod:`.mamba_decode_pallas` does). It runs at tensor-parallel size 1, in
bfloat16, for at most :data:`MAX_BATCH` rows (:func:`unsupported_reason`);
``MambaConfig.decode_blocks="cuda"`` selects it (opt-in). Programs compiled
for other platforms run :func:`reference`, the kernel's arithmetic in JAX
on the same layout.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashoverlap import build_info, settings
from jax_flashoverlap.nn import same_variance

from .layers import rms_norm
from .mamba_config import MambaConfig
from .pallas_gpu import kernel_or_reference, on_cuda
from .transformer_decode_weights import _column_items, _fragment_order, _whole, items_product

__all__ = ["MAX_BATCH", "MambaDecodeWeights", "TRACE_EVENTS", "decode_blocks", "in_proj_layout",
           "prepare_weights", "reference", "traced", "unsupported_reason"]

TARGET = "jfo_mamba_decode"
MAX_BATCH = 4
MAX_LAYERS = 64
MAX_GROUPS = 8
MAX_CONV_WIDTH = 8
# Columns of a work item of in_proj and out_proj (ffi/src/mamba_decode/kernel.cuh).
ITEM_COLUMNS = 16
# A mixer item's state over the CTA's 256 threads: at most this many a thread.
_THREADS, _MAX_STATE_PER_THREAD = 256, 64
# The weight stream's slot bytes, ring slots (0: as many as fit) and options:
# the Transformer kernel's (models.transformer_decode_cuda).
CHUNK_BYTES = 32768
RING_SLOTS = 0
OPTIONS = 1 | 4 | 16 | 64  # evict-first weights, residual ahead, ordered atomics, polled
# The kernel's schedule (bit flags, ffi/src/mamba_decode/kernel.cuh):
# BALANCED_ITEMS gives the CTAs with one more in_proj item than the rest no
# out_proj or mixer item; LOADS_TOGETHER has a mixer item issue all its
# loads of in_proj's outputs before polling any; INPUTS_FIRST has it load
# everything in_proj does not produce (the convolution's older rows and
# weights, the biases, A, D) before its polls; OUTPUT_FIRST has it hand its
# gated output over before it stores the SSM state. Read where the kernel is
# traced; scripts/mamba_decode_probe.py compares them.
BALANCED_ITEMS, LOADS_TOGETHER, INPUTS_FIRST, OUTPUT_FIRST = 1, 2, 4, 8
SCHEDULE_BITS = (BALANCED_ITEMS, LOADS_TOGETHER, INPUTS_FIRST, OUTPUT_FIRST)
SCHEDULE = 0
_CONTROL_BYTES = 4096
# A trace's rows: per layer, 256 CTAs of 25 clocks (the Transformer
# kernel's rows), the first TRACE_EVENTS of them named; the last two are
# thread 0's time issuing copies and thread 32's waits for them, in ns.
_TRACE_CTAS, _TRACE_ROW = 256, 25
TRACE_EVENTS = ("layer_start", "normed", "in_proj_done", "mixer_ready", "mixer_done",
                "gated_normed", "out_proj_done", "in_proj_copy_wait_ns",
                "out_proj_copy_wait_ns")


class MambaDecodeWeights(NamedTuple):
    """The blocks' weights in the kernel's layout, stacked over the L layers.

    d is the model width, I = heads x head_dim the inner width, H the heads,
    c the convolution's channels (per group x, B and C), k its width, and
    C in_proj's columns in the kernel's order (:func:`in_proj_layout`).

    Attributes:
      norm: float32 [L, d], the blocks' norms.
      in_proj: bf16 [L, C / 16, d, 16], 16-column items in MMA tiles.
      out_proj: bf16 [L, d / 16, I, 16].
      conv_weight: float32 [L, k, c]; conv_bias: float32 [L, c].
      dt_bias, a_log, d_skip: float32 [L, H].
      gate_norm: float32 [L, I], the gated norms' weights.
    """

    norm: jax.Array
    in_proj: jax.Array
    out_proj: jax.Array
    conv_weight: jax.Array
    conv_bias: jax.Array
    dt_bias: jax.Array
    a_log: jax.Array
    d_skip: jax.Array
    gate_norm: jax.Array


def _padded(n: int) -> int:
    return -(-n // ITEM_COLUMNS) * ITEM_COLUMNS


def in_proj_layout(config: MambaConfig) -> dict[str, int]:
    """Where each part of in_proj's output starts in the kernel's column
    order ``[x, B, C, dt, z]`` (x and z head-major, B and C group-major),
    each part padded to 16 columns, and the total ("columns")."""
    inner, bc, heads = config.inner_dim, config.num_groups * config.state_dim, config.num_heads
    x_at, b_at = 0, _padded(inner)
    c_at = b_at + _padded(bc)
    dt_at = c_at + _padded(bc)
    z_at = dt_at + _padded(heads)
    return dict(x=x_at, b=b_at, c=c_at, dt=dt_at, z=z_at, columns=z_at + _padded(inner))


def unsupported_reason(config: MambaConfig, *, tensor_size: int, batch: int) -> str | None:
    """Why the kernel cannot run this model's decode step, or None if it can.

    Args:
      config: the model's.
      tensor_size: the mesh's tensor axis size.
      batch: rows per device.
    """
    p, n, g = config.head_dim, config.state_dim, config.num_groups
    if tensor_size != 1:
        return f"it runs at tensor-parallel size 1 (the mesh's is {tensor_size})"
    if jnp.dtype(config.dtype) != jnp.dtype(jnp.bfloat16):
        return f"it computes in bfloat16 (the config's dtype is {config.dtype})"
    if not 1 <= batch <= MAX_BATCH:
        return f"it takes 1 to {MAX_BATCH} rows per device (got {batch})"
    if config.num_layers > MAX_LAYERS:
        return f"it takes at most {MAX_LAYERS} layers (got {config.num_layers})"
    if g > MAX_GROUPS or not 2 <= config.conv_width <= MAX_CONV_WIDTH:
        return (f"it takes at most {MAX_GROUPS} groups and a convolution 2 to "
                f"{MAX_CONV_WIDTH} wide (got {g} and {config.conv_width})")
    if config.embed_dim % ITEM_COLUMNS or (config.inner_dim // g) % 8:
        return (f"it needs embed_dim a multiple of {ITEM_COLUMNS} and a group's inner width "
                f"of 8 (got {config.embed_dim} and {config.inner_dim // g})")
    per_thread = max(1, p * n // _THREADS)
    sharers = n // max(1, per_thread)
    if (p & (p - 1) or n & (n - 1) or per_thread > _MAX_STATE_PER_THREAD or sharers > 32
            or (p * sharers) % 32 or p * sharers > _THREADS):
        return (f"head_dim={p} and state_dim={n} must be powers of two with head_dim x "
                f"state_dim from 32 to {_THREADS * _MAX_STATE_PER_THREAD}")
    return None


def prepare_weights(blocks, config: MambaConfig) -> MambaDecodeWeights:
    """The blocks' weights in the kernel's layout (jit it: a copy of each).

    Args:
      blocks: the model's :class:`~models.mamba.Mamba2Block` s, their
        matrices in the compute dtype (as ``decoding_params`` casts them).
      config: the model's.
    """
    dtype = jnp.dtype(config.dtype)
    hpg, p, n = config.num_heads // config.num_groups, config.head_dim, config.state_dim
    layout = in_proj_layout(config)

    def stack(fn):
        return jnp.stack([fn(block) for block in blocks])

    def vector(param):
        return _whole(param[...]).astype(jnp.float32)

    def pad(w):
        return jnp.pad(w, ((0, 0), (0, _padded(w.shape[1]) - w.shape[1])))

    def in_proj(block):
        w = _whole(block.mixer.in_proj.kernel[...]).astype(dtype)
        w = w.reshape(w.shape[0], config.num_groups, -1)     # [d, g, z x B C dt]
        parts = np.cumsum([hpg * p, hpg * p, n, n])
        z, x, b, c, dt = (a.reshape(w.shape[0], -1) for a in jnp.split(w, parts, axis=-1))
        ordered = jnp.concatenate([pad(x), pad(b), pad(c), pad(dt), pad(z)], axis=1)
        assert ordered.shape[1] == layout["columns"]
        return _fragment_order(_column_items(ordered, ITEM_COLUMNS))

    return MambaDecodeWeights(
        norm=stack(lambda b: vector(b.norm.weight)),
        in_proj=stack(in_proj),
        out_proj=stack(lambda b: _fragment_order(_column_items(
            _whole(b.mixer.out_proj.kernel[...]).astype(dtype), ITEM_COLUMNS))),
        conv_weight=stack(lambda b: vector(b.mixer.conv_weight)),
        conv_bias=stack(lambda b: vector(b.mixer.conv_bias)),
        dt_bias=stack(lambda b: vector(b.mixer.dt_bias)),
        a_log=stack(lambda b: vector(b.mixer.a_log)),
        d_skip=stack(lambda b: vector(b.mixer.d_skip)),
        gate_norm=stack(lambda b: vector(b.mixer.norm.weight)))


def decode_blocks(x: jax.Array, pos: jax.Array, weights: MambaDecodeWeights, states: tuple,
                  config: MambaConfig) -> tuple[jax.Array, tuple]:
    """One token through every block, on one device.

    Args:
      x: [b, d] in bfloat16, the blocks' input (the embedded token).
      pos: int32 scalar, the token's position.
      weights: :func:`prepare_weights`' result.
      states: a :class:`~models.mamba.SSMCache` per layer: conv [k, b, c]
        bf16, the ring (position t's inputs in row t mod k, positions
        pos-k+1 .. pos-1 filled), and ssm [b, g, H/g, p, n] float32; donate
        them and they are updated in place.
      config: the model's.

    Returns:
      (the blocks' output [b, d], the states after position ``pos``).
    """
    return kernel_or_reference(TARGET, "MambaConfig(decode_blocks='cuda')",
                               functools.partial(_ffi_decode, config=config),
                               functools.partial(reference, config=config),
                               x, jnp.asarray(pos, jnp.int32), weights, states)


def _workspace_bytes(batch: int, config: MambaConfig) -> int:
    """The control block and every layer's handoffs (ffi/src/mamba_decode.cu)."""
    per_layer = batch * (in_proj_layout(config)["columns"] + config.inner_dim + config.embed_dim)
    return _CONTROL_BYTES + -(-config.num_layers * per_layer * 2 // 256) * 256


def traced(x: jax.Array, pos: jax.Array, weights: MambaDecodeWeights, states: tuple,
           config: MambaConfig):
    """:func:`decode_blocks` on a CUDA GPU, with each CTA's clocks.

    For probing the kernel (``scripts/mamba_decode_probe.py``).

    Returns:
      (x, states, uint32 [L, 256, 25, 2]): per layer and CTA, %globaltimer
      in ns (low and high words) at each of TRACE_EVENTS (0 where the CTA
      did not pass there; rows past the grid are 0), except the entries
      named *_ns and the last two, which are durations (see TRACE_EVENTS).

    Raises:
      RuntimeError: off CUDA GPUs, or in a build without the kernel.
    """
    if not on_cuda() or TARGET not in build_info()["ffi_targets"]:
        raise RuntimeError("mamba_decode_cuda.traced runs the kernel itself: it needs a CUDA "
                           "GPU and a build with jfo_mamba_decode (decode_blocks runs the JAX "
                           "reference elsewhere)")
    return _ffi_decode(x, jnp.asarray(pos, jnp.int32), weights, states, config=config,
                       trace=True)


def _ffi_decode(x, pos, weights, states, *, config: MambaConfig, trace: bool = False):
    flat = [t for state in states for t in state]
    operands, varying = same_variance(x, pos, *weights, *flat)
    sharding = jax.typeof(x).sharding.update(spec=jax.sharding.PartitionSpec())

    def like(shape, dtype, axes=varying):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=axes)

    # At tensor size 1 the blocks' output is the one rank's, typed as a psum's.
    whole = varying.update(varying=varying.varying - {config.sharding.tensor})
    trace_bytes = config.num_layers * _TRACE_CTAS * _TRACE_ROW * 8 if trace else 0
    workspace_bytes = _workspace_bytes(x.shape[0], config)
    results = (like(x.shape, x.dtype, whole),
               like((workspace_bytes + trace_bytes,), jnp.uint8),
               *(like(t.shape, t.dtype) for t in flat))
    first_state = 2 + len(weights)
    call = jax.ffi.ffi_call(TARGET, results,
                            input_output_aliases={first_state + i: 2 + i
                                                  for i in range(len(flat))})
    out, workspace, *updated = call(
        *operands, heads=np.int32(config.num_heads), groups=np.int32(config.num_groups),
        eps=np.float32(config.norm_eps),
        timeout_ms=np.int32(settings.get("JAX_FLASHOVERLAP_TIMEOUT_MS")),
        chunk_bytes=np.int32(CHUNK_BYTES), ring_slots=np.int32(RING_SLOTS),
        options=np.int32(OPTIONS), schedule=np.int32(SCHEDULE), trace=np.int32(trace))
    updated = tuple(type(states[0])(*updated[i:i + 2]) for i in range(0, len(updated), 2))
    if not trace:
        return out, updated
    words = lax.bitcast_convert_type(
        workspace[workspace_bytes:].reshape(-1, 4), jnp.uint32)
    return out, updated, words.reshape(config.num_layers, _TRACE_CTAS, _TRACE_ROW, 2)


def reference(x: jax.Array, pos: jax.Array, weights: MambaDecodeWeights, states: tuple, *,
              config: MambaConfig) -> tuple[jax.Array, tuple]:
    """:func:`decode_blocks` in JAX: the kernel's stages on the same layout,
    rounding to the compute dtype where the kernel does."""
    f32 = jnp.float32
    b = x.shape[0]
    g, hpg = config.num_groups, config.num_heads // config.num_groups
    p, n, inner = config.head_dim, config.state_dim, config.inner_dim
    at = in_proj_layout(config)
    updated = []
    for layer, state in enumerate(states):
        w = jax.tree.map(lambda a, i=layer: a[i], weights)
        zx = items_product(rms_norm(x, w.norm, eps=config.norm_eps), w.in_proj)   # [b, columns]
        xs = zx[:, at["x"]:at["x"] + inner].reshape(b, g, hpg * p)
        bs = zx[:, at["b"]:at["b"] + g * n].reshape(b, g, n)
        cs = zx[:, at["c"]:at["c"] + g * n].reshape(b, g, n)
        now = jnp.concatenate([xs, bs, cs], axis=-1).reshape(b, -1)       # conv channels
        width = state.conv.shape[0]
        older = jnp.take(state.conv, (pos + 1 + jnp.arange(width - 1)) % width, axis=0)
        window = jnp.concatenate([older, now[None]]).astype(f32)           # oldest first
        pre = w.conv_bias + sum(w.conv_weight[i] * window[i] for i in range(width))
        act = jax.nn.silu(pre).reshape(b, g, -1)
        xa = act[..., :hpg * p].reshape(b, g, hpg, p)
        ba, ca = act[..., hpg * p:hpg * p + n], act[..., hpg * p + n:]
        dt = jax.nn.softplus(zx[:, at["dt"]:at["dt"] + g * hpg].astype(f32)
                             + w.dt_bias).reshape(b, g, hpg)
        decay = jnp.exp(-dt * jnp.exp(w.a_log.reshape(g, hpg)))
        ssm = (decay[..., None, None] * state.ssm
               + (dt[..., None] * xa)[..., None] * ba[:, :, None, None, :])
        y = jnp.einsum("bghpn,bgn->bghp", ssm, ca) + w.d_skip.reshape(g, hpg, 1) * xa
        z = zx[:, at["z"]:at["z"] + inner].astype(f32)
        gated = (y.astype(x.dtype).astype(f32).reshape(b, inner) * jax.nn.silu(z)).astype(x.dtype)
        normed = rms_norm(gated, w.gate_norm, eps=config.norm_eps, group_size=inner // g)
        x = x + items_product(normed, w.out_proj)
        conv = lax.dynamic_update_slice(state.conv, now[None].astype(state.conv.dtype),
                                        (pos % width, 0, 0))
        updated.append(type(state)(conv, ssm))
    if config.sharding.tensor in jax.typeof(x).manual_axis_type.varying:
        x = lax.psum(x, config.sharding.tensor)  # one rank: its own output, typed as whole
    return x, tuple(updated)
