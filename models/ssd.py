"""Mamba-2's state-space dual (SSD) scan over a sequence (:func:`ssd`), and
its one-token recurrence for decoding (:func:`ssd_step`).

The scan runs chunk by chunk: within a chunk, the quadratic (attention-like)
form; between chunks, the states, carried by their decays. The intra-chunk
products are XLA's einsums or the fused Pallas GPU kernels of
:mod:`models.ssd_pallas`; the backward is a custom VJP that keeps what
``keep_chunk_states`` asks for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import ssd_pallas
from .mamba_config import SSD_IMPLS, SSDTiling

__all__ = ["SSD_STATES_NAME", "ssd", "ssd_step"]


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
