"""Text generation: the prompt in one pass, then one token per step in one compiled loop.

Prefill runs the prompt through the model's tensor(+sequence)-parallel
layers (the overlap ops) and keeps what decoding needs: each Transformer
layer's keys and values, each Mamba-2 mixer's convolution and SSM states.
Each decode step then runs one token through the layers without sequence
parallelism, every row-parallel layer ending in
:func:`jax_flashoverlap.all_reduce`: messages of ``batch × d`` elements, the
small all-reduces its low-latency kernels are for. The steps run in one
``lax.fori_loop`` inside one jitted program, with the caches donated and
updated in place::

    with jax.set_mesh(mesh):
        tokens = generate(model, prompt, 64)                   # greedy
        tokens, logits = generate(model, prompt, 64, temperature=0.8, top_k=40,
                                  rng=jax.random.key(0), return_logits=True)

:class:`Generator` holds the compiled programs of one shape, for callers that
time prefill and decoding apart (the ``jax-flashoverlap-generate`` command,
``benchmarks/decode.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashoverlap import dispatch
from jax_flashoverlap.nn import shard_map_apply

from .layers import CausalLM

__all__ = ["generate", "Generator", "Prefilled", "sample", "decoding_params"]


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Everything static about one generation: the programs' compile-time arguments."""

    batch: int
    prompt_len: int
    padded_len: int      # the prompt padded to what the model's layers split
    cache_len: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    return_logits: bool


class Prefilled(NamedTuple):
    """What prefill leaves for the decode loop, all on the mesh.

    Attributes:
      caches: one per layer (``KVCache`` or ``SSMCache``), sharded over the
        data and tensor axes.
      token: int32 [batch], the first new token.
      tokens: int32 [batch, prompt_len + max_new_tokens]: the prompt and the
        first new token; decoding fills the rest.
      logits: float32 [batch, max_new_tokens, vocab] with row 0 filled (the
        first token's logits), or None without ``return_logits``.
    """

    caches: tuple
    token: jax.Array
    tokens: jax.Array
    logits: jax.Array | None


def sample(logits: jax.Array, rng: jax.Array | None, step: int | jax.Array, *,
           temperature: float, top_k: int | None) -> jax.Array:
    """The next token of each row.

    The random draws depend on (rng, step) and the batch's shape, never on
    how the batch is split over devices, so the same call samples the same
    tokens on any mesh.

    Args:
      logits: float32 [batch, vocab].
      rng: a PRNG key (unused when greedy).
      step: which new token this is (0 for the first).
      temperature: 0 for greedy (argmax), else the softmax temperature.
      top_k: sample among the k largest logits only (None: all); logits
        equal to the k-th largest are kept too.

    Returns:
      int32 [batch].
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k is not None:  # ties with the k-th largest stay in
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    # The Gumbel-max draw of jax.random.categorical, with noise of the
    # batch's whole shape: the bits do not depend on how it is split. The
    # argmax of logits / T + noise; below T = 1 that scaled by T (the same
    # token), so that neither term overflows at any finite T.
    noise = jax.random.gumbel(jax.random.fold_in(rng, step), logits.shape, logits.dtype)
    scores = logits / temperature + noise if temperature >= 1 else logits + temperature * noise
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def decoding_params(model: CausalLM) -> nnx.State:
    """``model``'s state with every matrix in the compute dtype.

    The layers cast their float32 weights to the compute dtype at every use;
    once per token, that would read 4 bytes a weight and write 2 before the
    GEMM reads 2. Cast once, decoding reads only the 2: the same numbers, as
    the layers cast the same way (vectors, used in float32, stay float32).
    A matrix already in the compute dtype (``param_dtype``) is the model's
    own array, not a copy.
    """
    dtype = jnp.dtype(model.config.dtype)

    def cast(a):
        return a.astype(dtype) if a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree.map(cast, nnx.state(model))


class Generator:
    """The compiled prefill and decode loop of one model and generation shape.

    Build it under the mesh the model lives on (``jax.set_mesh``); it checks
    the shape, casts the weights for decoding (:func:`decoding_params`) and
    compiles both programs, so that calls time only the work.

    Args:
      model: a :class:`~jax_flashoverlap.models.Transformer` or
        :class:`~jax_flashoverlap.models.Mamba2`, as the trainer builds it.
      batch: rows; must divide by the data axis.
      prompt_len: tokens per prompt (at least 1).
      max_new_tokens: tokens to generate (at least 1).
      temperature: 0 for greedy, else the sampling temperature.
      top_k: sample among the k most likely tokens (None: all).
      return_logits: also return each new token's logits.
      cache_len: positions each KV cache holds; default (and minimum) what
        ``prompt_len + max_new_tokens`` needs. A larger one lets decode loops
        of different lengths share a cache size (benchmarks).
      compiler_options: XLA options for the decode loop (as
        ``jax.stages.Lowered.compile`` takes them), for experiments.
      on_token: called on the host as the decode loop makes each token, with
        the int32 tokens [batch] (numpy) and which new token they are (1 for
        the first decode step's; prefill's token 0 is :meth:`prefill`'s):
        for streaming text. Calls may come out of order (JAX orders host
        callbacks on one device only), so use the step number, and
        ``jax.effects_barrier()`` waits for the last. One host callback a
        step, so the decode loop is slower; None (default): no callback.

    Attributes:
      compile_s: seconds spent compiling the two programs.
      decode_weights: what the model's decode step reads besides its
        parameters, prepared once (``model.decode_weights``: the blocks'
        weights in the decode kernel's layout where ``decode_blocks``,
        "auto" or "cuda", runs it), or None.
    """

    def __init__(self, model: CausalLM, *, batch: int, prompt_len: int, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None,
                 return_logits: bool = False, cache_len: int | None = None,
                 compiler_options: dict | None = None,
                 on_token: Callable[[np.ndarray, int], None] | None = None):
        mesh = _mesh()
        config = model.config
        _check_count("max_new_tokens", max_new_tokens, 1)
        _check_count("prompt length", prompt_len, 1)
        _check_count("batch", batch, 1)
        if prompt_len + max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"generate: prompt length {prompt_len} + max_new_tokens {max_new_tokens} = "
                f"{prompt_len + max_new_tokens} exceeds the model's max_seq_len="
                f"{config.max_seq_len}; shorten the prompt or generate fewer tokens.")
        temperature = _check_sampling(temperature, top_k, config.vocab_size)
        config.check(dict(mesh.shape), batch=batch)
        multiple = config.sequence_multiple(mesh.shape[config.sharding.tensor])
        padded_len = -(-prompt_len // multiple) * multiple
        # Prefill writes every padded position; decoding writes positions
        # prompt_len .. total-2 (the last token is never fed back).
        needed = max(padded_len, prompt_len + max_new_tokens - 1)
        if cache_len is not None and cache_len < needed:
            raise ValueError(f"Generator: cache_len={cache_len} is shorter than the {needed} "
                             f"positions this generation writes")
        self.model = model
        self.shape = _Shape(batch, prompt_len, padded_len, cache_len or needed, max_new_tokens,
                            float(temperature), top_k, return_logits)
        self.params = decoding_params(model)
        graphdef = nnx.graphdef(model)
        local_batch = batch // mesh.shape[config.sharding.data]
        tensor_size = mesh.shape[config.sharding.tensor]
        def prepare(params):
            return nnx.merge(graphdef, params).decode_weights(batch=local_batch,
                                                              tensor_size=tensor_size)

        # Traced once to see whether there is anything to prepare: a model
        # whose layers decode on their own compiles nothing here.
        self.decode_weights = (None if jax.eval_shape(prepare, self.params) is None
                               else jax.jit(prepare)(self.params))
        data = config.sharding.data
        prompt = jax.ShapeDtypeStruct((batch, padded_len), jnp.int32,
                                      sharding=NamedSharding(mesh, P(data, None)))
        key = jax.random.key(0)
        start = time.perf_counter()
        # "auto" resolves when a program lowers: inside the model's own
        # preferences (its training step's, e.g. Mamba-2's reduce-scatter to XLA).
        with dispatch.prefer_xla(config.auto_xla_ops):
            self._prefill = _PREFILL.lower(graphdef, self.shape, self.params, prompt,
                                           key).compile()
        self._graphdef = graphdef
        self._decode = {}
        self._decode_args = (self._prefill.out_info, key)
        self._compiler_options = compiler_options
        self._on_token = on_token
        self.decode_steps(max_new_tokens - 1)  # compiles the full loop
        self.compile_s = time.perf_counter() - start

    def prefill(self, prompt: jax.Array, rng: jax.Array | None = None) -> Prefilled:
        """The prompt through the model, and the first new token.

        Args:
          prompt: int [batch, prompt_len], checked as :func:`generate` does.
          rng: PRNG key for sampling (needed when ``temperature > 0``).
        """
        prompt = _check_prompt(prompt, self.shape, self.model.config.vocab_size)
        padded = np.zeros((self.shape.batch, self.shape.padded_len), np.int32)
        padded[:, :self.shape.prompt_len] = prompt
        sharding = NamedSharding(_mesh(), P(self.model.config.sharding.data, None))
        # Each process places its own rows (the prompt is whole on every one).
        placed = jax.make_array_from_callback(padded.shape, sharding, lambda index: padded[index])
        return self._prefill(self.params, placed, self._key(rng))

    def decode(self, prefilled: Prefilled, rng: jax.Array | None = None,
               steps: int | None = None) -> tuple[jax.Array, jax.Array | None]:
        """Decodes from ``prefilled`` (whose caches it donates: use it once).

        Args:
          prefilled: :meth:`prefill`'s result.
          rng: the key given to :meth:`prefill`.
          steps: decode steps (default ``max_new_tokens - 1``, the rest of the
            tokens); fewer leaves the last tokens 0 (for timing loops of
            several lengths at one cache size).

        Returns:
          (int32 tokens [batch, prompt_len + max_new_tokens], float32 logits
          [batch, max_new_tokens, vocab] or None).
        """
        steps = self.shape.max_new_tokens - 1 if steps is None else steps
        done = self.decode_steps(steps)(self.params, prefilled, self._key(rng),
                                        self.decode_weights)
        return done.tokens, done.logits

    def decode_steps(self, steps: int):
        """The compiled loop of ``steps`` decode steps:
        ``(params, prefilled, rng, decode_weights) -> prefilled`` advanced by
        ``steps`` tokens."""
        if not 0 <= steps <= self.shape.max_new_tokens - 1:
            raise ValueError(f"Generator: steps={steps} outside 0..{self.shape.max_new_tokens - 1}")
        if steps not in self._decode:
            prefilled, key = self._decode_args
            self._decode[steps] = _DECODE_LOOP.lower(
                self._graphdef, self.shape, self.params, prefilled, key, steps,
                self.decode_weights, self._on_token).compile(self._compiler_options or None)
        return self._decode[steps]

    def __call__(self, prompt: jax.Array, rng: jax.Array | None = None):
        """Prefill, then decode: (tokens, logits or None), as :meth:`decode`."""
        return self.decode(self.prefill(prompt, rng), rng)

    def _key(self, rng):
        return _check_key(rng, self.shape.temperature)


def generate(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, rng: jax.Array | None = None,
             return_logits: bool = False):
    """Continues each prompt by ``max_new_tokens`` tokens.

    Call it under the mesh the model was built on (``jax.set_mesh(mesh)``):
    the batch is split over the data axis, heads and widths over the tensor
    axis. Prefill runs the prompt through the model's parallel layers (the
    overlap ops); each new token then takes one decode step, all of them in
    one compiled loop (see the module docstring).

    Args:
      model: a :class:`~jax_flashoverlap.models.Transformer` or
        :class:`~jax_flashoverlap.models.Mamba2`.
      prompt: int [batch, prompt_len] token ids in ``[0, vocab_size)``;
        batch must divide by the data axis, and ``prompt_len +
        max_new_tokens`` must not exceed the config's ``max_seq_len``.
      max_new_tokens: tokens to generate, at least 1.
      temperature: 0 (default) picks the most likely token; above 0 samples
        from the softmax of logits / temperature.
      top_k: with sampling, only among the k most likely tokens (and those
        tied with the k-th); needs ``temperature > 0``.
      rng: PRNG key for sampling (``jax.random.key(seed)`` or
        ``jax.random.PRNGKey(seed)``); needed when ``temperature > 0``,
        ignored when greedy. The draws depend on ``rng`` and the batch's
        shape, not on the mesh.
      return_logits: also return the model's logits at each new token's
        position (before temperature and top_k).

    Returns:
      int32 tokens [batch, prompt_len + max_new_tokens] (the prompt, then the
      new tokens); with ``return_logits``, ``(tokens, logits)`` with float32
      logits [batch, max_new_tokens, vocab].

    Raises:
      TypeError: a prompt that is not integer token ids, ``rng`` that is
        not one key of jax's default implementation, or a call inside
        ``jax.jit`` (generate compiles its own programs: call it outside).
      ValueError: a shape, a length or an argument out of range, naming it.

    Everything checkable from the arguments alone is checked before the
    programs compile.
    """
    if any(isinstance(a, jax.core.Tracer) for a in (prompt, rng, temperature)):
        raise TypeError("generate: called inside a jax transformation (jax.jit, nnx.jit, ...); "
                        "it compiles its own prefill and decode loop: call it outside, on "
                        "concrete arrays.")
    shape = np.shape(prompt)
    if len(shape) != 2:
        raise ValueError(f"generate: prompt must be 2-D [batch, prompt_len], got shape {shape}")
    prompt = _check_tokens(prompt, model.config.vocab_size)
    _check_key(rng, _check_sampling(temperature, top_k, model.config.vocab_size))
    generator = Generator(model, batch=shape[0], prompt_len=shape[1],
                          max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          return_logits=return_logits)
    tokens, logits = generator(prompt, rng)
    return (tokens, logits) if return_logits else tokens


def _prefill(graphdef, shape: _Shape, params, prompt, rng) -> Prefilled:
    model = nnx.merge(graphdef, params)
    sharding = model.config.sharding
    caches, logits = shard_map_apply(
        functools.partial(type(model).prefill, length=shape.prompt_len,
                          cache_len=shape.cache_len),
        model, prompt.T, in_specs=(sharding.tokens_sb,),
        out_specs=(model.cache_specs(), P(sharding.data, None)))
    token = sample(logits, rng, 0, temperature=shape.temperature, top_k=shape.top_k)
    # Padding what is already split over the data axis keeps that split
    # (on meshes with explicit axes, new zeros would be whole on every rank).
    tokens = jnp.pad(prompt[:, :shape.prompt_len], ((0, 0), (0, shape.max_new_tokens)))
    tokens = tokens.at[:, shape.prompt_len].set(token)
    all_logits = None
    if shape.return_logits:
        all_logits = jnp.pad(logits[:, None], ((0, 0), (0, shape.max_new_tokens - 1), (0, 0)))
    return Prefilled(caches, token, tokens, all_logits)


def _decode_loop(graphdef, shape: _Shape, params, prefilled: Prefilled, rng,
                 steps: int, decode_weights=None, on_token=None) -> Prefilled:
    """``steps`` decode steps from ``prefilled``; ``decode_weights`` as the
    model's ``decode_weights`` returns them; ``on_token`` as Generator's."""
    model = nnx.merge(graphdef, params)
    data = model.config.sharding.data
    extra, extra_specs = (), ()
    if decode_weights is not None:
        extra, extra_specs = (decode_weights,), (model.decode_weights_specs(),)

    def step(i, carry: Prefilled) -> Prefilled:
        pos = shape.prompt_len + i                          # of carry.token
        logits, caches = shard_map_apply(
            type(model).decode_step, model, carry.token, carry.caches, pos, *extra,
            in_specs=(P(data), model.cache_specs(), P(), *extra_specs),
            out_specs=(P(data, None), model.cache_specs()))
        token = sample(logits, rng, i + 1, temperature=shape.temperature, top_k=shape.top_k)
        if on_token is not None:
            jax.debug.callback(lambda t, n: on_token(np.asarray(t), int(n)), token, i + 1)
        tokens = jax.lax.dynamic_update_slice(carry.tokens, token[:, None], (0, pos + 1))
        all_logits = carry.logits
        if all_logits is not None:
            all_logits = jax.lax.dynamic_update_slice(all_logits, logits[:, None],
                                                      (0, i + 1, 0))
        return Prefilled(caches, token, tokens, all_logits)

    # Returned whole, so that every donated buffer is updated in place.
    return jax.lax.fori_loop(0, steps, step, prefilled)


# Module-level, so that generators of one model and shape share jax's caches
# of traces and compiled programs.
_PREFILL = jax.jit(_prefill, static_argnums=(0, 1))
_DECODE_LOOP = jax.jit(_decode_loop, static_argnums=(0, 1, 5, 7), donate_argnums=3)


def _mesh() -> jax.sharding.Mesh:
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("generate: call it under `with jax.set_mesh(mesh):`, the (data, "
                         "tensor) mesh the model was built on.")
    return mesh


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"generate: {name} must be an int >= {minimum}, got {value!r}")


def _check_sampling(temperature: Any, top_k: Any, vocab_size: int) -> float:
    """The temperature as a float, or a clear error about it or ``top_k``."""
    value = None
    if (not isinstance(temperature, (bool, np.bool_, str, bytes))
            and np.ndim(temperature) == 0
            and any(jnp.issubdtype(np.asarray(temperature).dtype, kind)
                    for kind in (jnp.floating, jnp.integer))):
        value = float(temperature)
    if value is None or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0: greedy), "
                         f"got {temperature!r}")
    if top_k is not None:
        _check_count("top_k", top_k, 1)
        if top_k > vocab_size:
            raise ValueError(f"generate: top_k={top_k} exceeds the vocabulary "
                             f"({vocab_size} tokens)")
        if value == 0:
            raise ValueError(f"generate: top_k={top_k} only applies when sampling; at "
                             f"temperature 0 the most likely token is taken. Pass a "
                             f"temperature > 0, or no top_k.")
    return value


def _check_key(rng: Any, temperature: float) -> jax.Array:
    """The key the programs take: ``rng`` as a typed threefry key, or a fixed
    one when greedy (the key is then never used)."""
    if temperature == 0:
        return jax.random.key(0)
    if rng is None:
        raise ValueError("generate: temperature > 0 samples tokens and needs "
                         "rng=jax.random.key(seed)")
    default = jax.random.key(0).dtype  # what the programs were compiled for
    dtype = getattr(rng, "dtype", None)
    if (dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            and np.dtype(dtype) == np.uint32):
        try:  # a raw key, as jax.random.PRNGKey makes
            rng = jax.random.wrap_key_data(rng)
        except (TypeError, ValueError):
            pass
    if getattr(rng, "dtype", None) != default or np.shape(rng) != ():
        raise TypeError(f"generate: rng must be one key, jax.random.key(seed) or "
                        f"jax.random.PRNGKey(seed) (jax's default implementation, {default}); "
                        f"got {getattr(rng, 'dtype', type(rng).__name__)} of shape "
                        f"{np.shape(rng)}")
    return rng


def _check_tokens(prompt: Any, vocab_size: int) -> np.ndarray:
    """The prompt's token ids as int32 numpy, or a clear error."""
    array = np.asarray(prompt)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"generate: prompt must hold integer token ids, got dtype "
                        f"{array.dtype}; e.g. np.frombuffer(text.encode(), np.uint8)"
                        f".astype(np.int32) for byte-level tokens.")
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        bad = array[(array < 0) | (array >= vocab_size)].flat[0]
        raise ValueError(f"generate: token id {bad} in the prompt is outside the "
                         f"vocabulary [0, {vocab_size})")
    return array.astype(np.int32)


def _check_prompt(prompt: Any, shape: _Shape, vocab_size: int) -> np.ndarray:
    """The prompt as int32 numpy for a generator of ``shape``, or a clear error."""
    array = _check_tokens(prompt, vocab_size)
    want = (shape.batch, shape.prompt_len)
    if array.shape != want:
        raise ValueError(f"generate: prompt has shape {array.shape}, this generator takes "
                         f"{want}")
    return array

