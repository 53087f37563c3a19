"""Mamba-2 (SSD) with Megatron-style tensor parallelism on the overlap ops.

Each mixer: in_proj column-parallel (under sequence parallelism an
all-gather→GEMM that also brings the whole sequence, which the scan needs),
then the causal depthwise convolution, the SSD scan and the gated grouped
RMSNorm, all local to the rank's heads and groups, then out_proj
row-parallel (a GEMM→reduce-scatter back to sequence shards).

The fused in_proj and the convolution keep their channels grouped by B/C
group, ``[z, x, B, C, dt]`` and ``[x, B, C]`` per group, so that a contiguous
shard is a set of whole groups at any tensor-parallel size dividing the
number of groups, and the parameters do not depend on it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

from . import conv_pallas, mamba_decode_cuda, mamba_decode_pallas
from .conv_pallas import causal_conv1d
from .layers import CausalLM, RMSNorm, linear_options
from .mamba_config import SSD_IMPLS, MambaConfig
from .ssd import SSD_STATES_NAME, ssd, ssd_step

__all__ = ["Mamba2", "Mamba2Block", "Mamba2Mixer", "SSD_IMPLS", "SSD_STATES_NAME", "SSMCache",
           "ssd", "ssd_step", "causal_conv1d", "decode_mixer_implementation",
           "resolve_scan_layers"]


def _decode_layout(config: MambaConfig) -> mamba_decode_pallas.Layout:
    return mamba_decode_pallas.Layout(config.num_heads // config.num_groups, config.head_dim,
                                      config.state_dim)


def decode_mixer_implementation(config: MambaConfig) -> str:
    """``config.decode_mixer``, checked: "pallas" or "xla".

    Raises:
      ValueError: "pallas" asked for a layout the kernel cannot take
        (:func:`models.mamba_decode_pallas.unsupported_reason`).
    """
    if config.decode_mixer == "xla":
        return "xla"
    why_not = mamba_decode_pallas.unsupported_reason(_decode_layout(config))
    if why_not:
        raise ValueError(f"MambaConfig: decode_mixer='pallas' but {why_not}; use "
                         f"decode_mixer='xla'.")
    return "pallas"


class SSMCache(NamedTuple):
    """One mixer's states for decoding, per device.

    Attributes:
      conv: the convolution's last inputs (this rank's [x, B, C] channels),
        in the compute dtype: with XLA's decode step the last k-1, [k-1, b,
        c], oldest first; with the decode kernels
        (:mod:`models.mamba_decode_pallas`, :mod:`models.mamba_decode_cuda`)
        a ring [k, b, c] holding position t's in row t mod k, which the
        kernel updates in place.
      ssm: [b, g, heads/g, p, n] float32, the SSM state of this rank's heads.
    """

    conv: jax.Array
    ssm: jax.Array


def _dt_bias_init(config: MambaConfig):
    """softplus^-1 of step sizes log-uniform in [dt_min, dt_max] (as Mamba-2)."""
    def init(key, shape, dtype=jnp.float32):
        lo, hi = math.log(config.dt_min), math.log(config.dt_max)
        dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, dtype, lo, hi)), 1e-4)
        return dt + jnp.log(-jnp.expm1(-dt))
    return init


class Mamba2Mixer(nnx.Module):
    """in_proj → conv1d → SSD → gated RMSNorm → out_proj, over this rank's groups."""

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        d, n, p, g = config.embed_dim, config.state_dim, config.head_dim, config.num_groups
        tensor = config.sharding.tensor
        self.heads_per_group = config.num_heads // g
        self.head_dim, self.state_dim = p, n
        self.chunk_size, self.ssd_impl = config.chunk_size, config.ssd_impl
        self.fuse_skip = config.fuse_skip
        self.ssd_keeps_chunk_states = config.ssd_keeps_chunk_states
        self.ssd_tiling = config.ssd_tiling
        self.conv_impl = config.conv_impl
        self.decode_layout = _decode_layout(config)
        self.decode_implementation = decode_mixer_implementation(config)
        # The convolution's state as a ring where a kernel updates it in place.
        self.conv_ring = self.decode_implementation == "pallas" or config.decode_blocks == "cuda"
        self.dtype = jnp.dtype(config.dtype)
        group_x = self.heads_per_group * p
        self.conv_layout = conv_pallas.Layout(self.heads_per_group, p, n)
        self.conv_channels = self.conv_layout.conv_channels  # [x, B, C] per group
        self.group_width = self.conv_layout.width           # [z, x, B, C, dt] per group
        self.in_proj = ColumnParallelLinear(d, g * self.group_width, **linear_options(config, rngs))
        bound = 1 / math.sqrt(config.conv_width)            # PyTorch's Conv1d default
        conv_init = nnx.initializers.uniform(2 * bound)
        self.conv_weight = nnx.Param(
            conv_init(rngs.params(), (config.conv_width, g * self.conv_channels)) - bound,
            out_sharding=(None, tensor))
        self.conv_bias = nnx.Param(conv_init(rngs.params(), (g * self.conv_channels,)) - bound,
                                   out_sharding=(tensor,))
        heads = config.num_heads
        self.dt_bias = nnx.Param(_dt_bias_init(config)(rngs.params(), (heads,)),
                                 out_sharding=(tensor,))
        self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (heads,),
                                                          minval=1.0, maxval=16.0)),
                               out_sharding=(tensor,))
        self.d_skip = nnx.Param(jnp.ones((heads,)), out_sharding=(tensor,))
        self.norm = RMSNorm(config.inner_dim, eps=config.norm_eps, group_size=group_x,
                            sharding=(tensor,), backward=config.norm_backward)
        self.out_proj = RowParallelLinear(config.inner_dim, d, **linear_options(config, rngs))

    def __call__(self, u: jax.Array) -> jax.Array:
        """u: [s/tp, b, d] (or [s, b, d] without SP) -> the same."""
        return self._mix(u)[0]

    def prefill(self, u: jax.Array, *, length: int, cache_len: int) -> tuple[jax.Array, SSMCache]:
        """The forward over a prompt, and the states decoding starts from.

        Args:
          u: as in ``__call__``; the prompt is the whole sequence s, of which
            positions ``length`` on are padding.
          length: real positions. Padding gets a zero step size, so it leaves
            the SSM state as the last real position left it.
          cache_len: unused (the states do not grow with the sequence).

        Returns:
          (output as ``__call__``'s, the cache after position ``length - 1``).
        """
        del cache_len
        out, (zxbcdt, state) = self._mix(u, length)
        conv_in = self._split(zxbcdt)[1]
        k = self.conv_weight.shape[0]
        # The convolution's inputs, zeros before the sequence's start.
        padded = jnp.pad(conv_in, ((k - 1, 0), (0, 0), (0, 0)))   # row i: position i-k+1
        if self.conv_ring:
            # Positions length-k .. length-1, rotated so position t is in row t mod k.
            ring = padded[length - 1:length + k - 1]
            return out, SSMCache(jnp.roll(ring, length % k, axis=0), state)
        return out, SSMCache(padded[length:length + k - 1], state)

    def decode(self, u: jax.Array, cache: SSMCache,
               pos: jax.Array) -> tuple[jax.Array, SSMCache]:
        """One token: the recurrent update of the states.

        Args:
          u: [1, b, d], the same on every tensor rank.
          cache: this layer's, after position ``pos - 1``.
          pos: int32 scalar, this token's position (the decode kernel's ring
            row; XLA's step does not need it).

        Returns:
          ([1, b, d] identical on every tensor rank, the cache after ``pos``).
        """
        zxbcdt = self.in_proj.decode(u)
        z, conv_in, dt = self._split(zxbcdt)
        if self.decode_implementation == "pallas":
            # The float32 parameters as they are: the kernel computes in float32.
            y, state, conv = mamba_decode_pallas.mixer_step(
                zxbcdt[0].reshape(*z.shape[1:3], self.group_width), cache.conv,
                self.conv_weight[...], self.conv_bias[...], self.dt_bias[...],
                self.a_log[...], self.d_skip[...], cache.ssm, pos, self.decode_layout)
            out = self._output(y[None], None, z, self.out_proj.decode, skip_added=True)
            return out, SSMCache(conv, state)
        window = jnp.concatenate([cache.conv, conv_in])      # [k, b, c]
        parts = self._conv_parts(jax.nn.silu(self._conv(window)[-1:]))
        x, bmat, cmat, dt, a = self._ssm_inputs(*parts, dt)
        y, state = ssd_step(x[0], dt[0], a, bmat[0], cmat[0], cache.ssm)
        return self._output(y[None], x, z, self.out_proj.decode), SSMCache(window[1:], state)

    def _mix(self, u: jax.Array, length: int | None = None):
        """(output, (in_proj's output [s, b, g/tp * group width], the final SSM state))."""
        zxbcdt = checkpoint_name(self.in_proj(u), "mamba_in_proj")
        s, b = zxbcdt.shape[:2]
        z, *parts, dt = conv_pallas.split_conv_silu(
            zxbcdt.reshape(s, b, -1, self.group_width), *self._conv_params(), self.conv_layout,
            impl=self.conv_impl)
        x, bmat, cmat, dt, a = self._ssm_inputs(*parts, dt)
        if length is not None:
            dt = jnp.where(jnp.arange(dt.shape[0])[:, None, None, None] < length, dt, 0.0)
        d_skip = self.d_skip[...].reshape(a.shape) if self.fuse_skip else None
        y, state = ssd(x, dt, a, bmat, cmat, self.chunk_size, return_final_state=True,
                       impl=self.ssd_impl, d_skip=d_skip,
                       keep_chunk_states=self.ssd_keeps_chunk_states, tiling=self.ssd_tiling)
        return self._output(y, x, z, self.out_proj, skip_added=self.fuse_skip), (zxbcdt, state)

    def _split(self, zxbcdt: jax.Array):
        """in_proj's [s, b, g/tp * per-group width] -> z [s, b, g/tp, heads/g * p],
        the convolution's input [s, b, c] and dt [s, b, g/tp, heads/g]."""
        s, b = zxbcdt.shape[:2]
        z, xbc, dt = self.conv_layout.split(zxbcdt.reshape(s, b, -1, self.group_width))
        return z, xbc.reshape(s, b, -1), dt

    def _conv_parts(self, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[..., g/tp * c] -> x [..., g/tp, heads/g * p], B and C [..., g/tp, n]:
        the convolution's channels (activations, weights or biases) of each group."""
        x, bmat, cmat = self.conv_layout.parts(xbc.reshape(*xbc.shape[:-1], -1,
                                                           self.conv_channels))
        return x, bmat, cmat

    def _conv_params(self) -> tuple[jax.Array, jax.Array]:
        """The convolution's weight [k, c] and bias [c] in the compute dtype."""
        return (self.conv_weight[...].astype(self.dtype),
                self.conv_bias[...].astype(self.dtype))

    def _conv(self, conv_in: jax.Array) -> jax.Array:
        return causal_conv1d(conv_in, *self._conv_params())

    def _ssm_inputs(self, x: jax.Array, bmat: jax.Array, cmat: jax.Array, dt: jax.Array):
        """The convolution's activated parts (see :meth:`_conv_parts`) and
        in_proj's dt -> the SSD's x, B, C, step sizes and decay rates (see
        :func:`ssd`)."""
        hpg, p = self.heads_per_group, self.head_dim
        s, b, groups = dt.shape[:3]
        x = x.reshape(s, b, groups, hpg, p)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].reshape(groups, hpg))
        a = -jnp.exp(self.a_log[...].reshape(groups, hpg))
        return x, bmat, cmat, dt, a

    def _output(self, y: jax.Array, x: jax.Array | None, z: jax.Array, out_proj, *,
                skip_added: bool = False) -> jax.Array:
        """The skip (unless ``skip_added``: the SSD added it; x is then
        unused), the gated norm and ``out_proj`` (its sequence-parallel form
        or its ``decode``) of the SSD's y [s, b, g, heads/g, p]."""
        s, b, groups, hpg = y.shape[:4]
        if not skip_added:
            y = y + self.d_skip[...].reshape(groups, hpg, 1) * x.astype(jnp.float32)
        y = checkpoint_name(y.reshape(s, b, -1).astype(self.dtype), "mamba_ssd")
        return out_proj(self.norm(y, gate=z.reshape(s, b, -1)))


class Mamba2Block(nnx.Module):
    """Pre-norm residual block around the mixer."""

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        # XLA's ops: through the norm kernels the 1.4B step was no faster.
        self.norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.mixer = Mamba2Mixer(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.mixer(self.norm(x))

    def prefill(self, x: jax.Array, *, length: int, cache_len: int) -> tuple[jax.Array, SSMCache]:
        """``__call__`` over a prompt, and this layer's cache (see :meth:`Mamba2Mixer.prefill`)."""
        h, cache = self.mixer.prefill(self.norm(x), length=length, cache_len=cache_len)
        return x + h, cache

    def decode(self, x: jax.Array, cache: SSMCache, pos: jax.Array) -> tuple[jax.Array, SSMCache]:
        """One token, x: [1, b, d] (see :meth:`Mamba2Mixer.decode`)."""
        h, cache = self.mixer.decode(self.norm(x), cache, pos)
        return x + h, cache


def resolve_scan_layers(config: MambaConfig) -> MambaConfig:
    """``config`` with ``scan_layers`` None decided: unrolled on GPUs, scanned elsewhere.

    On one H200 the 1.4B training step (bf16, sequence 8192, Pallas SSD)
    took 281.6 ms unrolled against 324.8 ms scanned, and 31.1 GB against
    42.9 at its peak: the scan stacks every layer's parameters each step and
    keeps the saved activations in [layers, ...] buffers it fills and
    slices. Unrolled, the step compiled in 65 s against 29. Elsewhere (CPU)
    compilation is what a run waits on.
    """
    if config.scan_layers is not None:
        return config
    return dataclasses.replace(config, scan_layers=jax.default_backend() != "gpu")


class Mamba2(CausalLM):
    """The Mamba-2 LM: ``Mamba2(config, rngs=...)(tokens [b, s]) -> logits [b, s, v]``.

    Create and call it under ``jax.set_mesh(mesh)`` with a (data, tensor)
    mesh; see :class:`models.layers.CausalLM`.
    """

    # In the backward, each block recomputes its elementwise work (the
    # activations, the gated norm, the SSD's inputs) from these: in_proj's
    # output, the convolution's (before its SiLU) and the SSD's with its skip
    # (the gated norm's input). On one H200 (1.4B, sequence 8192) keeping the
    # convolution's output cost 4.7 GB and saved 5.9 ms of a 276.4 ms step;
    # keeping every residual (config.residuals="all") took 254.0 ms against
    # that 270.5, at a peak of 64.5 GB against 35.8.
    saved_in_backward = ("mamba_in_proj", conv_pallas.CONV_NAME, "mamba_ssd")

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        config = resolve_scan_layers(config)
        super().__init__(config, lambda rngs: Mamba2Block(config, rngs=rngs), rngs=rngs)
        if config.ssd_keeps_chunk_states:
            self.saved_in_backward = (*type(self).saved_in_backward, SSD_STATES_NAME)

    def _recompute_policy(self):
        if self.config.residuals == "all":
            return False
        return super()._recompute_policy()

    def decode_weights(self, *, batch: int, tensor_size: int):
        """With ``decode_blocks="cuda"``, the blocks' weights in the decode
        kernel's layout (:func:`models.mamba_decode_cuda.prepare_weights`); else None.

        Raises:
          ValueError: ``decode_blocks="cuda"`` where the kernel cannot run, naming why.
        """
        if self.config.decode_blocks == "layers":
            return None
        why_not = mamba_decode_cuda.unsupported_reason(self.config, tensor_size=tensor_size,
                                                       batch=batch)
        if why_not:
            raise ValueError(f"MambaConfig(decode_blocks='cuda'): the decode kernel cannot run "
                             f"this step: {why_not}. Use decode_blocks='layers'.")
        return mamba_decode_cuda.prepare_weights(self.blocks, self.config)

    def decode_weights_specs(self):
        """:meth:`decode_weights`' ``PartitionSpec`` s (global view): whole on every device."""
        return mamba_decode_cuda.MambaDecodeWeights(*(P(),) * 9)

    def _decode_layers_with(self, weights, x, caches, pos):
        y, caches = mamba_decode_cuda.decode_blocks(x[0], pos, weights, caches, self.config)
        return y[None], caches

    def layer_cache_spec(self) -> SSMCache:
        """The ``PartitionSpec`` of each of a layer's cache arrays (global view)."""
        sharding = self.config.sharding
        return SSMCache(P(None, sharding.data, sharding.tensor),
                        P(sharding.data, sharding.tensor, None, None, None))
