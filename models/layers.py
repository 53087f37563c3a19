"""What both language models share: RMSNorm, layer creation and the causal-LM skeleton."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_flashoverlap.nn import same_variance, shard_map_apply

from .config import NORM_BACKWARDS, RopeScaling

__all__ = ["RMSNorm", "CausalLM", "linear_options", "make_layers", "rms_norm",
           "same_variance"]


def linear_options(config, rngs: nnx.Rngs) -> dict:
    """Keyword arguments of :mod:`jax_flashoverlap.nn`'s parallel layers for ``config``."""
    sharding = config.sharding
    return dict(axis_name=sharding.tensor, sequence_parallel=sharding.sequence_parallel,
                impl=config.impl, decode_impl=config.decode_matmul,
                dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
                rngs=rngs)


def make_layers(make: Callable[..., nnx.Module], count: int, *,
                rngs: nnx.Rngs) -> list[nnx.Module]:
    """``[make(rngs=rngs) for _ in range(count)]``, with ``make`` traced once.

    A Python loop would put every layer's initializers into the program
    (inside ``jit``, one set of random-number kernels per layer: creating the
    48-layer Mamba-2 compiled for minutes on GPU). Here a ``lax.scan`` runs
    one layer's initialization ``count`` times and the stacked results are
    split into layers. ``rngs`` is the scan's carry, so layer i draws the same
    keys as the i-th call of the loop: the parameters are bit-for-bit those of
    the loop, and ``rngs`` ends where the loop would leave it.

    Args:
      make: ``make(rngs=...) -> module``; every call must build the same
        structure (it is traced once).
      count: number of layers.
      rngs: supplies the keys; advanced past all the layers.

    Returns:
      ``count`` modules with unstacked parameters, each placed as its
      variables' ``out_sharding`` metadata says (sharding propagates from the
      constraint each variable applies inside the scan).
    """
    rngs_def, rngs_state = nnx.split(rngs)
    layer_def = None

    def one(rngs_state, _):
        nonlocal layer_def
        rngs = nnx.merge(rngs_def, rngs_state)
        layer_def, layer_state = nnx.split(make(rngs=rngs))
        return nnx.state(rngs), layer_state

    rngs_state, stacked = jax.lax.scan(one, rngs_state, length=count)
    nnx.update(rngs, rngs_state)

    def layer(i: int) -> nnx.Module:
        return nnx.merge(layer_def, jax.tree.map(lambda x: x[i], stacked))

    return [layer(i) for i in range(count)]


class RMSNorm(nnx.Module):
    """``weight · x / rms(x)``, over the last dim or over groups of it.

    Args:
      dim: width of the last dim (global).
      eps: added to the mean square.
      group_size: normalise each run of ``group_size`` channels on its own
        (Mamba-2's grouped norm, which keeps the norm local to a
        tensor-parallel rank); default the whole dim.
      sharding: ``out_sharding`` of the weight, e.g. ``("tensor",)`` when the
        channels are split over the tensor axis.
      backward: one of :data:`~jax_flashoverlap.models.NORM_BACKWARDS` (see
        :func:`rms_norm`).
    """

    def __init__(self, dim: int, *, eps: float, group_size: int | None = None,
                 sharding: tuple = (None,), backward: str = "autodiff"):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=sharding)
        self.eps = eps
        self.group_size = group_size
        self.backward = backward

    def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """x: [..., dim]; gate: like x, applied as ``x · silu(gate)`` before the norm.
        Returns [..., dim] in x's dtype (computed in float32)."""
        return rms_norm(x, self.weight[...], eps=self.eps, group_size=self.group_size,
                        gate=gate, backward=self.backward)


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, group_size: int | None = None,
             gate: jax.Array | None = None, backward: str = "autodiff") -> jax.Array:
    """``weight · y / rms(y)`` with ``y = x · silu(gate)`` (or x), per group.

    Args:
      x: [..., dim], any float dtype.
      weight: [dim], float32.
      eps: added to the mean square.
      group_size: channels normalised together (dim must divide by it);
        default the whole dim.
      gate: like x, or None.
      backward: one of :data:`~jax_flashoverlap.models.NORM_BACKWARDS`:
        "autodiff" keeps the float32 intermediates for the backward;
        "recompute" keeps only x, gate and weight and recomputes the rest in
        the backward (less memory, fewer passes when a checkpoint policy would
        otherwise recompute the forward too); "pallas" keeps the same and runs
        forward and backward as fused GPU kernels (:mod:`models.norm_pallas`);
        "auto" runs those kernels on CUDA GPUs and XLA's ops elsewhere,
        keeping only the inputs either way; "autodiff" for shapes the
        kernels do not take and for fewer rows than
        ``norm_pallas.AUTO_MIN_ROWS`` (a decode step's: there XLA fuses the
        norm with its neighbours, and there is no backward).

    Returns:
      [..., dim] in x's dtype, computed in float32.
    """
    group_size = group_size or x.shape[-1]
    if backward in ("pallas", "auto"):
        # Imported here, not above: norm_pallas imports ssd_pallas, which
        # imports this module.
        from . import norm_pallas
        if backward == "pallas":
            return norm_pallas.gated_rms_norm(x, gate, weight, eps=eps, group_size=group_size)
        if (x.size // x.shape[-1] >= norm_pallas.AUTO_MIN_ROWS
                and norm_pallas.unsupported_reason(x.shape[-1], group_size) is None):
            return norm_pallas.gated_rms_norm_or(_rms_norm_output, x, gate, weight, eps=eps,
                                                 group_size=group_size)
        backward = "autodiff"
    if backward == "autodiff":
        return _rms_norm_output(x, gate, weight, eps, group_size)
    if backward != "recompute":
        raise ValueError(f"rms_norm: backward must be one of {NORM_BACKWARDS}, got {backward!r}")
    (x, weight, gate), _ = same_variance(x, weight, gate)
    return _rms_norm_recomputed(x, gate, weight, eps, group_size)


def _rms_norm_output(x, gate, weight, eps: float, group_size: int):
    return _rms_norm(x, gate, weight, eps, group_size)[0]


def _rms_norm(x, gate, weight, eps: float, group_size: int):
    """(The norm in x's dtype, and in float32 per group: the normalized values
    [..., dim / group_size, group_size] and their inverse rms [..., groups, 1])."""
    y = x.astype(jnp.float32)
    if gate is not None:
        y = y * jax.nn.silu(gate.astype(jnp.float32))
    groups = y.reshape(*y.shape[:-1], -1, group_size)
    inv_rms = jax.lax.rsqrt(jnp.mean(groups * groups, -1, keepdims=True) + eps)
    normalized = groups * inv_rms
    return (normalized.reshape(y.shape) * weight).astype(x.dtype), normalized, inv_rms


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rms_norm_recomputed(x, gate, weight, eps, group_size):
    return _rms_norm_output(x, gate, weight, eps, group_size)


def _rms_norm_recomputed_fwd(x, gate, weight, eps, group_size):
    return _rms_norm(x, gate, weight, eps, group_size)[0], (x, gate, weight)


def _rms_norm_recomputed_bwd(eps, group_size, inputs, dout):
    x, gate, weight = inputs
    _, normalized, inv_rms = _rms_norm(x, gate, weight, eps, group_size)
    dnormalized = (dout.astype(jnp.float32) * weight).reshape(normalized.shape)
    dweight = jnp.sum((dout.astype(jnp.float32).reshape(normalized.shape) * normalized)
                      .reshape(-1, weight.shape[0]), axis=0)
    # d/dy of y / rms(y), per group: (dn - n · mean(dn · n)) / rms.
    dy = inv_rms * (dnormalized - normalized * jnp.mean(dnormalized * normalized, -1,
                                                        keepdims=True))
    dy = dy.reshape(x.shape)
    if gate is None:
        return dy.astype(x.dtype), None, dweight.astype(weight.dtype)
    z = gate.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(z)
    dx = dy * z * sigmoid
    dgate = dy * x.astype(jnp.float32) * sigmoid * (1 + z * (1 - sigmoid))  # silu'(z)
    return dx.astype(x.dtype), dgate.astype(gate.dtype), dweight.astype(weight.dtype)


_rms_norm_recomputed.defvjp(_rms_norm_recomputed_fwd, _rms_norm_recomputed_bwd)


class CausalLM(nnx.Module):
    """Token embedding, a stack of residual blocks, RMSNorm and the LM head.

    Called on global arrays under ``jax.set_mesh(mesh)``: the forward runs
    per device in one ``jax.shard_map`` over the (data, tensor) mesh, on the
    [seq, batch, d] layout. The embedding and the head (small for byte-level
    vocabularies) are replicated and applied to this rank's sequence shard.

    Args:
      config: a model config (``vocab_size``, ``embed_dim``, ``num_layers``,
        ``norm_eps``, ``dtype``, ``remat``, ``scan_layers``, ``sharding`` and
        ``check``).
      block: ``block(rngs=...) -> module`` mapping [s/tp, b, d] to the same
        (per device), one per layer.
      rngs: supplies the ``params`` keys.
    """

    # Without config.remat, the values (named by
    # jax.ad_checkpoint.checkpoint_name) a block keeps for its backward,
    # recomputing the rest; None keeps all that autodiff keeps.
    saved_in_backward: tuple[str, ...] | None = None

    def __init__(self, config, block: Callable[..., nnx.Module], *, rngs: nnx.Rngs):
        d, v = config.embed_dim, config.vocab_size
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:  # the parameters are placed by these axes' names
            config.sharding.check_axes(dict(mesh.shape), model=type(self).__name__)
        self.config = config
        stored = jnp.dtype(config.param_dtype)
        self.embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (v, d), stored),
                                   out_sharding=(None, None))
        self.blocks = nnx.List(make_layers(block, config.num_layers, rngs=rngs))
        self.final_norm = RMSNorm(d, eps=config.norm_eps)
        # Tied: the logits read the embedding, transposed, and there is no head.
        if not getattr(config, "tie_embeddings", False):
            self.head = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d, v), stored),
                                  out_sharding=(None, None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: [b, s] int, global. Returns logits [b, s, v] in the compute dtype."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(f"{type(self).__name__}: call it under `with jax.set_mesh(mesh):` "
                             f"with a (data, tensor) mesh.")
        batch, seq_len = tokens.shape
        self.config.check(dict(mesh.shape), batch=batch, seq_len=seq_len)
        sharding = self.config.sharding
        logits = shard_map_apply(type(self).forward, self, tokens.T,
                                 in_specs=(sharding.tokens_sb,), out_specs=sharding.act_sbd)
        return logits.transpose(1, 0, 2)

    def forward(self, tokens: jax.Array) -> jax.Array:
        """Per device: tokens [s_local, b_local] -> logits [s_local, b_local, v].

        ``s_local`` is s/tp under sequence parallelism, else s.
        """
        x = self._apply_blocks(self._embed(tokens))
        return jnp.dot(self.final_norm(x), self._head(x.dtype))

    def prefill(self, tokens: jax.Array, *, length: int, cache_len: int):
        """Per device: the forward over a prompt, keeping what decoding needs.

        Args:
          tokens: [s_local, b_local] int, the prompt padded to s positions
            (split as in :meth:`forward`).
          length: the prompt's real positions (``length <= s``); the rest is
            padding that decoding overwrites or never reads.
          cache_len: positions each layer's cache holds (``>= s``).

        Returns:
          (the caches, a tuple of one per layer; float32 logits [b_local, v]
          of position ``length - 1``, the same on every tensor rank).
        """
        x, caches = self._run_blocks(
            self._embed(tokens),
            lambda block, x: block.prefill(x, length=length, cache_len=cache_len))
        return tuple(caches), self._logits(self._position(x, length - 1))

    def decode_weights(self, *, batch: int, tensor_size: int) -> Any:
        """What :meth:`decode_step` reads besides the module, prepared once
        per generation (jit it), or None: each layer decodes on its own.

        Args:
          batch: rows per device.
          tensor_size: the mesh's tensor axis size.
        """
        del batch, tensor_size
        return None

    def decode_step(self, token: jax.Array, caches: tuple, pos: jax.Array,
                    weights: Any = None):
        """Per device: one token through every layer, tensor-parallel without
        sequence parallelism (each layer ends in an all-reduce).

        Args:
          token: [b_local] int, the token at position ``pos``.
          caches: one per layer, as :meth:`prefill` returns them.
          pos: int32 scalar.
          weights: :meth:`decode_weights`' result.

        Returns:
          (float32 logits [b_local, v] of the next token, the same on every
          tensor rank; the caches with ``pos`` added).
        """
        x = self._embed(token[None])                        # [1, b, d]
        if weights is not None:
            x, updated = self._decode_layers_with(weights, x, caches, pos)
            return self._logits(x[0]), tuple(updated)
        updated = []
        # Unrolled even where training scans the layers: a scan would read
        # each layer's cache out of a stacked one and write it back, a copy
        # of the whole cache per token.
        for block, cache in zip(self.blocks, caches):
            x, cache = block.decode(x, cache, pos)
            updated.append(cache)
        return self._logits(x[0]), tuple(updated)

    def decode_weights_specs(self) -> Any:
        """:meth:`decode_weights`' ``PartitionSpec`` s (global view)."""
        raise NotImplementedError(f"{type(self).__name__} has no decode_weights")

    def _decode_layers_with(self, weights: Any, x: jax.Array, caches: tuple,
                            pos: jax.Array) -> tuple[jax.Array, tuple]:
        """Every layer's decode from :meth:`decode_weights`' result: x [1, b, d]."""
        raise NotImplementedError(f"{type(self).__name__} has no decode_weights")

    def cache_specs(self) -> tuple:
        """The caches' ``PartitionSpec``s (global view), one entry per layer."""
        return (self.layer_cache_spec(),) * len(self.blocks)

    def layer_cache_spec(self):
        raise NotImplementedError(f"{type(self).__name__} does not decode")

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [...] int -> [..., d] in the compute dtype."""
        return jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.dtype(self.config.dtype))

    def _logits(self, x: jax.Array) -> jax.Array:
        """[..., d] -> float32 [..., v]."""
        return jnp.dot(self.final_norm(x), self._head(x.dtype)).astype(jnp.float32)

    def _head(self, dtype) -> jax.Array:
        """The LM head [d, v] in ``dtype``: its own weight, or the tied embedding's."""
        if getattr(self.config, "tie_embeddings", False):
            return self.embedding[...].T.astype(dtype)
        return self.head[...].astype(dtype)

    def _position(self, x: jax.Array, index: int) -> jax.Array:
        """Per device: row ``index`` of the sequence, [b, d], on every tensor rank.

        Under sequence parallelism x is this rank's [s/tp, b, d] and one rank
        holds the row: it is summed over the tensor axis with zeros from the
        others.
        """
        tensor = self.config.sharding.tensor
        if not self.config.sharding.sequence_parallel:
            return x[index]
        owner, local = divmod(index, x.shape[0])
        row = jnp.where(jax.lax.axis_index(tensor) == owner, x[local], jnp.zeros_like(x[local]))
        return jax.lax.psum(row, tensor)

    def _recompute_policy(self):
        """What a block recomputes in the backward: False, nothing (autodiff
        keeps every residual); None, everything (``config.remat``); else a
        ``jax.checkpoint`` policy keeping the values named in
        ``saved_in_backward``."""
        if self.config.remat:
            return None
        if self.saved_in_backward:
            return jax.checkpoint_policies.save_only_these_names(*self.saved_in_backward)
        return False

    def _apply_blocks(self, x: jax.Array) -> jax.Array:
        return self._run_blocks(x, lambda block, x: (block(x), None))[0]

    def _run_blocks(self, x: jax.Array, call: Callable) -> tuple[jax.Array, list]:
        """Runs ``call(block, x) -> (x, out)`` over the blocks in order.

        With ``config.scan_layers`` as one ``lax.scan``: it traces and compiles
        one block instead of ``num_layers`` unrolled copies (the 1B Mamba-2's
        training step: 73 s -> 43 s of compilation on CPU); stacking the
        layers' parameters costs one copy of them per call.

        Returns:
          (x after the last block, [each block's out]).
        """
        recompute = self._recompute_policy()
        if not self.config.scan_layers:
            apply = call if recompute is False else nnx.remat(call, policy=recompute)
            outs = []
            for block in self.blocks:
                x, out = apply(block, x)
                outs.append(out)
            return x, outs
        graphdef = nnx.graphdef(self.blocks[0])
        stacked = jax.tree.map(lambda *layers: jnp.stack(layers),
                               *(nnx.state(block) for block in self.blocks))

        def body(x, layer_state):
            return call(nnx.merge(graphdef, layer_state), x)

        if recompute is not False:
            body = jax.checkpoint(body, policy=recompute)
        x, outs = jax.lax.scan(body, x, stacked)
        return x, [jax.tree.map(lambda a, i=i: a[i], outs) for i in range(len(self.blocks))]


def rope(x: jax.Array, theta: float, positions: jax.Array | None = None,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embeddings ("rotate half" layout).

    Args:
      x: [s, b, heads, h].
      theta: base of the frequencies.
      positions: [s] int, the position of each row of ``x``; default 0..s-1.
      scaling: Llama 3.1's frequency stretch, or None.

    Returns:
      x rotated by position, same shape and dtype.
    """
    h = x.shape[-1]
    if positions is None:
        positions = jnp.arange(x.shape[0])
    freq = rope_frequencies(h, theta, scaling)                           # [h/2]
    angle = positions.astype(jnp.float32)[:, None] * freq                 # [s, h/2]
    cos, sin = (f(angle)[:, None, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | None = None) -> jax.Array:
    """The rotary frequencies, float32 [head_dim / 2], stretched by ``scaling``."""
    freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return freq
    wavelength = 2 * jnp.pi / freq
    low = scaling.original_max_position / scaling.low_freq_factor    # longest kept as is
    high = scaling.original_max_position / scaling.high_freq_factor
    smooth = ((scaling.original_max_position / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    between = (1 - smooth) * freq / scaling.factor + smooth * freq
    return jnp.where(wavelength > low, freq / scaling.factor,
                     jnp.where(wavelength < high, freq, between))


class KVCache(NamedTuple):
    """One layer's keys and values for decoding, per device.

    ``k``, ``v``: [b, kv, L, h] in the compute dtype, this rank's key/value
    heads (split over the tensor axis), rotary embeddings applied to ``k``;
    L is the cache length, fixed when the prompt fills it. Positions past
    the current one hold nothing the attention reads.
    """

    k: jax.Array
    v: jax.Array
