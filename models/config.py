"""Frozen configurations of the models, with presets, and their sharding:
what the models share, and the Transformer's (Mamba-2's: :mod:`.mamba_config`).

Dimension letters in names: b batch, s sequence, d model width, v vocabulary.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jax_flashoverlap import IMPLS
from jax_flashoverlap.decode_matmul import DECODE_MATMUL_IMPLS
from jax_flashoverlap.dispatch import AUTO_OPS

__all__ = ["ShardingConfig", "TransformerConfig", "RopeScaling", "IMPLS", "SIZES",
           "ATTENTION_IMPLS", "NORM_BACKWARDS", "DECODE_MATMUL_IMPLS", "DECODE_ATTENTION_IMPLS",
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
# The models' param_dtype: how the weight matrices and the embedding are
# stored. bfloat16 halves the memory of a model that only decodes; its
# values are what a bfloat16 compute dtype reads of float32 ones.
PARAM_DTYPES = ("float32", "bfloat16")
# How RMSNorm's backward gets what it needs: "autodiff" keeps (or, under a
# checkpoint policy, recomputes) the float32 intermediates of the forward;
# "recompute" is a custom_vjp that keeps only the norm's inputs and recomputes
# its statistics inside the backward; "pallas" keeps the same, forward and
# backward as fused GPU kernels (models.norm_pallas); "auto" is "pallas" on
# GPUs, XLA's ops keeping only the inputs elsewhere.
NORM_BACKWARDS = ("auto", "autodiff", "recompute", "pallas")


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
      dtype: compute dtype ("float32", "bfloat16").
      param_dtype: storage dtype of the weight matrices and the embedding,
        one of :data:`PARAM_DTYPES`: "float32" (default, for training) or
        "bfloat16" (half the memory, for a model that decodes); the norms'
        weights stay float32.
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
    param_dtype: str = "float32"
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
        _check_choices(self, {"param_dtype": PARAM_DTYPES,
                              "attention_impl": ATTENTION_IMPLS,
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
