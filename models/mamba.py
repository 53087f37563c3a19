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

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

from .config import MambaConfig
from .layers import CausalLM, RMSNorm, linear_options

__all__ = ["Mamba2", "Mamba2Block", "Mamba2Mixer", "ssd", "causal_conv1d"]


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """Depthwise causal convolution along the sequence.

    Args:
      x: [s, b, c], the whole sequence.
      weight: [k, c]; tap k-1 multiplies the current position.
      bias: [c].

    Returns:
      [s, b, c]: ``y[t] = bias + sum_i weight[i] * x[t - (k-1) + i]``.
    """
    k, s = weight.shape[0], x.shape[0]
    padded = jnp.pad(x, ((k - 1, 0), (0, 0), (0, 0)))
    # k is small (4): k shifted multiply-adds that XLA fuses into one pass.
    return bias + sum(weight[i] * padded[i:i + s] for i in range(k))


def _segsum(a: jax.Array) -> jax.Array:
    """Log-decays between positions: ``out[..., t, u] = sum(a[..., u+1 : t+1])``.

    Computed as a masked cumulative sum rather than a difference of cumulative
    sums, which loses precision over long chunks. Entries above the diagonal
    (u > t) are -inf, so that ``exp`` makes them 0.

    Args:
      a: [..., l].

    Returns:
      [..., l, l].
    """
    size = a.shape[-1]
    lower = jnp.tril(jnp.ones((size, size), bool))
    terms = jnp.where(jnp.tril(lower, -1), a[..., :, None], 0.0)  # [..., r, u]: a[r] if r > u
    return jnp.where(lower, jnp.cumsum(terms, axis=-2), -jnp.inf)


def ssd(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
        chunk_size: int) -> jax.Array:
    """The SSD selective scan, chunked (Mamba-2's "minimal SSD" algorithm).

    Computes the recurrence ``h_t = exp(dt_t·a) h_{t-1} + dt_t x_t ⊗ b_t``,
    ``y_t = h_t · c_t`` (zero initial state) in four steps: the quadratic
    attention-like form inside each chunk, the state each chunk leaves, a
    recurrence across chunks, and the entering states' contribution. In
    float32.

    Args:
      x: [s, batch, g, heads, p], the heads of each B/C group.
      dt: [s, batch, g, heads], positive step sizes.
      a: [g, heads], negative decay rates.
      b: [s, batch, g, n].
      c: [s, batch, g, n].
      chunk_size: l; must divide s.

    Returns:
      y: [s, batch, g, heads, p], float32.
    """
    s = x.shape[0]
    if s % chunk_size:
        raise ValueError(f"ssd: sequence length {s} is not a multiple of chunk_size={chunk_size}")
    chunks = s // chunk_size
    x, dt, b, c = (t.astype(jnp.float32).reshape(chunks, chunk_size, *t.shape[1:])
                   for t in (x, dt, b, c))
    log_decay = dt * a                                      # [C, l, batch, g, heads]
    cum = jnp.cumsum(log_decay, axis=1)
    x = x * dt[..., None]
    # 1. Within chunks: y_t = sum_{u<=t} (c_t·b_u) exp(sum_{u<r<=t} log_decay_r) x_u.
    decay = jnp.exp(_segsum(jnp.moveaxis(log_decay, 1, -1)))  # [C, batch, g, heads, t, u]
    cb = jnp.einsum("ctbgn,cubgn->cbgtu", c, b)
    y = jnp.einsum("cbgtu,cbghtu,cubghp->ctbghp", cb, decay, x)
    # 2. The state each chunk leaves, from its own inputs.
    to_end = jnp.exp(cum[:, -1:] - cum)
    states = jnp.einsum("cubgn,cubgh,cubghp->cbghpn", b, to_end, x)
    # 3. Across chunks: the state entering each chunk (zero for the first).
    chunk_decay = jnp.exp(_segsum(jnp.moveaxis(jnp.pad(cum[:, -1], ((1, 0),) + ((0, 0),) * 3),
                                               0, -1)))     # [batch, g, heads, C+1, C+1]
    states = jnp.concatenate([jnp.zeros_like(states[:1]), states])
    entering = jnp.einsum("bghzc,cbghpn->zbghpn", chunk_decay, states)[:-1]
    # 4. The entering state's contribution, decayed to each position.
    y = y + jnp.einsum("ctbgn,cbghpn,ctbgh->ctbghp", c, entering, jnp.exp(cum))
    return y.reshape(s, *y.shape[2:])


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
        self.chunk_size = config.chunk_size
        self.dtype = jnp.dtype(config.dtype)
        group_x = self.heads_per_group * p
        self.conv_channels = group_x + 2 * n                # [x, B, C] per group
        self.group_width = group_x + self.conv_channels + self.heads_per_group  # z, xBC, dt
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
                            sharding=(tensor,))
        self.out_proj = RowParallelLinear(config.inner_dim, d, **linear_options(config, rngs))

    def __call__(self, u: jax.Array) -> jax.Array:
        """u: [s/tp, b, d] (or [s, b, d] without SP) -> the same."""
        hpg, p, n = self.heads_per_group, self.head_dim, self.state_dim
        zxbcdt = self.in_proj(u)                            # [s, b, g/tp * per-group width]
        s, b = zxbcdt.shape[:2]
        zxbcdt = zxbcdt.reshape(s, b, -1, self.group_width)
        groups = zxbcdt.shape[2]
        z, xbc, dt = jnp.split(zxbcdt, [hpg * p, hpg * p + self.conv_channels], axis=-1)
        xbc = causal_conv1d(xbc.reshape(s, b, -1), self.conv_weight[...].astype(self.dtype),
                            self.conv_bias[...].astype(self.dtype))
        x, bmat, cmat = jnp.split(jax.nn.silu(xbc).reshape(s, b, groups, -1),
                                  [hpg * p, hpg * p + n], axis=-1)
        x = x.reshape(s, b, groups, hpg, p)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].reshape(groups, hpg))
        a = -jnp.exp(self.a_log[...].reshape(groups, hpg))
        y = ssd(x, dt, a, bmat, cmat, self.chunk_size)
        y = y + self.d_skip[...].reshape(groups, hpg, 1) * x.astype(jnp.float32)
        y = self.norm(y.reshape(s, b, -1).astype(self.dtype), gate=z.reshape(s, b, -1))
        return self.out_proj(y)


class Mamba2Block(nnx.Module):
    """Pre-norm residual block around the mixer."""

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.mixer = Mamba2Mixer(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.mixer(self.norm(x))


class Mamba2(CausalLM):
    """The Mamba-2 LM: ``Mamba2(config, rngs=...)(tokens [b, s]) -> logits [b, s, v]``.

    Create and call it under ``jax.set_mesh(mesh)`` with a (data, tensor)
    mesh; see :class:`models.layers.CausalLM`.
    """

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        super().__init__(config, lambda rngs: Mamba2Block(config, rngs=rngs), rngs=rngs)
