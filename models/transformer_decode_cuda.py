"""Every block of a Transformer decode step as one CUDA kernel.

XLA runs a decode step's block as 15-17 kernels (norms, four weight GEMMs,
the rotary embeddings, attention, residual adds), and at one token per step
each kernel boundary leaves HBM idle while the next starts: on one H200 the
1B model's step took about twice the time its weights take to read.
``jfo_transformer_decode``
(``ffi/src/transformer_decode.cu``) runs all blocks of a step as one
persistent kernel, one CTA per SM, each stage polling the outputs it
needs from the previous one, its weights streamed by TMA bulk copies that
run ahead across stages and layers.

The kernel reads the weights in its own layout, each work item's columns
contiguous (:class:`DecodeWeights`), prepared once per generation by
:func:`prepare_weights`, next to the model's bf16 weights (the same bytes
again). It runs at tensor-parallel size 1 (above, experimentally:
:data:`TENSOR_PARALLEL`), in bfloat16, for at most
:data:`MAX_BATCH` rows per device and head dims of :data:`HEAD_DIMS`
(:func:`unsupported_reason`); ``TransformerConfig.decode_blocks="cuda"``
selects it. Programs compiled for other platforms run :func:`reference`,
the kernel's arithmetic in JAX on the same layout.

``decode_blocks="auto"`` (the default) runs it on Hopper GPUs at up to
:data:`AUTO_MAX_BATCH` rows per device: on one H200 (the 1B model, context
512, one process) it took 0.726 ms a token against 0.884 through XLA's
kernels at batch 1 (1.70x the HBM floor), 0.796 against 0.923 at batch 2
and 0.940 against 0.920 at batch 4.
What still separates it from the floor is the chain of dependent loads in
each layer (norms, attention, handoffs) and each chunk's sync and copy
issue; ``scripts/transformer_decode_probe.py`` times its stages and
traces each CTA through a layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_flashoverlap import settings
from jax_flashoverlap.group_call import group_ffi_call
from jax_flashoverlap.nn import same_variance

from .config import TransformerConfig
from .layers import KVCache, rms_norm, rope, rope_frequencies
from .pallas_gpu import kernel_or_reference
from .transformer_decode_weights import (
    GATE_UP_COLUMNS,
    OUT_COLUMNS,
    QKV_COLUMNS,
    DecodeWeights,
    items_product,
    prepare_weights,
    weight_specs,
)

__all__ = ["AUTO_MAX_BATCH", "DecodeWeights", "HEAD_DIMS", "MAX_BATCH", "MAX_TENSOR_SIZE",
           "TENSOR_PARALLEL", "decode_blocks", "emulate_tensor_ranks", "prepare_weights",
           "rank_shards", "reference", "stage_times", "unsupported_reason", "weight_specs"]

TARGET = "jfo_transformer_decode"
MAX_BATCH = 4
# decode_blocks="auto" runs the kernel up to this many rows per device: on
# one H200 (1B, context 512) it was 1.22x the layers' step at batch 1, 1.16x
# at 2 and 0.98x at 4.
AUTO_MAX_BATCH = 2
HEAD_DIMS = (64, 128)
MAX_LAYERS = 64
MAX_QUERIES_PER_KV = 8
# Attention splits per head group the workspace holds (the kernel takes at
# most one split per CTA).
MAX_SPLITS = 64
# A CTA streams its weights through shared-memory slots of CHUNK_BYTES (a
# multiple of 16 KiB), each filled by a TMA bulk copy. Read where the
# kernel is traced.
CHUNK_BYTES = 32768
# The ring's slots: 0 takes as many as fit in shared memory (up to 16; 6 at
# batch 1 of the 1B model). Fewer leave fewer bytes in flight per SM when a
# stage polls another's outputs: its gathers were shorter and its weight
# streams slower, the step no faster.
# Read where the kernel is traced.
RING_SLOTS = 0
# The kernel's optional paths, bit flags (read where the kernel is traced;
# ffi/src/transformer_decode/params.cuh), all on by default: together they
# took the 1B model's step from 814 to 730 us on one H200 (batch 1,
# context 512). 0 is the kernel with grid
# barriers between its stages and fences before its counts, for comparison.
# EVICT_FIRST_WEIGHTS marks the weights' copies evict-first in L2,
# RESIDUAL_AHEAD reads the residual adds' inputs before their GEMVs,
# KV_BEFORE_COUNT issues an attention item's cache loads before it waits for
# its KV head, ORDERED_ATOMICS counts arrivals with release/acquire atomics
# in place of fences, POLLED_HANDOFFS gives each layer's stage outputs their
# own buffers that the next stage polls, in place of grid barriers.
EVICT_FIRST_WEIGHTS, RESIDUAL_AHEAD, KV_BEFORE_COUNT = 1, 4, 8
ORDERED_ATOMICS, POLLED_HANDOFFS = 16, 64
ALL_OPTIONS = (EVICT_FIRST_WEIGHTS | RESIDUAL_AHEAD | KV_BEFORE_COUNT | ORDERED_ATOMICS
               | POLLED_HANDOFFS)
OPTIONS = ALL_OPTIONS
# Experimental, off: decode_blocks="cuda" at tensor-parallel sizes above 1
# (up to MAX_TENSOR_SIZE GPUs of one process), each rank its share of the
# heads and of the MLP's units as the layers' own tensor parallelism splits
# them (weight_specs), out's and down's partial sums exchanged between the
# ranks inside the kernel (ffi/src/transformer_decode/exchange.cuh). It has
# not run on two GPUs; emulate_tensor_ranks tests the exchange on one.
# "auto" never picks it.
TENSOR_PARALLEL = False
MAX_TENSOR_SIZE = 8
_CONTROL_BYTES = 4096
_TIMES_BYTES = 8192
# A trace's rows: per layer, kMaxTraceCtas CTAs of TRACE_EVENTS clocks.
_TRACE_CTAS = 256
TRACE_EVENTS = ("layer_start", "qkv_normed", "qkv_done", "attention_ready", "split_done",
                "attention_done", "attention_arrived", "out_start", "out_gathered", "out_done",
                "out_arrived", "gate_up_start", "gate_up_normed", "gate_up_done",
                "gate_up_arrived", "down_start", "down_gathered", "down_done", "down_arrived",
                "qkv_copy_wait_ns", "out_copy_wait_ns", "gate_up_copy_wait_ns",
                "down_copy_wait_ns", "issue_ns", "warp1_copy_wait_ns")
# Grid barriers a layer without POLLED_HANDOFFS (after attention, out and
# gate/up, and between layers; attention waits on counts, not a barrier).
BARRIERS_PER_LAYER = 4


def unsupported_reason(config: TransformerConfig, *, tensor_size: int,
                       batch: int) -> str | None:
    """Why the kernel cannot run this model's decode step, or None if it can.

    Args:
      config: the model's.
      tensor_size: the mesh's tensor axis size.
      batch: rows per device.
    """
    d, h, f = config.embed_dim, config.head_dim, config.mlp_dim
    if tensor_size > MAX_TENSOR_SIZE:
        return f"it runs at tensor-parallel sizes up to {MAX_TENSOR_SIZE} (got {tensor_size})"
    if tensor_size != 1 and not TENSOR_PARALLEL:
        return (f"it runs at tensor-parallel size 1 (the mesh's is {tensor_size}); its "
                f"tensor-parallel form is experimental "
                f"(models.transformer_decode_cuda.TENSOR_PARALLEL)")
    if why_not := _split_reason(config, tensor_size):
        return why_not
    if jnp.dtype(config.dtype) != jnp.dtype(jnp.bfloat16):
        return f"it computes in bfloat16 (the config's dtype is {config.dtype})"
    if not 1 <= batch <= MAX_BATCH:
        return f"it takes 1 to {MAX_BATCH} rows per device (got {batch})"
    if h not in HEAD_DIMS:
        return f"it takes head_dim in {HEAD_DIMS} (got {h})"
    if config.num_heads // config.num_kv_heads not in (1, 2, 4, MAX_QUERIES_PER_KV):
        return f"it takes 1, 2, 4 or {MAX_QUERIES_PER_KV} query heads per KV head"
    if config.num_layers > MAX_LAYERS:
        return f"it takes at most {MAX_LAYERS} layers (got {config.num_layers})"
    if d % OUT_COLUMNS or f % (GATE_UP_COLUMNS // 2):
        return (f"it needs embed_dim a multiple of {OUT_COLUMNS} and mlp_dim of "
                f"{GATE_UP_COLUMNS // 2} (got {d} and {f})")
    return None


def _split_reason(config: TransformerConfig, ranks: int) -> str | None:
    """Why ``ranks`` tensor ranks cannot split the kernel's work, or None."""
    units = ranks * GATE_UP_COLUMNS // 2
    if config.num_kv_heads % ranks or config.mlp_dim % units:
        return (f"its ranks take whole KV heads and {GATE_UP_COLUMNS // 2}-unit blocks of the "
                f"MLP: num_kv_heads={config.num_kv_heads} and mlp_dim={config.mlp_dim} must "
                f"divide by {ranks} and {units}")
    return None


def decode_blocks(x: jax.Array, pos: jax.Array, weights: DecodeWeights,
                  caches: tuple[KVCache, ...], config: TransformerConfig
                  ) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """One token through every block, per device.

    Args:
      x: [b, d] in bfloat16, the blocks' input (the embedded token).
      pos: int32 scalar, the token's position; the caches hold 0..pos-1.
      weights: :func:`prepare_weights`' result (a rank's shard at a tensor
        size t above 1, :func:`weight_specs`).
      caches: a :class:`~models.layers.KVCache` per layer, [b, KV / t,
        L, h] each; donate them and they are updated in place.
      config: the model's.

    Returns:
      (the blocks' output [b, d], the same on every tensor rank, the caches
      with position ``pos`` written).
    """
    return kernel_or_reference(TARGET, "TransformerConfig(decode_blocks='cuda')",
                               functools.partial(_ffi_decode, config=config),
                               functools.partial(reference, config=config),
                               x, jnp.asarray(pos, jnp.int32), weights, caches)


def _workspace_bytes(batch: int, config: TransformerConfig, ranks: int = 1) -> int:
    """As TransformerDecodeWorkspaceBytes in ffi/src/transformer_decode/params.cuh,
    for one of ``ranks`` tensor ranks."""
    h, heads, kv = config.head_dim, config.num_heads // ranks, config.num_kv_heads // ranks

    def aligned(n):
        return -(-n // 256) * 256

    d, f, layers = config.embed_dim, config.mlp_dim // ranks, config.num_layers
    return (_CONTROL_BYTES + _TIMES_BYTES + aligned(batch * heads * h * 4)
            + aligned(batch * kv * MAX_SPLITS * (heads // kv) * (h + 2) * 4)
            + aligned(batch * heads * h * 2) + aligned(batch * f * 2)
            + aligned(layers * batch * (2 * d + f + 3 * heads * h + 2 * kv * h) * 2))  # handoffs


def _ffi_decode(x, pos, weights, caches, *, config: TransformerConfig,
                stage_times: int = 0):
    ranks = config.num_kv_heads // caches[0].k.shape[1]  # the tensor ranks
    flat = [t for cache in caches for t in cache]
    operands, varying = same_variance(x, pos, _rope_frequencies(config), *weights, *flat)
    # Per device (inside shard_map, or on one device): whole on x's mesh.
    sharding = jax.typeof(x).sharding.update(spec=P())

    def like(shape, dtype, axes=varying):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=axes)

    workspace_bytes = _workspace_bytes(x.shape[0], config, ranks)
    trace_bytes = config.num_layers * _TRACE_CTAS * len(TRACE_EVENTS) * 8 \
        if stage_times == 2 else 0
    # The blocks' output is the same on every tensor rank (the ranks sum
    # their partials inside the kernel), as a psum's.
    same_on_tensor_ranks = varying.update(varying=varying.varying - {config.sharding.tensor})
    results = (like(x.shape, x.dtype, same_on_tensor_ranks),
               like((workspace_bytes + trace_bytes,), jnp.uint8),
               *(like(t.shape, t.dtype) for t in flat))
    first_cache = 3 + len(weights)
    aliases = {first_cache + i: 2 + i for i in range(len(flat))}
    attributes = _attributes(config, ranks, stage_times)
    if ranks == 1:
        call = jax.ffi.ffi_call(TARGET, results, input_output_aliases=aliases)
        out, workspace, *updated = call(*operands, **_NO_GROUP, **attributes)
    else:  # the handler finds its peers among the tensor axis' GPUs
        if (axis_size := jax.lax.axis_size(config.sharding.tensor)) != ranks:
            raise ValueError(f"decode_blocks: the caches hold {config.num_kv_heads // ranks} of "
                             f"{config.num_kv_heads} KV heads, but the tensor axis has "
                             f"{axis_size} ranks")
        out, workspace, *updated = group_ffi_call(
            TARGET, results, *operands, axis_name=config.sharding.tensor,
            input_output_aliases=aliases, **attributes)
    caches = tuple(KVCache(*updated[i:i + 2]) for i in range(0, len(updated), 2))
    if not stage_times:
        return out, caches

    def words(start, count):  # uint32 [count, (low, high)]
        return lax.bitcast_convert_type(workspace[start:start + 8 * count].reshape(count, 2, 4),
                                        jnp.uint32)

    times = words(_CONTROL_BYTES, 2 + 2 * (BARRIERS_PER_LAYER * config.num_layers - 1))
    if stage_times == 1:
        return out, caches, times
    trace = words(workspace_bytes, trace_bytes // 8)
    return out, caches, times, trace.reshape(config.num_layers, _TRACE_CTAS,
                                             len(TRACE_EVENTS), 2)


def _rope_frequencies(config: TransformerConfig) -> jax.Array:
    """The kernel's rotary frequencies, float32 [head_dim / 2]: the model's,
    rope scaling included."""
    return rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)


# What a call that is not group_ffi_call's passes for its group: none.
_NO_GROUP = dict(group_ordinals=np.zeros(0, np.int32), n=np.int32(1))


def _attributes(config: TransformerConfig, ranks: int, stage_times: int,
                emulated: bool = False) -> dict:
    """The kernel's attributes for one of ``ranks`` tensor ranks (``emulated``:
    all of them on this GPU)."""
    return dict(heads=np.int32(config.num_heads // ranks),
                kv_heads=np.int32(config.num_kv_heads // ranks),
                max_splits=np.int32(MAX_SPLITS), eps=np.float32(config.norm_eps),
                timeout_ms=np.int32(settings.get("JAX_FLASHOVERLAP_TIMEOUT_MS")),
                stage_times=np.int32(stage_times), chunk_bytes=np.int32(CHUNK_BYTES),
                ring_slots=np.int32(RING_SLOTS), options=np.int32(OPTIONS),
                emulated_ranks=np.int32(ranks if emulated else 1))


def rank_shards(weights: DecodeWeights, caches: tuple[KVCache, ...], ranks: int
                ) -> tuple[DecodeWeights, tuple[KVCache, ...]]:
    """The whole layout and caches cut over ``ranks`` tensor ranks as
    :func:`weight_specs` and the caches' own spec cut them, stacked by rank.

    Returns:
      (the weights with the norms whole and each matrix [ranks, L, ...] its
      ranks' shards, the caches [ranks, b, KV / ranks, L, h] each).
    """
    def split(a, axis):
        shape = a.shape[:axis] + (ranks, a.shape[axis] // ranks) + a.shape[axis + 1:]
        return jnp.moveaxis(a.reshape(shape), axis, 0)

    shards = weights._replace(qkv=split(weights.qkv, 1), out=split(weights.out, 2),
                              gate_up=split(weights.gate_up, 1), down=split(weights.down, 2))
    return shards, tuple(KVCache(*(split(t, 1) for t in cache)) for cache in caches)


def emulate_tensor_ranks(x: jax.Array, pos: jax.Array, weights: DecodeWeights,
                         caches: tuple[KVCache, ...], config: TransformerConfig, ranks: int
                         ) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """The kernel at tensor-parallel size ``ranks`` on one GPU: each rank a
    launch of its own on 1/ranks of the SMs, exchanging its partial sums
    with the others as ranks on GPUs of their own would. The test of that
    exchange where one GPU is all there is; not a way to decode faster. The
    ranks poll each other, so they must run side by side: with
    ``CUDA_LAUNCH_BLOCKING=1``, under a profiler that serializes kernels, or
    beside other work on the GPU, their polls time out: the step's outputs
    are NaN, and :func:`jax_flashoverlap.check_device_errors` raises, naming
    the ranks, until :func:`jax_flashoverlap.reset`.

    Args:
      x: [b, d] bf16, every rank's input.
      pos: int32 scalar, the token's position.
      weights: :func:`prepare_weights`' whole result.
      caches: whole, [b, KV, L, h] each.
      config: the model's; its KV heads and MLP width divide by ``ranks``.
      ranks: 2 to :data:`MAX_TENSOR_SIZE`.

    Returns:
      (every rank's output [ranks, b, d], which should all be the same; the
      caches whole with position ``pos`` written).
    """
    if not 2 <= ranks <= MAX_TENSOR_SIZE:
        raise ValueError(f"emulate_tensor_ranks: ranks={ranks} must be 2 to {MAX_TENSOR_SIZE}")
    if why_not := _split_reason(config, ranks):
        raise ValueError(f"emulate_tensor_ranks: {why_not}")
    shards, stacked = rank_shards(weights, caches, ranks)
    flat = [t for cache in stacked for t in cache]
    results = (jax.ShapeDtypeStruct((ranks, *x.shape), x.dtype),
               jax.ShapeDtypeStruct((ranks, _workspace_bytes(x.shape[0], config, ranks)),
                                    jnp.uint8),
               *(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in flat))
    first_cache = 3 + len(shards)
    call = jax.ffi.ffi_call(TARGET, results,
                            input_output_aliases={first_cache + i: 2 + i
                                                  for i in range(len(flat))})
    out, _, *updated = call(x, jnp.asarray(pos, jnp.int32), _rope_frequencies(config), *shards,
                            *flat, **_NO_GROUP, **_attributes(config, ranks, 0, emulated=True))

    def whole(t):  # [ranks, b, KV / ranks, L, h] -> [b, KV, L, h]
        return jnp.moveaxis(t, 0, 1).reshape(t.shape[1], -1, *t.shape[3:])

    return out, tuple(KVCache(whole(updated[i]), whole(updated[i + 1]))
                      for i in range(0, len(updated), 2))


def stage_times(x: jax.Array, pos: jax.Array, weights: DecodeWeights,
                caches: tuple[KVCache, ...], config: TransformerConfig, *,
                trace: bool = False):
    """:func:`decode_blocks` on a CUDA GPU, with the kernel's clock readings.

    For probing the kernel (``scripts/transformer_decode_probe.py``).

    Returns:
      (x, caches, uint32 [2 + 2 * (n L - 1), 2]), n = BARRIERS_PER_LAYER:
      %globaltimer in ns (its low and high words) at the launch's start and
      its last CTA's end, then for each of the n L - 1 grid barriers the
      last CTA's arrival and CTA 0's release. With ``trace``, also uint32
      [L, 256, len(TRACE_EVENTS), 2]: each CTA's clock at each of
      TRACE_EVENTS in each layer (0 where it did not pass there; rows past
      the grid are 0); the entries named *_ns are not clocks but durations:
      thread 0's waits for weight copies in each weight stage, its time
      issuing them, and thread 32's waits, in the layer.
    """
    return _ffi_decode(x, jnp.asarray(pos, jnp.int32), weights, caches, config=config,
                       stage_times=2 if trace else 1)


def reference(x: jax.Array, pos: jax.Array, weights: DecodeWeights,
              caches: tuple[KVCache, ...], *, config: TransformerConfig
              ) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """:func:`decode_blocks` in JAX: the kernel's stages on the same layout,
    rounding to the compute dtype where the kernel does.

    Whole, or per device inside ``shard_map``: there each rank attends over
    its own KV heads (``caches``' second axis) and out's and down's partial
    sums, rounded to the compute dtype, are added in float32 over the tensor
    axis, as the kernel's ranks exchange them.
    """
    b = x.shape[0]
    kv, h = caches[0].k.shape[1], config.head_dim
    qpk = config.num_heads // config.num_kv_heads
    tensor = config.sharding.tensor

    def summed(partial):
        # A partial that varies over the tensor axis is a rank's share.
        if tensor not in jax.typeof(partial).manual_axis_type.varying:
            return partial
        return lax.psum(partial.astype(jnp.float32), tensor).astype(partial.dtype)

    pairs = QKV_COLUMNS // 2
    updated = []
    for layer, cache in enumerate(caches):
        # A: items -> [b, kv, role, half, block, 16] -> the model's [b, kv, role, h].
        qkv = items_product(rms_norm(x, weights.attn_norm[layer], eps=config.norm_eps),
                             weights.qkv[layer])
        qkv = qkv.reshape(b, kv, qpk + 2, h // 2 // pairs, 2, pairs)
        qkv = qkv.transpose(0, 1, 2, 4, 3, 5).reshape(b, kv, qpk + 2, h)
        q = rope(qkv[:, :, :qpk].reshape(1, b * kv * qpk, 1, h), config.rope_theta, pos[None],
                 config.rope_scaling)
        k = rope(qkv[:, :, qpk].reshape(1, b * kv, 1, h), config.rope_theta, pos[None],
                 config.rope_scaling)
        k = k.reshape(b, kv, 1, h)
        v = qkv[:, :, qpk + 1].reshape(b, kv, 1, h)
        cache = KVCache(*(lax.dynamic_update_slice(c, t, (0, 0, pos, 0))
                          for c, t in ((cache.k, k), (cache.v, v))))
        updated.append(cache)
        # B: attention over positions 0..pos, in float32; what lies past pos
        # is never read (it may be anything, NaN too).
        q = q.reshape(b, kv, qpk, h).astype(jnp.float32)
        valid = jnp.arange(cache.k.shape[2]) <= pos
        keys, values = (jnp.where(valid[:, None], c, 0).astype(jnp.float32) for c in cache)
        scores = jnp.einsum("bgqh,bglh->bgql", q, keys) / np.sqrt(h)
        scores = jnp.where(valid, scores, -jnp.inf)
        attended = jnp.einsum("bgql,bglh->bgqh", jax.nn.softmax(scores, axis=-1), values)
        attended = attended.reshape(b, -1).astype(x.dtype)
        # C, D, E.
        x = x + summed(items_product(attended, weights.out[layer]))
        gate_up = items_product(rms_norm(x, weights.mlp_norm[layer], eps=config.norm_eps),
                                 weights.gate_up[layer]).reshape(b, -1, 2)
        gate, up = (gate_up[..., i].astype(jnp.float32) for i in (0, 1))
        x = x + summed(items_product((jax.nn.silu(gate) * up).astype(x.dtype),
                                      weights.down[layer]))
    return x, tuple(updated)
