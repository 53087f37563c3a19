"""One JAX primitive per op, lowered per implementation and platform.

A primitive (rather than a plain function) gives each op three things: its
result is typed like the XLA collective it replaces (the all-reduces are
invariant over the axis, like ``psum``), ``impl="auto"`` is resolved at
lowering time for the platform the program is compiled for, and the CUDA
lowering can read the device mesh to tell each GPU who its peers are.

What is here is the same for every op. Each op's own definition (its
:class:`OpDef`: result shapes, FFI attributes, options, kernel choice and
other lowerings) is in its module, ``jax_flashoverlap/<op>.py``, which
registers it with :func:`define`. The matmuls' primitives take 2-D operands
(the public ops reshape around them); all_reduce's takes x as it comes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _extension, _groups, _jax_shim, _module_loading, dispatch, settings

__all__ = ["OpDef", "define", "bind", "OPS", "transport_attrs", "timeout_ms", "as_tuple",
           "local_dot", "decomposed_with", "baseline"]

TIMEOUT_ENV = "JAX_FLASHOVERLAP_TIMEOUT_MS"
DEFAULT_TIMEOUT_MS = settings.SETTINGS[TIMEOUT_ENV].default


def timeout_ms() -> int:
    """Bound of every device-side wait of a CUDA op, in milliseconds.

    ``JAX_FLASHOVERLAP_TIMEOUT_MS`` (read when a function is lowered, so set
    it before the first ``jit`` of the code that calls the op), default
    10 000. A wait that runs out fills the op's outputs with NaN and the next
    call (or :func:`jax_flashoverlap.check_device_errors`) raises an error
    naming the rank and the peer that was missing.
    """
    return settings.get(TIMEOUT_ENV)


@dataclasses.dataclass(frozen=True)
class OpDef:
    """How one op is typed and lowered.

    Attributes:
      name: public name, also the primitive's name.
      ffi_target: name of the CUDA handler.
      out_shapes: ``(*operand_shapes, n, opts) -> result shapes``.
      reduces: the result is identical on every rank (typed invariant).
      xla: the ``impl="xla"`` function ``(*args, axis_name, **opts) -> results``.
      decomposed: the ``impl="decomposed"`` function, same signature.
      cuda_attrs: ``(n, opts) -> FFI attributes`` other than the groups, a
        pure function of the options the steps below decided.
      single_rank: the op on an axis of one rank, for every impl: the local
        dot (all_reduce: the operand), ``(*args) -> results``.
      options: ``(ctx, n, opts) -> opts`` with the options every impl
        takes that depend on the shapes, resolved at lowering.
      cuda_options: ``(ctx, n, opts) -> opts`` with every choice of the
        kernel's (by shape, or :mod:`.cuda_policy`'s) decided and checked at
        lowering.
      cuda_lowering: ``(ctx, args, transport, n, opts) -> lowering or None``:
        another CUDA lowering for some shapes (None: the op's own kernel).
      across_processes: ``(ctx, args, impl, n, opts) -> lowering or None``:
        over an axis of one GPU per process with NVSHMEM started, how impl
        "cuda" and "auto" run (None: XLA's collective).
    """

    name: str
    ffi_target: str
    out_shapes: Callable[..., tuple[tuple[int, ...], ...]]
    reduces: bool
    xla: Callable[..., Any]
    decomposed: Callable[..., Any]
    cuda_attrs: Callable[[int, dict], dict]
    single_rank: Callable[..., tuple]
    options: Callable[..., dict] | None = None
    cuda_options: Callable[..., dict] | None = None
    cuda_lowering: Callable[..., Any] | None = None
    across_processes: Callable[..., Any] | None = None


def transport_attrs(group_ordinals: np.ndarray, n: int, timeout: int) -> dict:
    """The FFI attributes every CUDA handler binds first (the transport's):
    the groups' transport ids [G*n] by rank (:mod:`._groups`), the
    ranks per group, and the bound of every wait in milliseconds."""
    return {"group_ordinals": np.asarray(group_ordinals, np.int32), "n": np.int32(n),
            "timeout_ms": np.int32(timeout)}


def as_tuple(fn):
    """``fn`` with its result, one array or several, returned as a tuple."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return wrapped


def local_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [m, k] @ w [k, n_out] in x's dtype: a collective matmul on one rank."""
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def decomposed_with(fn: Callable[..., Any], *keys: str) -> Callable[..., Any]:
    """An ``impl="decomposed"`` function ``(*args, axis_name, **opts)`` that
    passes ``fn`` only the options it understands (``keys``)."""
    def call(*args, axis_name, **opts):
        return fn(*args, axis_name, **{k: opts[k] for k in keys if k in opts})
    return call


def baseline(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An ``impl="xla"`` function ``(*args, axis_name, **opts)`` from XLA's
    collective ``fn(*args, axis_name)``."""
    def call(*args, axis_name, **opts):
        del opts  # XLA's collectives have no schedule options.
        return fn(*args, axis_name)
    return call


# Every op's definition and primitive by name, filled by the op's own module
# (jax_flashoverlap/<op>.py) through define(); the package imports all four,
# so an op's gradient can bind its mirror by name.
OPS: dict[str, OpDef] = {}
_PRIMITIVES: dict[str, Primitive] = {}


def define(op: OpDef) -> OpDef:
    """Makes ``op``'s primitive, typed and lowered for every platform, and
    registers both under ``op.name`` for :func:`bind`; returns ``op``."""
    OPS[op.name] = op
    _PRIMITIVES[op.name] = _make_primitive(op)
    return op


def _make_primitive(op: OpDef) -> Primitive:
    prim = Primitive(f"jax_flashoverlap_{op.name}")
    prim.multiple_results = True

    def abstract_eval(*avals, axis_name, n, impl, opts):
        del impl
        varying = frozenset().union(*(_jax_shim.varying_axes(a) for a in avals))
        varying = varying - {axis_name} if op.reduces else varying | {axis_name}
        shapes = op.out_shapes(*(a.shape for a in avals), n, dict(opts))
        return [_jax_shim.with_varying_axes(avals[0], s, varying) for s in shapes]

    def lower_single_rank(ctx, *args):
        """Every impl on every platform, over an axis of one rank."""
        return mlir.lower_fun(lambda *xs: _sliced(op.single_rank(*xs), ctx),
                              multiple_results=True)(ctx, *args)

    def lower_portable(ctx, *args, axis_name, n, impl, opts):
        """Every platform but CUDA: the pure-JAX implementations."""
        if n == 1:
            return lower_single_rank(ctx, *args)
        if impl == "cuda":
            raise ValueError(
                f"{op.name}(impl='cuda') runs only on NVIDIA GPUs, but this computation "
                f"is being compiled for {ctx.module_context.platforms}; use impl='auto'.")
        if impl == "auto":
            impl = dispatch.resolve(op.name, [a.shape for a in ctx.avals_in],
                                    ctx.avals_in[0].dtype, n,
                                    platform=ctx.module_context.platforms[0],
                                    chunks=dict(opts).get("chunks")).impl
        opts = dict(opts)
        if op.options is not None:
            opts = op.options(ctx, n, opts)
        fn = functools.partial(op.decomposed if impl == "decomposed" else op.xla,
                               axis_name=axis_name, **opts)
        if impl != "decomposed" and ctx.module_context.platforms == ("cpu",):
            fn = _widened_16_bit(fn)

        return mlir.lower_fun(lambda *xs: _sliced(fn(*xs), ctx),
                              multiple_results=True)(ctx, *args)

    def lower_cuda(ctx, *args, axis_name, n, impl, opts):
        if n == 1:
            return lower_single_rank(ctx, *args)
        if (op.across_processes is not None and impl in ("auto", "cuda")
                and _groups.axis_is_all_processes(ctx, n) and _groups.nvshmem_started()):
            other = op.across_processes(ctx, args, impl, n, dict(opts))
            if other is not None:
                return other
            impl = "xla"
        groups = None
        if impl == "auto":
            impl = dispatch.resolve(op.name, [a.shape for a in ctx.avals_in],
                                    ctx.avals_in[0].dtype, n, platform="cuda",
                                    chunks=dict(opts).get("chunks"),
                                    processes=_groups.group_processes(ctx, axis_name, n)).impl
            if impl == "cuda":
                try:
                    groups = _groups.group_ids(ctx, op.name, axis_name, n)
                except ValueError:  # no concrete mesh, or groups across processes
                    impl = "xla"
        if impl != "cuda":
            return lower_portable(ctx, *args, axis_name=axis_name, n=n, impl=impl, opts=opts)
        _extension.require_cuda_ops(op.name, op.ffi_target)
        _module_loading.warn_if_lazy(op.name)
        _extension.push_settings()
        opts = dict(opts)
        transport = transport_attrs(
            groups if groups is not None else _groups.group_ids(ctx, op.name, axis_name, n), n,
            opts.pop("timeout_ms", timeout_ms()))
        if op.options is not None:
            opts = op.options(ctx, n, opts)
        if op.cuda_options is not None:
            opts = op.cuda_options(ctx, n, opts)
        if op.cuda_lowering is not None:
            other = op.cuda_lowering(ctx, args, transport, n, opts)
            if other is not None:
                return other
        return jax.ffi.ffi_lowering(op.ffi_target)(
            ctx, *args, **transport, **op.cuda_attrs(n, opts))

    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lower_portable)
    mlir.register_lowering(prim, lower_cuda, platform="cuda")
    return prim


def _sliced(results, ctx) -> list:
    """``results`` cut to the lowering's declared shapes: results asked for
    empty (e.g. an unneeded x_gathered) go, and XLA drops the work behind them."""
    return [r[tuple(slice(0, d) for d in aval.shape)] for r, aval in zip(results, ctx.avals_out)]


def _widened_16_bit(fn):
    """``fn`` run on 16-bit float operands widened to float32, its results
    rounded back.

    XLA's CPU compiler aborts the process ("hlo_instruction.cc: Invalid
    binary instruction opcode copy") on a bf16 or f16 all-reduce or
    reduce-scatter inside a shard_map that is manual over only some mesh axes
    (jaxlib 0.11.2; plain jax reproduces it: a partial-manual shard_map over a
    bf16 ``psum``, or the gradient of ``all_gather`` then a dot; no upstream
    report found). XLA's collectives on CPU therefore sum in float32: the
    same result, rounded once instead of per addition.
    """
    def widened(*args):
        narrow = [a.dtype for a in args]
        out = fn(*(a.astype(jnp.float32) if _is_16_bit_float(a.dtype) else a for a in args))
        dtype = next((d for d in narrow if _is_16_bit_float(d)), None)
        return out if dtype is None else [
            r.astype(dtype) if r.dtype == jnp.float32 else r for r in out]
    return widened


def _is_16_bit_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def bind(name: str, *args: jax.Array, axis_name: str, n: int, impl: str,
         **opts: Any) -> tuple[jax.Array, ...]:
    """Applies op ``name`` to 2-D operands; returns its results as a tuple."""
    if impl == "cuda" and n > 1:
        _extension.require_cuda_ops(name, OPS[name].ffi_target)
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items()))
    with jax.named_scope(f"jax_flashoverlap.{name}"):
        return tuple(_PRIMITIVES[name].bind(*args, axis_name=axis_name, n=n, impl=impl,
                                            opts=frozen))
