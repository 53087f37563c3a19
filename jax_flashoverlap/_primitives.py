"""One JAX primitive per op, lowered per implementation and platform.

A primitive (rather than a plain function) gives each op three things: its
result is typed like the XLA collective it replaces (the all-reduces are
invariant over the axis, like ``psum``), ``impl="auto"`` is resolved at
lowering time for the platform the program is compiled for, and the CUDA
lowering can read the device mesh to tell each GPU who its peers are.

All primitives take 2-D operands; the public ops reshape around them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import (
    _cuda_limits,
    _extension,
    _groups,
    _jax_shim,
    _module_loading,
    cuda_policy,
    decomposed,
    dispatch,
    schedule,
    settings,
    xla_baseline,
)
from ._op_handlers import FFI_TARGETS

__all__ = ["OpDef", "bind", "OPS"]

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
      spans_processes: over an axis of one GPU per process with NVSHMEM
        started, impl "cuda" and "auto" may run the NVSHMEM all-reduce.
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
    spans_processes: bool = False


def _as_tuple(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return wrapped


def _policy_choice(name: str, choices: tuple[str, ...]) -> str:
    """cuda_policy.<name>, checked against its choices (users may set it)."""
    value = getattr(cuda_policy, name)
    if value not in choices:
        raise ValueError(f"cuda_policy.{name} must be one of {choices}, got {value!r}")
    return value




# The CUDA kernels send straight to every peer over NVLink: they always run
# the "direct" schedule, whatever topology the pure-JAX path was given.
def transport_attrs(group_ordinals: np.ndarray, n: int, timeout: int) -> dict:
    """The FFI attributes every CUDA handler binds first (the transport's):
    the groups' transport ids [G*n] by rank (:mod:`._groups`), the
    ranks per group, and the bound of every wait in milliseconds."""
    return {"group_ordinals": np.asarray(group_ordinals, np.int32), "n": np.int32(n),
            "timeout_ms": np.int32(timeout)}


def _ag_attrs(n, opts):
    sched = schedule.all_gather_schedule(n, "direct", opts.get("chunks", 1))
    return {"order": sched.order().reshape(-1), "chunks": np.int32(sched.chunks),
            "waits_on_xla_stream": np.int32(opts["peer_wait_stream"] == "xla"),
            "tile_signalled": np.int32(opts["gemm"] == "tile_signalled")}


def _rs_attrs(n, opts):
    sched = schedule.reduce_scatter_schedule(n, "direct", opts.get("chunks", 1))
    return {"order": sched.order().reshape(-1), "chunks": np.int32(sched.chunks),
            "add_after": np.int32(opts["fold"] == "add_after"),
            "waits_on_xla_stream": np.int32(opts["peer_wait_stream"] == "xla"),
            "tile_signalled": np.int32(opts["gemm"] == "tile_signalled")}


def _mar_attrs(n, opts):
    return {"chunk_rows": np.asarray(opts["chunk_rows"], np.int32),
            "tile_signalled": np.int32(opts["gemm"] == "tile_signalled")}


def _ar_attrs(n, opts):
    return {"algorithm": np.int32(cuda_policy.ALL_REDUCE_KERNELS.index(opts["algorithm"]))}


def _collective_matmul_options(op_name: str):
    """cuda_options of the collective matmuls, every kernel choice decided here
    from cuda_policy: chunks=None picked by shape, where peer waits run, the
    GEMM, and matmul_reduce_scatter's fold."""
    def options(ctx, n, opts):
        if opts.get("chunks") is None:
            opts["chunks"] = cuda_policy.collective_matmul_chunks(
                op_name, [a.shape for a in ctx.avals_in], n)
        opts["peer_wait_stream"] = _policy_choice("PEER_WAIT_STREAM",
                                                  cuda_policy.PEER_WAIT_STREAMS)
        policy = {"all_gather_matmul": "ALL_GATHER_GEMM",
                  "matmul_reduce_scatter": "REDUCE_SCATTER_GEMM"}[op_name]
        opts["gemm"] = _policy_choice(policy, getattr(cuda_policy, policy + "S"))
        if opts["gemm"] == "tile_signalled":
            _cuda_limits.check_tile_signalled(*ctx.avals_in, policy=policy)
            if op_name == "all_gather_matmul" and n != 2:
                raise ValueError(f"the tile-signalled GEMM (cuda_policy.{policy}) runs on an "
                                 f"axis of 2 devices, got {n}; set cuda_policy.{policy} = "
                                 f"'row_blocks'")
        if op_name == "matmul_reduce_scatter":
            opts["fold"] = _policy_choice("REDUCE_SCATTER_FOLD", cuda_policy.REDUCE_SCATTER_FOLDS)
        return opts
    return options


def _ar_options(ctx, n, opts):
    """algorithm=None picked by message size, decided here with the impl."""
    aval = ctx.avals_in[0]
    if opts["algorithm"] is None:
        opts["algorithm"] = cuda_policy.all_reduce_algorithm(
            math.prod(aval.shape) * aval.dtype.itemsize, n, aval.dtype)
    _cuda_limits.check_lamport_size(aval, opts["algorithm"])
    return opts


COPY_ENGINE_ALL_REDUCE_TARGET = "jfo_all_reduce_copy_engine"


def _ar_lowering(ctx, args, transport, n, opts):
    """algorithm="copy_engine": its own handler, the message within one
    receive slot of the transport; the kernels: None (jfo_all_reduce)."""
    if opts["algorithm"] != "copy_engine":
        return None
    _cuda_limits.check_copy_engine_size(ctx.avals_in[0])
    _extension.require_cuda_ops("all_reduce", COPY_ENGINE_ALL_REDUCE_TARGET)
    return jax.ffi.ffi_lowering(COPY_ENGINE_ALL_REDUCE_TARGET)(
        ctx, *args, **transport, chunks=np.int32(cuda_policy.COPY_ENGINE_ALL_REDUCE_CHUNKS))


def _mar_options(ctx, n, opts):
    """The row chunks of ``chunks``: shrinking, each rank's part of every chunk
    but the first a multiple of MATMUL_ALL_REDUCE_PART_ALIGN rows."""
    rows = ctx.avals_in[0].shape[0]
    opts["chunk_rows"] = schedule.all_reduce_chunk_rows(
        rows, opts.pop("chunks"), align=n * cuda_policy.MATMUL_ALL_REDUCE_PART_ALIGN)
    return opts


def _mar_cuda_options(ctx, n, opts):
    """The kernel by result size, and the fused kernel's GEMMs (checked)."""
    out = ctx.avals_out[0]
    opts["kernel"] = cuda_policy.matmul_all_reduce_kernel(math.prod(out.shape) * out.dtype.itemsize)
    opts["gemm"] = _policy_choice("MATMUL_ALL_REDUCE_GEMM", cuda_policy.MATMUL_ALL_REDUCE_GEMMS)
    if opts["kernel"] == "fused" and opts["gemm"] == "tile_signalled":
        _cuda_limits.check_tile_signalled(*ctx.avals_in, policy="MATMUL_ALL_REDUCE_GEMM")
    return opts


def _mar_lowering(ctx, args, transport, n, opts):
    """XLA's dot and the all-reduce kernel for small results; else the fused
    kernel (None), within its event budget."""
    if opts["kernel"] == "gemm_then_all_reduce":
        return _lower_gemm_then_all_reduce(ctx, *args, transport=transport)
    _cuda_limits.check_event_budget(len(opts["chunk_rows"]), n)
    return None


def _local_dot(x, w):
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def _decomposed_with(fn, *keys):
    """Passes only the options ``fn`` understands."""
    def call(*args, axis_name, **opts):
        return fn(*args, axis_name, **{k: opts[k] for k in keys if k in opts})
    return call


def _baseline(fn):
    def call(*args, axis_name, **opts):
        del opts  # XLA's collectives have no schedule options.
        return fn(*args, axis_name)
    return call


OPS: dict[str, OpDef] = {
    "all_gather_matmul": OpDef(
        "all_gather_matmul", FFI_TARGETS["all_gather_matmul"],
        # x_gathered (the backward residual) is [0, k] unless asked for.
        lambda xs, ws, n, opts: ((n * xs[0], ws[1]),
                                 (n * xs[0] if opts.get("gathered") else 0, xs[1])), False,
        _as_tuple(_baseline(xla_baseline.all_gather_matmul)),
        _as_tuple(_decomposed_with(decomposed.all_gather_matmul, "topology")), _ag_attrs,
        lambda x, w: (_local_dot(x, w), x),
        cuda_options=_collective_matmul_options("all_gather_matmul")),
    "matmul_reduce_scatter": OpDef(
        "matmul_reduce_scatter", FFI_TARGETS["matmul_reduce_scatter"],
        lambda xs, ws, n, opts: ((xs[0] // n, ws[1]),), False,
        _as_tuple(_baseline(xla_baseline.matmul_reduce_scatter)),
        _as_tuple(_decomposed_with(decomposed.matmul_reduce_scatter, "topology")), _rs_attrs,
        _as_tuple(_local_dot), cuda_options=_collective_matmul_options("matmul_reduce_scatter")),
    "matmul_all_reduce": OpDef(
        "matmul_all_reduce", FFI_TARGETS["matmul_all_reduce"],
        lambda xs, ws, n, opts: ((xs[0], ws[1]),), True,
        _as_tuple(_baseline(xla_baseline.matmul_all_reduce)),
        _as_tuple(_decomposed_with(decomposed.matmul_all_reduce, "chunk_rows")), _mar_attrs,
        _as_tuple(_local_dot), options=_mar_options, cuda_options=_mar_cuda_options,
        cuda_lowering=_mar_lowering),
    "all_reduce": OpDef(
        "all_reduce", FFI_TARGETS["all_reduce"],
        lambda xs, n, opts: (xs,), True,
        _as_tuple(_baseline(xla_baseline.all_reduce)),
        _as_tuple(_decomposed_with(decomposed.all_reduce)), _ar_attrs, lambda x: (x,),
        cuda_options=_ar_options, cuda_lowering=_ar_lowering, spans_processes=True),
}


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
        if (op.spans_processes and impl in ("auto", "cuda")
                and _groups.axis_is_all_processes(ctx, n) and _groups.nvshmem_started()):
            if _all_reduce_across_processes(ctx, impl, n) == "nvshmem":
                return _lower_nvshmem_all_reduce(ctx, *args, opts=opts)
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


def _lower_gemm_then_all_reduce(ctx, x, w, *, transport):
    """matmul_all_reduce for small messages: XLA's dot, then the all-reduce
    kernel on the same stream (see cuda_policy.matmul_all_reduce_kernel)."""
    _extension.require_cuda_ops("matmul_all_reduce", OPS["all_reduce"].ffi_target)

    def gemm_then_all_reduce(x, w):
        y = jnp.dot(x, w, preferred_element_type=x.dtype)
        nbytes = y.size * y.dtype.itemsize
        call = jax.ffi.ffi_call(OPS["all_reduce"].ffi_target,
                                jax.ShapeDtypeStruct(y.shape, y.dtype))
        n = int(transport["n"])
        return [call(y, **transport, **_ar_attrs(
            n, {"algorithm": cuda_policy.all_reduce_algorithm(nbytes, n, y.dtype)}))]

    return mlir.lower_fun(gemm_then_all_reduce, multiple_results=True)(ctx, x, w)


def _all_reduce_across_processes(ctx, impl: str, n: int) -> str:
    """"nvshmem" or "xla" for an all_reduce over ``n`` processes
    (dispatch.all_reduce_across_processes, with this process's NVSHMEM state)."""
    from . import distributed, nvshmem

    aval = ctx.avals_in[0]
    capacity = nvshmem.max_message_bytes() if nvshmem.is_initialized() else None
    nbytes = math.prod(aval.shape) * aval.dtype.itemsize
    return dispatch.all_reduce_across_processes(nbytes, aval.dtype, impl, capacity,
                                                processes=n, node_size=distributed.node_size())


def _lower_nvshmem_all_reduce(ctx, x, *, opts):
    """NVSHMEM's hierarchical all-reduce over every process."""
    from . import nvshmem

    timeout = int(dict(opts).get("timeout_ms", timeout_ms()))
    return mlir.lower_fun(lambda x: [nvshmem.ffi_all_reduce(x, timeout_ms=timeout)],
                          multiple_results=True)(ctx, x)


_PRIMITIVES = {name: _make_primitive(op) for name, op in OPS.items()}


def bind(name: str, *args: jax.Array, axis_name: str, n: int, impl: str,
         **opts: Any) -> tuple[jax.Array, ...]:
    """Applies op ``name`` to 2-D operands; returns its results as a tuple."""
    if impl == "cuda" and n > 1:
        _extension.require_cuda_ops(name, OPS[name].ffi_target)
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items()))
    with jax.named_scope(f"jax_flashoverlap.{name}"):
        return tuple(_PRIMITIVES[name].bind(*args, axis_name=axis_name, n=n, impl=impl,
                                            opts=frozen))
