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
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

from . import conv_pallas, mamba_decode_pallas, ssd_pallas
from .config import SSD_IMPLS, MambaConfig, SSDTiling
from .conv_pallas import causal_conv1d
from .layers import CausalLM, RMSNorm, linear_options

__all__ = ["Mamba2", "Mamba2Block", "Mamba2Mixer", "SSD_IMPLS", "SSD_STATES_NAME", "SSMCache",
           "ssd", "ssd_step", "causal_conv1d", "decode_mixer_implementation",
           "resolve_scan_layers"]


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
        chunk_size: int, *, return_final_state: bool = False, impl: str = "auto",
        d_skip: jax.Array | None = None, keep_chunk_states: bool = False,
        tiling: SSDTiling | None = None):
    """The SSD selective scan, chunked (Mamba-2's "minimal SSD" algorithm).

    Computes the recurrence ``h_t = exp(dt_t·a) h_{t-1} + dt_t x_t ⊗ b_t``,
    ``y_t = h_t · c_t`` (zero initial state) in four steps: the quadratic
    attention-like form inside each chunk, the state each chunk leaves, a
    recurrence across chunks, and the entering states' contribution.
    Decays, states and sums are float32.

    Differentiating it keeps only its inputs for the backward, which
    recomputes the rest: autodiff of the chunked form would keep [chunks,
    heads, l, l] float32 blocks per layer (gigabytes at long sequences).

    Args:
      x: [s, batch, g, heads, p], the heads of each B/C group.
      dt: [s, batch, g, heads], positive step sizes.
      a: [g, heads], negative decay rates.
      b: [s, batch, g, n].
      c: [s, batch, g, n].
      chunk_size: l. A sequence that is not a multiple of it is padded with
        zero steps, which leave the state as it was.
      return_final_state: also return the state after the last position.
      impl: how the products inside and out of each chunk run: "xla"
        (einsums), "pallas" (fused GPU kernels, :mod:`models.ssd_pallas`;
        CUDA only, and chunk_size, head_dim, state_dim and heads per group
        powers of two with the first three at least 16), or "auto":
        "pallas" when it can run the shape, compiled for a CUDA GPU, else
        "xla".
      d_skip: [g, heads] float32, Mamba-2's D, or None. With it, y is
        ``ssd + d_skip · x`` in x's dtype, added inside the output kernel on
        the Pallas path.
      keep_chunk_states: the backward also keeps each chunk's state and the
        state entering each chunk ([batch, g, heads, chunks, p, n], float32
        and x's dtype) and does not compute them again. Inside a
        ``jax.checkpoint`` the policy must save them too: they are named
        :data:`SSD_STATES_NAME`. Off by default: the 1.4B step took 4.7 GB
        more and was no faster than its own spread.
      tiling: the Pallas kernels' tiling (None: their defaults); unused by
        the XLA path.

    Returns:
      y: [s, batch, g, heads, p], float32 (x's dtype with ``d_skip``); with
      ``return_final_state``,
      ``(y, h)`` with h: [batch, g, heads, p, n], float32, the state
      :func:`ssd_step` continues from.
    """
    chunked = _chunked_ssd_for(impl, chunk_size, x.shape[-1], x.shape[-2], b.shape[-1],
                               tiling=tiling)
    s = x.shape[0]
    pad = -s % chunk_size
    if pad:
        x, dt, b, c = (jnp.pad(t, ((0, pad),) + ((0, 0),) * (t.ndim - 1)) for t in (x, dt, b, c))
    y, final = _ssd(x, dt, a, b, c, d_skip, chunk_size, chunked, keep_chunk_states)
    y = y[:s]
    return (y, final) if return_final_state else y


class _ChunkProducts(NamedTuple):
    """Steps 1, 2 and 4 of :func:`ssd`, on chunked arrays [chunks, l, ...]
    of its argument shapes; float32 results.

    Attributes:
      states: (x weighted, b) -> [batch, g, heads, C, p, n], each chunk's
        ``sum_u x[u]^T b[u]``.
      output: (x, dt, log_decay, cum, b, c, entering states [batch, g,
        heads, C, p, n] in x's dtype, skip [C, l, batch, g, heads] float32 or
        None) -> y [C, l, batch, g, heads, p], from inside each chunk and
        from the state entering it (plus skip · x, then in x's dtype). dt,
        log_decay and cum float32.
    """

    states: Callable
    output: Callable


def _chunked_ssd_for(impl: str, chunk_size: int, head_dim: int, heads_per_group: int,
                     state_dim: int, tiling: SSDTiling | None = None):
    """The function (x, dt, a, b, c, d, chunk_size) -> (y, final state) running
    :func:`ssd` on a sequence of whole chunks for ``impl``, the Pallas
    kernels at ``tiling`` (None: their defaults)."""
    pallas, auto = _chunked_ssd_pallas, _chunked_ssd_auto
    if tiling is not None and tiling != SSDTiling():
        pallas = functools.partial(_chunked_ssd_pallas, tiling=tiling)
        auto = functools.partial(_chunked_ssd_auto, pallas=pallas)
    if impl == "xla":
        return _chunked_ssd_xla
    if impl not in SSD_IMPLS:
        raise ValueError(f"ssd: impl={impl!r} is not one of {SSD_IMPLS}")
    reason = ssd_pallas.unsupported_reason(chunk_size, head_dim, heads_per_group, state_dim)
    if impl == "auto":
        return _chunked_ssd_xla if reason else auto
    if reason:
        raise ValueError(f"ssd: impl='pallas' cannot run this shape: {reason}. "
                         f"Use impl='auto' or 'xla'.")
    if jax.default_backend() != "gpu":
        raise ValueError(f"ssd: impl='pallas' runs on CUDA GPUs only (Pallas Triton kernels), "
                         f"and the default backend is {jax.default_backend()!r}. Use "
                         f"impl='auto' (Pallas on GPUs, XLA elsewhere) or 'xla'.")
    return pallas


def _states_xla(x, b):
    return jnp.einsum("cubghp,cubgn->bghcpn", x, b, preferred_element_type=jnp.float32)


def _output_xla(x, dt, log_decay, cum, b, c, entering, skip):
    """y_t = sum_{u<=t} (c_t·b_u) exp(sum_{u<r<=t} log_decay_r) dt_u x_u
    + exp(cum_t) c_t·S^T (+ skip_t x_t), as einsums."""
    from_entering = jnp.einsum("ctbgn,bghcpn->ctbghp", c, entering,
                               preferred_element_type=jnp.float32)
    dtype = x.dtype
    x, b, c = (t.astype(jnp.float32) for t in (x, b, c))
    decay = jnp.exp(_segsum(jnp.moveaxis(log_decay, 1, -1)))  # [C, batch, g, heads, t, u]
    cb = jnp.einsum("ctbgn,cubgn->cbgtu", c, b)
    inside = jnp.einsum("cbgtu,cbghtu,cubghp->ctbghp", cb, decay, x * dt[..., None])
    y = inside + from_entering * jnp.exp(cum)[..., None]
    return y if skip is None else (y + skip[..., None] * x).astype(dtype)


_XLA_PRODUCTS = _ChunkProducts(_states_xla, _output_xla)


def _pallas_products(interpret: bool = False, tiling: SSDTiling | None = None
                     ) -> _ChunkProducts:
    """:mod:`models.ssd_pallas`'s kernels behind :class:`_ChunkProducts`
    (``interpret``: in Pallas's interpreter, for tests on CPU), at ``tiling``."""
    tiling = tiling or SSDTiling()

    def states(x, b):
        def merged(t):  # [C, l, ...] -> [C·l, ...]: the kernels index chunks themselves
            return t.reshape(-1, *t.shape[2:])
        return ssd_pallas.chunk_states(merged(x), merged(b), chunk_size=x.shape[1],
                                       interpret=interpret,
                                       **tiling.kernel_options(columns=False))

    def output(x, dt, log_decay, cum, b, c, entering, skip):
        del log_decay
        if skip is not None:
            skip = skip.reshape(-1, *skip.shape[2:])
        y = ssd_pallas.chunk_output(*ssd_pallas.chunk_operands(x, dt, cum, b, c), entering,
                                    chunk_size=x.shape[1], skip=skip, interpret=interpret,
                                    **tiling.kernel_options())
        return y.reshape(x.shape[:2] + y.shape[1:])

    return _ChunkProducts(states, output)


def _chunked_ssd_xla(x, dt, a, b, c, d, chunk_size, saved=None):
    return _chunked_ssd(x, dt, a, b, c, d, chunk_size, _XLA_PRODUCTS, saved)


def _chunked_ssd_pallas(x, dt, a, b, c, d, chunk_size, saved=None, *, interpret=False,
                        tiling=None):
    return _chunked_ssd(x, dt, a, b, c, d, chunk_size, _pallas_products(interpret, tiling),
                        saved)


def _chunked_ssd_auto(x, dt, a, b, c, d, chunk_size, saved=None, *, pallas=_chunked_ssd_pallas):
    def branch(chunked):
        return lambda *t: chunked(*t[:6], chunk_size, t[6])
    return jax.lax.platform_dependent(x, dt, a, b, c, d, saved, cuda=branch(pallas),
                                      default=branch(_chunked_ssd_xla))


# The checkpoint name of the chunk states ssd(keep_chunk_states=True) keeps.
SSD_STATES_NAME = "mamba_ssd_states"


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _ssd(x, dt, a, b, c, d, chunk_size, chunked, keep_chunk_states=False):
    return chunked(x, dt, a, b, c, d, chunk_size)[0]


def _ssd_fwd(x, dt, a, b, c, d, chunk_size, chunked, keep_chunk_states=False):
    out, saved = chunked(x, dt, a, b, c, d, chunk_size)
    if not keep_chunk_states:
        return out, ((x, dt, a, b, c, d), None)
    # Named, so that a block's jax.checkpoint policy can keep them too.
    saved = jax.tree.map(lambda t: checkpoint_name(t, SSD_STATES_NAME), saved)
    return out, ((x, dt, a, b, c, d), saved)


def _ssd_bwd(chunk_size, chunked, keep_chunk_states, residuals, cotangents):
    del keep_chunk_states  # saved is None without it
    inputs, saved = residuals
    _, vjp = jax.vjp(lambda *t: chunked(*t, chunk_size, saved)[0], *inputs)
    return vjp(cotangents)


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reused(fn, value, *args):
    """``fn(*args)``, given as ``value``, its result in the forward pass over
    the same args: the backward pass differentiates fn without running its
    forward again (the unused result of ``jax.vjp(fn)`` is dead code, which
    XLA removes)."""
    del args
    return value


def _reused_fwd(fn, value, *args):
    return value, args


def _reused_bwd(fn, args, cotangent):
    _, vjp = jax.vjp(fn, *args)
    return (None, *vjp(cotangent))


_reused.defvjp(_reused_fwd, _reused_bwd)


def _entering(chunk_decay, states, dtype):
    """[batch, g, heads, C, C] decays (from the chunk on the right to the one
    on the left), [batch, g, heads, C, p, n] float32 -> the state entering
    each chunk, in ``dtype`` (the output's products multiply in it)."""
    return jnp.einsum("bghzc,bghcpn->bghzpn", chunk_decay, states).astype(dtype)


def _chunked_ssd(x, dt, a, b, c, d, chunk_size, products: _ChunkProducts, saved=None):
    """:func:`ssd` on a sequence that is a multiple of the chunk.

    Returns ((y, final state), (states, entering)): each chunk's own state
    (float32) and the state entering it (in x's dtype). ``saved``: those of
    the forward pass over the same inputs, given back by the backward pass,
    which then differentiates the chunk states and the passing across chunks
    without computing them again.
    """
    chunks = x.shape[0] // chunk_size
    x, dt, b, c = (t.reshape(chunks, chunk_size, *t.shape[1:]) for t in (x, dt, b, c))
    dt = dt.astype(jnp.float32)
    log_decay = dt * a                                      # [C, l, batch, g, heads]
    cum = jnp.cumsum(log_decay, axis=1)
    # Steps 2 and 4 multiply in the inputs' dtype (bf16 in training: the
    # tensor cores' rate, half the bytes to read), accumulating in float32.
    dtype = x.dtype
    # 2. The state each chunk leaves, from its own inputs.
    to_end = jnp.exp(cum[:, -1:] - cum)
    weighted = ((x * (dt * to_end)[..., None]).astype(dtype), b.astype(dtype))
    states = (products.states(*weighted) if saved is None
              else _reused(products.states, saved[0], *weighted))
    # 3. Across chunks: the state entering each chunk (zero for the first),
    # then the final state.
    chunk_decay = jnp.exp(_segsum(jnp.moveaxis(jnp.pad(cum[:, -1], ((1, 0),) + ((0, 0),) * 3),
                                               0, -1)))     # [batch, g, heads, C+1, C+1]
    entering_of = functools.partial(_entering, dtype=dtype)
    to_chunks = (chunk_decay[..., :-1, 1:], states)
    entering = (entering_of(*to_chunks) if saved is None
                else _reused(entering_of, saved[1], *to_chunks))
    final = jnp.einsum("bghc,bghcpn->bghpn", chunk_decay[..., -1, 1:], states)
    # 1 and 4. Within chunks, plus the entering state decayed to each position.
    skip = None if d is None else jnp.broadcast_to(d.astype(jnp.float32), dt.shape)
    y = products.output(x, dt, log_decay, cum, b, c.astype(dtype), entering, skip)
    return (y.reshape(-1, *y.shape[2:]), final), (states, entering)


def ssd_step(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
             h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One position of the SSD recurrence (decoding): O(1) in the sequence length.

    ``h' = exp(dt·a) h + dt x ⊗ b``, ``y = h' · c``, in float32.

    Args:
      x: [batch, g, heads, p].
      dt: [batch, g, heads], positive.
      a: [g, heads], negative.
      b: [batch, g, n].
      c: [batch, g, n].
      h: [batch, g, heads, p, n] float32, the state before this position.

    Returns:
      (y [batch, g, heads, p] float32, h').
    """
    x, b, c = (t.astype(jnp.float32) for t in (x, b, c))
    h = (jnp.exp(dt * a)[..., None, None] * h
         + (dt[..., None] * x)[..., None] * b[:, :, None, None, :])
    return jnp.einsum("bghpn,bgn->bghp", h, c), h


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
        c], oldest first; with the decode kernel
        (:mod:`models.mamba_decode_pallas`) a ring [k, b, c] holding
        position t's in row t mod k, which the kernel updates in place.
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
        if self.decode_implementation == "pallas":
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

    def layer_cache_spec(self) -> SSMCache:
        """The ``PartitionSpec`` of each of a layer's cache arrays (global view)."""
        sharding = self.config.sharding
        return SSMCache(P(None, sharding.data, sharding.tensor),
                        P(sharding.data, sharding.tensor, None, None, None))
