"""Mamba-2's frozen configuration, with presets (:class:`MambaConfig`), and
how its Pallas SSD kernels cut their work (:class:`SSDTiling`)."""

from __future__ import annotations

import dataclasses

from jax_flashoverlap.decode_matmul import DECODE_MATMUL_IMPLS

from .config import (
    NORM_BACKWARDS,
    PARAM_DTYPES,
    ShardingConfig,
    _check_choices,
    _check_impl,
    _check_length,
    _Presets,
)

__all__ = ["MambaConfig", "SSDTiling", "SSD_IMPLS", "CONV_IMPLS", "RESIDUALS",
           "DECODE_MIXER_IMPLS", "MAMBA_DECODE_BLOCKS"]

# MambaConfig.decode_mixer, a decode step's work between in_proj and the
# gated norm (convolution, SSM state update, skip): "xla" is XLA's ops,
# "pallas" one kernel a layer (models.mamba_decode_pallas; opt-in: slower
# than XLA's fusions on one H200).
DECODE_MIXER_IMPLS = ("xla", "pallas")
# MambaConfig.decode_blocks: each layer's own decode step, or every block of
# a step as one CUDA kernel (models.mamba_decode_cuda; opt-in).
MAMBA_DECODE_BLOCKS = ("layers", "cuda")
# The SSD's intra-chunk step: einsums, fused Pallas GPU kernels, or the
# kernels where they can run (models.mamba.ssd).
SSD_IMPLS = ("auto", "xla", "pallas")
# The backward of Mamba-2's in_proj split, convolution and SiLU: one Pallas
# kernel (models.conv_pallas), XLA's ops, or the kernel where it can run.
CONV_IMPLS = ("auto", "xla", "pallas")
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
      dtype: compute dtype.
      param_dtype: storage dtype of in_proj, out_proj and the embedding,
        one of :data:`~models.config.PARAM_DTYPES` ("float32", default, or
        "bfloat16" for a model that decodes); the convolution, the SSM's
        vectors and the norms stay float32.
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
      decode_blocks: how a decode step runs the blocks, one of
        :data:`MAMBA_DECODE_BLOCKS`: "layers" (default), each layer's own
        step through XLA's kernels (and ``decode_mixer``); or "cuda", every
        block of the step as one CUDA kernel (:mod:`models.mamba_decode_cuda`:
        bfloat16, tensor-parallel size 1, at most 4 rows per device; a
        ValueError names what else it cannot run). Elsewhere than on a CUDA
        GPU "cuda" runs the kernel's arithmetic in JAX.
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
    param_dtype: str = "float32"
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
    decode_blocks: str = "layers"
    sharding: ShardingConfig = ShardingConfig()
    auto_xla_ops: tuple[str, ...] = ("matmul_reduce_scatter",)

    def __post_init__(self):
        _check_impl("MambaConfig", self.impl, self.auto_xla_ops)
        _check_choices(self, {"param_dtype": PARAM_DTYPES,
                              "ssd_impl": SSD_IMPLS, "conv_impl": CONV_IMPLS,
                              "residuals": RESIDUALS, "norm_backward": NORM_BACKWARDS,
                              "decode_matmul": DECODE_MATMUL_IMPLS,
                              "decode_mixer": DECODE_MIXER_IMPLS,
                              "decode_blocks": MAMBA_DECODE_BLOCKS})
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
