"""How the Pallas SSD kernels (:mod:`.ssd_pallas`, :mod:`.ssd_state_pallas`)
cut a chunk, and which shapes they take."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from .mamba_config import SSDTiling
from .pallas_gpu import plgpu

__all__ = ["Tiling", "unsupported_reason", "precision_of", "tiling_of"]

_MAX_BLOCK = 64


class Tiling(NamedTuple):
    """How the kernels cut a chunk: [block, cols] tiles of the chunk's
    [l, l] products (``block_cols`` None: square), ``num_warps`` warps per
    program (None: Triton's default, 4), ``num_stages`` stages of the loops'
    software pipelines (None: Pallas's default, 3); ``interpret`` runs them
    in Pallas's interpreter."""

    chunk_size: int
    block: int
    num_warps: int | None = None
    interpret: bool = False
    num_stages: int | None = None
    block_cols: int | None = None

    @property
    def cols(self) -> int:
        """The tiles' columns."""
        return self.block if self.block_cols is None else self.block_cols

    def params(self) -> dict:
        """pallas_call's keyword arguments."""
        return dict(interpret=self.interpret,
                    compiler_params=plgpu.CompilerParams(num_warps=self.num_warps,
                                                         num_stages=self.num_stages))


def unsupported_reason(chunk_size: int, head_dim: int, heads_per_group: int,
                       state_dim: int) -> str | None:
    """Why these kernels cannot run a shape, or None when they can.

    Triton tiles have power-of-two sides, and its tensor-core products need
    at least 16 along each.
    """
    if plgpu is None:
        return "this jax has no Pallas Triton backend"
    sides = (("chunk_size", chunk_size), ("head_dim", head_dim), ("state_dim", state_dim))
    for name, value in sides + (("heads per group", heads_per_group),):
        if value & (value - 1):
            return f"{name}={value} is not a power of two"
    for name, value in sides:
        if value < 16:
            return f"{name}={value} is below 16"
    return None


def precision_of(dtype) -> lax.Precision | None:
    # float32 callers ask for float32 results (the reference path's); 16-bit
    # inputs take the tensor cores' native products.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def tiling_of(caller: str, s: int, chunk_size: int, reason: str | None, block: int | None,
            num_warps: int | None, interpret: bool, num_stages: int | None = None,
            block_cols: int | None = None) -> Tiling:
    """The Tiling of a public function's arguments, or a ValueError naming them."""
    if reason:
        raise ValueError(f"ssd_pallas.{caller}: {reason}; use the XLA SSD (ssd_impl='xla').")
    if s % chunk_size:
        raise ValueError(f"ssd_pallas.{caller}: sequence length {s} is not a multiple "
                         f"of chunk_size={chunk_size}")
    block = min(chunk_size, _MAX_BLOCK) if block is None else block
    if why := SSDTiling(block, block_cols, num_warps, num_stages).problem(chunk_size):
        raise ValueError(f"ssd_pallas.{caller}: {why}")
    return Tiling(chunk_size, block, num_warps, interpret, num_stages, block_cols)
