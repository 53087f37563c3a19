"""Frozen configurations of the models, with presets, and their sharding.

Dimension letters in names: b batch, s sequence, d model width, v vocabulary.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jax_flashoverlap import IMPLS
from jax_flashoverlap.decode_matmul import DECODE_MATMUL_IMPLS
from jax_flashoverlap.dispatch import AUTO_OPS

__all__ = ["ShardingConfig", "TransformerConfig", "RopeScaling", "MambaConfig", "SSDTiling",
           "IMPLS", "SIZES",
           "ATTENTION_IMPLS", "SSD_IMPLS", "CONV_IMPLS", "NORM_BACKWARDS", "RESIDUALS",
           "DECODE_MATMUL_IMPLS", "DECODE_ATTENTION_IMPLS", "DECODE_MIXER_IMPLS",
           "DECODE_BLOCKS"]

# Preset name -> the config classmethod that makes it.
SIZES = {"tiny": "tiny", "small": "small", "1b": "b1"}
# TransformerConfig.attention_impl: "cudnn" is cuDNN's flash attention, "xla"
# XLA's reference attention (it materialises the [s, s] scores), "auto" the
# first where cuDNN supports the device, dtype and head size, else the second.
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# TransformerConfig.decode_attention, a decode step's attention: "model" is
# the model's attention_impl with XLA's cache update; "pallas" one kernel
# that attends and writes the new position into the cache
# (models.decode_attention_pallas); "auto" the kernel on CUDA GPUs where it
# takes the heads and the batch is small, else "model".
DECODE_ATTENTION_IMPLS = ("model", "pallas", "auto")
# TransformerConfig.decode_blocks, how a decode step runs the blocks:
# "layers" each block's own decode (the choices above apply); "cuda" every
# block in one CUDA kernel (models.transformer_decode_cuda; tensor-parallel
# size 1, bfloat16, a few rows per device); "auto" the kernel where it runs
# and was measured faster (models.transformer.decode_blocks_implementation).
DECODE_BLOCKS = ("auto", "layers", "cuda")
# MambaConfig.decode_mixer, a decode step's work between in_proj and the
# gated norm (convolution, SSM state update, skip): "xla" is XLA's ops,
# "pallas" one kernel a layer (models.mamba_decode_pallas; opt-in: slower
# than XLA's fusions on one H200).
DECODE_MIXER_IMPLS = ("xla", "pallas")
# The SSD's intra-chunk step: einsums, fused Pallas GPU kernels, or the
# kernels where they can run (models.mamba.ssd).
SSD_IMPLS = ("auto", "xla", "pallas")
# The backward of Mamba-2's in_proj split, convolution and SiLU: one Pallas
# kernel (models.conv_pallas), XLA's ops, or the kernel where it can run.
CONV_IMPLS = ("auto", "xla", "pallas")
# How RMSNorm's backward gets what it needs: "autodiff" keeps (or, under a
# checkpoint policy, recomputes) the float32 intermediates of the forward;
# "recompute" is a custom_vjp that keeps only the norm's inputs and recomputes
# its statistics inside the backward; "pallas" keeps the same, forward and
# backward as fused GPU kernels (models.norm_pallas); "auto" is "pallas" on
# GPUs, XLA's ops keeping only the inputs elsewhere.
NORM_BACKWARDS = ("auto", "autodiff", "recompute", "pallas")
# What a Mamba-2 block keeps for its backward (models.mamba.Mamba2): the
# values Mamba2.saved_in_backward names, recomputing the rest; or every
# residual autodiff keeps.
RESIDUALS = ("named", "all")


@dataclasses.dataclass(frozen=True)
class SSDTiling:
    """How the Pallas SSD's kernels cut their work (``models.ssd_pallas``);
    None leaves a setting at the kernels' default.

    Attributes:
      block: rows of the intra-chunk tiles and of the state kernels' row
        blocks: a power of two from 16 dividing the chunk (default min(chunk,
        64)).
      block_cols: columns of the intra-chunk tiles, the same kind of number
        (default: ``block``, square tiles).
      num_warps: warps per kernel program (default 4).
      num_stages: software-pipeline stages of the kernels' loops (default 3).
    """

    block: int | None = None
    block_cols: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    @classmethod
    def parse(cls, tiles: str | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> SSDTiling:
        """From the trainer's flags: ``tiles`` "ROWS" or "ROWSxCOLS"."""
        if tiles is None:
            return cls(num_warps=num_warps, num_stages=num_stages)
        sides = tiles.lower().split("x")
        if len(sides) > 2 or not all(side.isdigit() for side in sides):
            raise ValueError(f"SSD tiles {tiles!r}: write ROWS or ROWSxCOLS, e.g. 128x64")
        block, cols = int(sides[0]), int(sides[-1])
        return cls(block, cols if len(sides) == 2 else None, num_warps, num_stages)

    def problem(self, chunk_size: int) -> str | None:
        """Which setting the kernels cannot take at ``chunk_size``, and why;
        None when they take them all."""
        for name in ("block", "block_cols"):
            side = getattr(self, name)
            if side is not None and (side < 16 or side & (side - 1) or chunk_size % side):
                return (f"{name}={side} must be a power of two from 16 that divides "
                        f"chunk_size={chunk_size}")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                return f"{name}={getattr(self, name)} must be at least 1"
        return None

    def check(self, chunk_size: int) -> None:
        """A ValueError naming the setting the kernels cannot take at ``chunk_size``."""
        if why := self.problem(chunk_size):
            raise ValueError(f"SSDTiling: {why}")

    def kernel_options(self, *, columns: bool = True) -> dict:
        """The settings that are set, as ``ssd_pallas.chunk_output``'s keyword
        arguments (``columns=False``: ``chunk_states``', without block_cols)."""
        options = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if not columns:
            options.pop("block_cols", None)
        return options


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How a model maps onto a (data, tensor) mesh.

    Weights are split over ``tensor`` by the parallel layers themselves
    (column-parallel kernels ``P(None, tensor)``, row-parallel ``P(tensor,
    None)``, per-head vectors ``P(tensor)``); everything else is replicated.
    The batch is split over ``data``. With ``sequence_parallel`` the residual
    stream between the tensor-parallel layers is split along the sequence
    over ``tensor`` too; without it, it is replicated over ``tensor``.

    Attributes:
      data: name of the data-parallel mesh axis.
      tensor: name of the tensor-parallel mesh axis.
      sequence_parallel: shard the residual stream along the sequence.
    """

    data: str = "data"
    tensor: str = "tensor"
    sequence_parallel: bool = True

    @property
    def tokens_sb(self) -> P:
        """Token ids, targets and per-token values, [seq, batch]."""
        return P(self.tensor if self.sequence_parallel else None, self.data)

    @property
    def act_sbd(self) -> P:
        """The residual stream (and logits), [seq, batch, d]."""
        return P(*self.tokens_sb, None)

    def check_axes(self, mesh_shape: dict[str, int], *, model: str) -> None:
        """A clear error for a mesh without the data and tensor axes."""
        missing = [a for a in (self.data, self.tensor) if a not in mesh_shape]
        if missing:
            raise ValueError(f"{model}: the mesh has axes {tuple(mesh_shape)} but the "
                             f"sharding config needs {missing}; build it as "
                             f"jax.make_mesh((data, tensor), ({self.data!r}, {self.tensor!r}))")

    def check(self, mesh_shape: dict[str, int], *, batch: int, seq_len: int | None,
              model: str) -> None:
        """Clear errors for a mesh or a batch shape that cannot be split
        (``seq_len`` None: the batch alone)."""
        self.check_axes(mesh_shape, model=model)
        tp, dp = mesh_shape[self.tensor], mesh_shape[self.data]
        if batch % dp:
            raise ValueError(f"{model}: batch {batch} does not divide by the {dp} ranks of "
                             f"the data axis {self.data!r}; use a multiple of {dp}.")
        if seq_len is not None and self.sequence_parallel and seq_len % tp:
            raise ValueError(f"{model}: sequence length {seq_len} does not divide by the {tp} "
                             f"ranks of the tensor axis {self.tensor!r} (sequence "
                             f"parallelism splits it); use a multiple of {tp}.")


def _check_length(model: str, seq_len: int | None, max_seq_len: int) -> None:
    if seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"{model}: sequence length {seq_len} exceeds max_seq_len="
                         f"{max_seq_len}; use a shorter sequence, or a config with a larger "
                         f"max_seq_len.")


class _Presets:
    """``Config.preset(name, **overrides)`` for the names in :data:`SIZES`."""

    @classmethod
    def preset(cls, name: str, **overrides):
        if name not in SIZES:
            raise ValueError(f"{cls.__name__}: unknown size {name!r}; choose from "
                             f"{list(SIZES)}")
        return dataclasses.replace(getattr(cls, SIZES[name])(), **overrides)


def _check_choices(config, choices: dict[str, tuple[str, ...]]) -> None:
    """Each field of ``config`` that ``choices`` names holds one of its values."""
    for field, allowed in choices.items():
        value = getattr(config, field)
        if value not in allowed:
            raise ValueError(f"{type(config).__name__}: {field} must be one of {allowed}, "
                             f"got {value!r}")


def _check_impl(model: str, impl: str, auto_xla_ops: tuple[str, ...]) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{model}: impl must be one of {IMPLS}, got {impl!r}")
    unknown = sorted(set(auto_xla_ops) - set(AUTO_OPS))
    if unknown:
        raise ValueError(f"{model}: auto_xla_ops {unknown} are not ops; expected names "
                         f"among {AUTO_OPS}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of the rotary frequencies for long contexts
    (``rope_scaling`` with ``rope_type: "llama3"`` in a Hugging Face config):
    wavelengths above ``original_max_position / low_freq_factor`` are divided
    by ``factor``, those below ``original_max_position / high_freq_factor``
    kept, and those between interpolated.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self):
        if not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0
                and self.original_max_position > 0):
            raise ValueError(f"RopeScaling: need factor > 0, high_freq_factor > "
                             f"low_freq_factor > 0 and original_max_position > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig(_Presets):
    """A Llama-style decoder.

    Attributes:
      vocab_size: v (256 for byte-level tokens).
      num_layers: decoder blocks.
      embed_dim: d.
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention); divides
        ``num_heads``, and must divide by the tensor-parallel size.
      head_dim: h.
      mlp_dim: f, the SwiGLU width; must divide by the tensor-parallel size.
      rope_theta: rotary embedding base.
      rope_scaling: Llama 3.1's frequency stretch (:class:`RopeScaling`), or
        None.
      tie_embeddings: the LM head is the embedding's transpose (no weight of
        its own), as in Llama 3.2 1B and 3B.
      norm_eps: RMSNorm epsilon.
      max_seq_len: the longest sequence the model takes: training's sequence
        length, and prompt plus generated tokens in
        :func:`~jax_flashoverlap.models.generate`.
      dtype: compute dtype ("float32", "bfloat16"); parameters stay float32.
      impl: implementation of the overlap ops.
      attention_impl: "auto", "xla" or "cudnn" (see :data:`ATTENTION_IMPLS`
        and :func:`models.transformer.attention_implementation`).
      decode_matmul: the weight matmuls of a decode step, one of
        :data:`DECODE_MATMUL_IMPLS`: "xla" (default) or "cuda", the
        library's kernel for a few rows (bf16, at most 8 rows per device;
        XLA's dot elsewhere; see :mod:`jax_flashoverlap.decode_matmul`), an
        experiment slower than XLA's on one H200 so far.
      decode_attention: a decode step's attention over the KV cache, one
        of :data:`DECODE_ATTENTION_IMPLS`: "model" (the model's
        ``attention_impl``, the cache updated by XLA), "pallas" (one Pallas
        GPU kernel that also writes the cache) or "auto" (default: the
        kernel on CUDA GPUs where it takes the heads, at batches per device
        up to ``models.decode_attention_pallas.AUTO_MAX_BATCH``, else
        "model"; see :func:`models.transformer.decode_attention_implementation`).
        On one H200 the kernel was 1.077x cuDNN's step at batch 1, 0.994x at
        8 and 0.967x at 32, and "auto" 1.051x "model" at batch 1 in another
        process (docs/models.md).
      decode_blocks: how a decode step runs the blocks, one of
        :data:`DECODE_BLOCKS`: "layers", each block's decode as above;
        "cuda", all blocks as one CUDA kernel a step
        (:mod:`models.transformer_decode_cuda`: tensor-parallel size 1,
        bfloat16, at most 4 rows per device, head_dim 64 or 128; an error
        names what else rules it out), its weights a second copy in the
        kernel's layout; or "auto" (default): the kernel on Hopper GPUs at
        up to 2 rows per device, where it runs and its copy takes at most
        half the free memory, else "layers" (see
        :func:`models.transformer.decode_blocks_implementation`). On one
        H200 the 1B model's token took 0.726 ms with the kernel against
        0.884 with the layers at batch 1, 0.796 against 0.923 at batch 2,
        0.940 against 0.920 at batch 4 (docs/models.md).
      remat: recompute each block in the backward pass (saves memory).
      scan_layers: run the blocks as one ``lax.scan`` (one block compiled,
        not ``num_layers``); False unrolls them. None (default): unrolled
        when the attention is cuDNN's, scanned otherwise (see
        :func:`models.transformer.resolve_scan_layers`).
      sharding: how it maps onto the mesh.
      auto_xla_ops: ops that ``impl="auto"`` leaves to XLA in this model's
        training step (``jax_flashoverlap.dispatch.prefer_xla``); none: each
        op as :mod:`jax_flashoverlap.dispatch` measured it.
    """

    vocab_size: int = 256
    num_layers: int = 2
    embed_dim: int = 64
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 16
    mlp_dim: int = 128
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    dtype: str = "float32"
    impl: str = "auto"
    attention_impl: str = "auto"
    decode_matmul: str = "xla"
    decode_attention: str = "auto"
    decode_blocks: str = "auto"
    remat: bool = False
    scan_layers: bool | None = None
    sharding: ShardingConfig = ShardingConfig()
    auto_xla_ops: tuple[str, ...] = ()

    def __post_init__(self):
        _check_impl("TransformerConfig", self.impl, self.auto_xla_ops)
        _check_choices(self, {"attention_impl": ATTENTION_IMPLS,
                              "decode_matmul": DECODE_MATMUL_IMPLS,
                              "decode_attention": DECODE_ATTENTION_IMPLS,
                              "decode_blocks": DECODE_BLOCKS})
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TransformerConfig: num_heads={self.num_heads} must be a "
                             f"multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig: head_dim={self.head_dim} must be even "
                             f"(rotary embeddings rotate pairs of channels)")

    @classmethod
    def tiny(cls) -> TransformerConfig:
        return cls()

    @classmethod
    def small(cls) -> TransformerConfig:
        return cls(num_layers=8, embed_dim=512, num_heads=8, num_kv_heads=4, head_dim=64,
                   mlp_dim=1536)

    @classmethod
    def b1(cls) -> TransformerConfig:
        """~1.0B parameters: Llama-3.2-1B's width and depth, 128-wide heads."""
        return cls(num_layers=16, embed_dim=2048, num_heads=16, num_kv_heads=8,
                   head_dim=128, mlp_dim=8192, rope_theta=500_000.0, max_seq_len=131_072,
                   dtype="bfloat16")

    def sequence_multiple(self, tp: int) -> int:
        """Sequence lengths must be a multiple of this on ``tp`` tensor ranks."""
        return tp if self.sharding.sequence_parallel else 1

    def check(self, mesh_shape: dict[str, int], *, batch: int,
              seq_len: int | None = None) -> None:
        """Clear errors for a mesh, batch or sequence length this model cannot
        take (``seq_len`` None: no sequence checks)."""
        self.sharding.check(mesh_shape, batch=batch, seq_len=seq_len, model="Transformer")
        _check_length("Transformer", seq_len, self.max_seq_len)
        tp = mesh_shape[self.sharding.tensor]
        for name in ("num_kv_heads", "mlp_dim"):
            if getattr(self, name) % tp:
                raise ValueError(
                    f"Transformer: {name}={getattr(self, name)} does not divide by the "
                    f"tensor-parallel size {tp} (heads and MLP width are split over "
                    f"{self.sharding.tensor!r}); use a tensor axis size that divides it.")

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training token (forward + backward, no recompute).

        6 per weight of every matmul, plus causal attention: per head, QK^T
        and AV cost 2·2·h FLOPs per (query, key) pair, over s/2 keys on average.
        """
        d, h = self.embed_dim, self.head_dim
        qkv_o = d * (self.num_heads + 2 * self.num_kv_heads) * h + self.num_heads * h * d
        matmul_weights = self.num_layers * (qkv_o + 3 * d * self.mlp_dim) + d * self.vocab_size
        attention = self.num_layers * self.num_heads * 2 * 2 * h * seq_len / 2
        return 6 * matmul_weights + 3 * attention


@dataclasses.dataclass(frozen=True)
class MambaConfig(_Presets):
    """A Mamba-2 language model (SSD mixer blocks, no MLP).

    Attributes:
      vocab_size: v.
      num_layers: mixer blocks.
      embed_dim: d.
      state_dim: N, the SSM state size per head.
      head_dim: P, channels per SSM head; heads = expand·d / P.
      num_groups: G, groups sharing B and C (like key/value heads); must
        divide by the tensor-parallel size, and divide the heads.
      expand: inner width = expand·d.
      conv_width: the causal depthwise convolution's kernel size.
      chunk_size: SSD chunk length (a sequence that is not a multiple is
        padded inside the scan).
      dt_min, dt_max: range of the initial time steps.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the LM head is the embedding's transpose (no weight of
        its own), as in state-spaces' Mamba-2 checkpoints.
      max_seq_len: the longest sequence the model takes: training's sequence
        length, and prompt plus generated tokens in
        :func:`~jax_flashoverlap.models.generate`.
      dtype: compute dtype; parameters stay float32.
      impl: implementation of the overlap ops.
      remat: recompute each block in the backward pass.
      scan_layers: run the blocks as one ``lax.scan``; False unrolls them.
        None (default): unrolled on GPUs, scanned elsewhere (see
        :func:`models.mamba.resolve_scan_layers`).
      ssd_impl: the SSD's intra-chunk step, one of :data:`SSD_IMPLS` (see
        :func:`models.mamba.ssd`).
      conv_impl: the backward of in_proj's split, the causal convolution
        and its SiLU, one of :data:`CONV_IMPLS`: "pallas", one GPU kernel
        that writes in_proj's output gradient (:mod:`models.conv_pallas`);
        "xla", XLA's ops; "auto" (default), the kernel on CUDA GPUs (at the
        1.4B size and sequence 8192 on one H200: a step 241.1 ms against
        247.3 with "xla"), XLA's ops
        elsewhere. The forward is XLA's either way.
      norm_backward: the gated norm's backward, one of
        :data:`NORM_BACKWARDS` (see :func:`models.layers.rms_norm`). "auto"
        (default): fused Pallas kernels on GPUs (at the 1.4B size and
        sequence 8192 on one H200: a step 257.2 ms against 264.1 with
        "autodiff"), XLA's ops elsewhere.
      fuse_skip: the SSD adds the D skip and writes y in the compute dtype
        (inside its output kernel on the Pallas path; default) instead of the
        model adding it to a float32 y. At the 1.4B size and sequence 8192 on
        one H200: a step 265.9 ms against 274.7 without, the same peak memory.
      ssd_tiling: the Pallas SSD kernels' tiles, warps and pipeline
        stages (:class:`SSDTiling`; the default leaves each at the kernels'
        own).
      ssd_keeps_chunk_states: the SSD's backward keeps the chunk states of
        its forward instead of computing them again (``keep_chunk_states``
        of :func:`models.mamba.ssd`; about 0.1 GB more per layer at the 1.4B
        size and sequence 8192). Off: the 1.4B step took 4.7 GB more and
        was no faster than its own spread.
      decode_matmul: the weight matmuls of a decode step, one of
        :data:`DECODE_MATMUL_IMPLS` (see :class:`TransformerConfig`).
      decode_mixer: a decode step's convolution, SSM state update and skip,
        one of :data:`DECODE_MIXER_IMPLS` (see
        :func:`models.mamba.decode_mixer_implementation`): "xla" (default)
        or "pallas", one Pallas GPU kernel a layer
        (:mod:`models.mamba_decode_pallas`; on one H200 3.79 µs a layer for
        XLA's ops against 4.10 for the kernel at batch 1).
      residuals: what a block keeps for the backward, one of
        :data:`RESIDUALS`: "named" (default) recomputes the block's
        elementwise work from the values ``Mamba2.saved_in_backward`` names;
        "all" keeps every residual (measured at the 1.4B size and sequence
        8192 on one H200: a step 254.0 ms against the default's 270.5, about
        0.6 GB more per layer).
      sharding: how it maps onto the mesh.
      auto_xla_ops: ops that ``impl="auto"`` leaves to XLA in this model's
        training step (``jax_flashoverlap.dispatch.prefer_xla``, entered by
        ``jax_flashoverlap.cli.train``). matmul_reduce_scatter by default: the
        1b step on 2 H200s (scanned blocks, bf16, sequence 8192) took 455.5
        ms with it fused against 416.6 under impl="xla" in one process, and
        389.0 with it left to XLA against 416.4 in another, although the fused op alone beats
        XLA at the block's shape. Why is not known yet.
    """

    vocab_size: int = 256
    num_layers: int = 2
    embed_dim: int = 64
    state_dim: int = 16
    head_dim: int = 16
    num_groups: int = 4
    expand: int = 2
    conv_width: int = 4
    chunk_size: int = 16
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 8192
    dtype: str = "float32"
    impl: str = "auto"
    remat: bool = False
    scan_layers: bool | None = None
    ssd_impl: str = "auto"
    conv_impl: str = "auto"
    norm_backward: str = "auto"
    residuals: str = "named"
    fuse_skip: bool = True
    ssd_keeps_chunk_states: bool = False
    ssd_tiling: SSDTiling = SSDTiling()
    decode_matmul: str = "xla"
    decode_mixer: str = "xla"
    sharding: ShardingConfig = ShardingConfig()
    auto_xla_ops: tuple[str, ...] = ("matmul_reduce_scatter",)

    def __post_init__(self):
        _check_impl("MambaConfig", self.impl, self.auto_xla_ops)
        _check_choices(self, {"ssd_impl": SSD_IMPLS, "conv_impl": CONV_IMPLS,
                              "residuals": RESIDUALS, "norm_backward": NORM_BACKWARDS,
                              "decode_matmul": DECODE_MATMUL_IMPLS,
                              "decode_mixer": DECODE_MIXER_IMPLS})
        if self.remat and self.residuals != "named":
            raise ValueError(f"MambaConfig: remat (recompute every block) and "
                             f"residuals={self.residuals!r} exclude each other; set one")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"MambaConfig: chunk_size={self.chunk_size!r} must be a positive "
                             f"int")
        self.ssd_tiling.check(self.chunk_size)
        if self.inner_dim % self.head_dim:
            raise ValueError(f"MambaConfig: inner width expand*embed_dim={self.inner_dim} "
                             f"must be a multiple of head_dim={self.head_dim}")
        if self.num_heads % self.num_groups:
            raise ValueError(f"MambaConfig: num_heads={self.num_heads} must be a multiple "
                             f"of num_groups={self.num_groups}")

    @property
    def inner_dim(self) -> int:
        return self.expand * self.embed_dim

    @property
    def num_heads(self) -> int:
        return self.inner_dim // self.head_dim

    @classmethod
    def tiny(cls) -> MambaConfig:
        return cls()

    @classmethod
    def small(cls) -> MambaConfig:
        return cls(num_layers=8, embed_dim=512, state_dim=64, head_dim=64, num_groups=4,
                   chunk_size=128)

    @classmethod
    def b1(cls) -> MambaConfig:
        """~1.4B parameters: mamba2-1.3b's width and depth, 8 groups (as Megatron) for TP."""
        return cls(num_layers=48, embed_dim=2048, state_dim=128, head_dim=64, num_groups=8,
                   chunk_size=256, max_seq_len=131_072, dtype="bfloat16")

    def sequence_multiple(self, tp: int) -> int:
        """Sequence lengths must be a multiple of this on ``tp`` tensor ranks:
        of ``tp`` under sequence parallelism (the scan pads to its chunks)."""
        return tp if self.sharding.sequence_parallel else 1

    def check(self, mesh_shape: dict[str, int], *, batch: int,
              seq_len: int | None = None) -> None:
        """Clear errors for a mesh, batch or sequence length this model cannot
        take (``seq_len`` None: no sequence checks)."""
        self.sharding.check(mesh_shape, batch=batch, seq_len=seq_len, model="Mamba2")
        _check_length("Mamba2", seq_len, self.max_seq_len)
        tp = mesh_shape[self.sharding.tensor]
        if self.num_groups % tp:
            raise ValueError(
                f"Mamba2: num_groups={self.num_groups} (of num_heads={self.num_heads}) does "
                f"not divide by the tensor-parallel size {tp}: heads and their B/C groups "
                f"are split over {self.sharding.tensor!r}; use a tensor axis size that "
                f"divides {self.num_groups}, or more groups.")

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training token (forward + backward, no recompute).

        6 per weight of the projections, plus the SSD scan of each head: the
        intra-chunk products C·B^T (per group) and (L∘CB)·x (per head) over
        l/2 earlier positions on average (2·l/2·N and 2·l/2·P), the chunk
        state (2·N·P per head) and its read-out (2·N·P per head). The
        convolution and elementwise work are left out.
        """
        del seq_len  # The SSD cost per token depends on the chunk, not the sequence.
        d, n = self.embed_dim, self.state_dim
        in_proj = d * (2 * self.inner_dim + 2 * self.num_groups * n + self.num_heads)
        weights = self.num_layers * (in_proj + self.inner_dim * d) + d * self.vocab_size
        return 6 * weights + 3 * self.num_layers * self.ssd_flops_per_token()

    def ssd_flops_per_token(self) -> float:
        """Forward FLOPs of one layer's SSD scan per token (see :meth:`flops_per_token`)."""
        n, p, chunk = self.state_dim, self.head_dim, self.chunk_size
        return (self.num_groups * chunk * n
                + self.num_heads * (chunk * p + 4 * n * p))
