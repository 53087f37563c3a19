"""Measures every implementation of every op on this machine, for impl="auto".

    jax-flashoverlap-tune                          # the default shape grid
    jax-flashoverlap-tune --model transformer --size 1b --mesh 1x2

For each op, shape and implementation ("xla", "decomposed", and "cuda" on
NVIDIA GPUs with the CUDA build) it checks the result against "xla", then
times it with the project's in-graph protocol
(:func:`jax_flashoverlap.benchmarking.time_per_op`), over a tensor axis of
``--mesh``'s tensor size (or ``--axis-size``; default all local devices).
"auto" looks entries up by that axis size, so tune at the size the model
runs. The entries go into the tuning cache
(:func:`jax_flashoverlap.tuning.cache_path`), merged with what is there,
and "auto" follows them from the next compilation on
(:func:`jax_flashoverlap.dispatch.resolve`). ``--model`` adds the shapes of
that model's training step and decode step. The run stops after
``--budget-s`` seconds and keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _extension, benchmarking, cuda_policy, dispatch, tuning
from .devices import ensure_cpu_devices
from .flags import HelpFormatter, parse_mesh_shape

__all__ = ["main", "parse_args", "default_grid", "model_grid", "run"]

OPS = dispatch.AUTO_OPS
# (rows per rank, k, n_out) of the collective matmuls, and all-reduce bytes
# per rank: on GPUs the sizes of tensor-parallel layers, on CPUs small enough
# to tune in seconds.
_GPU_GRID = ([(r, k, k) for r in (128, 512, 2048, 8192) for k in (4096, 8192)],
             [4 << 10, 64 << 10, 1 << 20, 16 << 20])
_CPU_GRID = ([(r, k, k) for r in (32, 256) for k in (128, 512)], [4 << 10, 256 << 10])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jax-flashoverlap-tune",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                        help="the ops to measure")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="operand dtype (default: bfloat16 on GPUs, float32 on CPUs)")
    parser.add_argument("--axis-size", type=int, default=None,
                        help="ranks of the tensor axis (default: --mesh's tensor size, else "
                             "all local devices)")
    parser.add_argument("--model", choices=("transformer", "mamba"), default=None,
                        help="also tune this model's shapes (with --size, --mesh)")
    # The models' sizes (models.config.SIZES), spelled here: --help needs no flax.
    parser.add_argument("--size", default=None, choices=("tiny", "small", "1b"),
                        help="with --model, its size (default: 1b)")
    parser.add_argument("--mesh", type=parse_mesh_shape, default=None, metavar="DATAxTENSOR",
                        help="the mesh the model runs on: its tensor size is the axis size "
                             "tuned (default: 1 x the axis size)")
    parser.add_argument("--seq", type=int, default=4096, help="the model's training sequence")
    parser.add_argument("--batch", type=int, default=1,
                        help="the model's rows per data rank (training and decoding)")
    parser.add_argument("--no-grid", action="store_true", help="only the --model shapes")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed runs of each shape and impl (their median counts)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop measuring after this many seconds, checked between "
                             "shapes (what ran is kept)")
    parser.add_argument("--verify", action="store_true",
                        help="then time impl='auto' on every tuned shape, against the "
                             "fastest impl, in this process")
    parser.add_argument("--output", default=None,
                        help="the cache file to merge into (default: the user's tuning cache)")
    args = parser.parse_args(argv)
    if args.axis_size is not None and args.axis_size < 2:
        parser.error(f"--axis-size must be at least 2 (one rank runs the local dot), "
                     f"got {args.axis_size}")
    if args.mesh and args.axis_size is not None and args.axis_size != args.mesh[1]:
        parser.error(f"--axis-size {args.axis_size} and --mesh {args.mesh[0]}x{args.mesh[1]} "
                     f"disagree: the tensor axis tuned is the mesh's; drop --axis-size")
    if args.mesh and args.mesh[1] < 2:
        parser.error(f"--mesh {args.mesh[0]}x{args.mesh[1]}: the tensor size must be at "
                     f"least 2 (one rank runs the local dot)")
    if args.no_grid and not args.model:
        parser.error("--no-grid leaves nothing to tune without --model")
    if args.size is not None and not args.model:
        parser.error("--size applies with --model")
    args.size = args.size or "1b"
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    return args


Case = tuple[str, tuple[int, ...]]  # (op, (rows, k, n_out)) or ("all_reduce", (bytes,))


def default_grid(on_gpu: bool) -> list[Case]:
    matmuls, messages = _GPU_GRID if on_gpu else _CPU_GRID
    return ([(op, s) for op in OPS if op != "all_reduce" for s in matmuls]
            + [("all_reduce", (b,)) for b in messages])


def model_grid(model: str, size: str, tp: int, seq: int, batch: int,
               itemsize: int) -> list[Case]:
    """The op shapes of ``model``'s sequence-parallel training step (sequence
    ``seq``) and its decode step (one token per row), per tensor rank."""
    from flax import nnx

    from ..models import MODELS
    from ..nn import ColumnParallelLinear, RowParallelLinear

    config_cls, model_cls = MODELS[model]
    config = config_cls.preset(size)
    mesh = jax.sharding.AbstractMesh((1, tp), (config.sharding.data, config.sharding.tensor))
    with jax.sharding.use_abstract_mesh(mesh):
        abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    cases = set()
    for _, node in nnx.iter_graph(abstract):
        if isinstance(node, ColumnParallelLinear):
            k, n_out = node.kernel.shape
            cases.add(("all_gather_matmul", (seq // tp * batch, k, n_out // tp)))
        elif isinstance(node, RowParallelLinear):
            k, n_out = node.kernel.shape
            cases.add(("matmul_reduce_scatter", (seq // tp * batch, k // tp, n_out)))
            cases.add(("matmul_all_reduce", (batch, k // tp, n_out)))
            cases.add(("all_reduce", (batch * n_out * itemsize,)))
    return sorted(cases)


# Per op: the in_specs of its operands and the out_spec of its result, over
# the tensor axis.
_SPECS = {
    "all_gather_matmul": ((P("tensor"), P(None, "tensor")), P(None, "tensor")),
    "matmul_reduce_scatter": ((P(None, "tensor"), P("tensor")), P("tensor")),
    "matmul_all_reduce": ((P(None, "tensor"), P("tensor")), P()),
    "all_reduce": ((P("tensor"),), P()),
}


def _operands(op: str, shape: tuple[int, ...], n: int, dtype, rng) -> tuple[list, tuple]:
    """Random global operands whose per-rank shapes are those of ``shape``
    (:func:`_per_rank_shapes`), and their in_specs."""
    specs = _SPECS[op][0]
    shapes = [tuple(d * n if i < len(spec) and spec[i] else d for i, d in enumerate(s))
              for s, spec in zip(_per_rank_shapes(op, shape, n, dtype), specs)]
    return [jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in shapes], specs


def _per_rank(op: str, impl: str):
    """The op on one rank's operands, as _per_rank_shapes gives them."""
    import jax_flashoverlap

    fn = functools.partial(getattr(jax_flashoverlap, op), axis_name="tensor", impl=impl)
    return (lambda x: fn(x[0])) if op == "all_reduce" else fn


def run(args: argparse.Namespace, out=None) -> tuning.Table:
    """Measures, merges into the cache file, and returns the new entries
    (progress and results on ``out``, default stdout)."""
    out = out or sys.stdout
    on_gpu = jax.default_backend() == "gpu"
    devices = jax.devices()
    n = args.axis_size or (args.mesh[1] if args.mesh else len(devices))
    if n < 2:
        raise SystemExit("jax-flashoverlap-tune: one device: nothing to tune (an axis of one "
                         "rank runs the local dot)")
    if n > len(devices):
        raise SystemExit(f"jax-flashoverlap-tune: --axis-size {n}, but only {len(devices)} "
                         f"devices here")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    cases = [] if args.no_grid else default_grid(on_gpu)
    if args.model:
        cases += model_grid(args.model, args.size, n, args.seq, args.batch, dtype.itemsize)
    cases = [c for c in dict.fromkeys(cases) if c[0] in args.ops]
    impls = ["xla", "decomposed"] + (["cuda"] if on_gpu and _extension.cuda_ops_available()
                                     else [])
    mesh = benchmarking.first_devices_mesh(n, "tensor")
    kind = devices[0].device_kind
    count = cuda_policy.process_cuda_devices() if on_gpu else len(devices)
    source = f"jax-flashoverlap-tune {datetime.date.today().isoformat()}"
    rng = np.random.default_rng(0)
    entries, start = [], time.perf_counter()
    print(f"Tuning {len(cases)} shapes x {impls} on {kind} x{count}, axis size {n}, "
          f"{dtype.name}", file=out, flush=True)
    for i, (op, shape) in enumerate(cases):
        if i and time.perf_counter() - start > args.budget_s:  # checked between shapes
            print(f"budget of {args.budget_s:.0f} s spent: stopping after {i} of {len(cases)} "
                  f"shapes", file=out)
            break
        args_, specs = _operands(op, shape, n, dtype, rng)
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args_, specs)]
        times, reference = {}, None
        for impl in impls:
            fn = _per_rank(op, impl)
            result = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs,
                                           out_specs=_SPECS[op][1]))(*placed)
            result = np.asarray(result, np.float32)
            if reference is None:
                reference = result
            else:
                _check(op, shape, impl, result, reference, dtype)
            timing = benchmarking.time_per_op(fn, placed, mesh=mesh, in_specs=specs,
                                              k1=2, k2=6, reps=args.reps, warmup=1)
            times[impl] = timing.median_us
        shapes = _per_rank_shapes(op, shape, n, dtype)
        entries.append(tuning.Entry(
            kind, count, n, dtype.name, op, tuning.rows_per_rank(op, shapes, n, dtype.itemsize),
            tuning.size_of(op, shapes), shape, times, source))
        best = min(times, key=times.get)
        print(f"[{i + 1}/{len(cases)}] {op} {'x'.join(map(str, shape))}: "
              + ", ".join(f"{k} {v:.1f} µs" for k, v in times.items()) + f" -> {best}",
              file=out, flush=True)
    new = tuning.Table(entries)
    path = args.output or tuning.cache_path()
    _merge_into(path, new)
    tuning.reload()
    elsewhere = pathlib.Path(path).absolute() != tuning.cache_path().absolute()
    print(f"wrote {len(entries)} entries to {path} in {time.perf_counter() - start:.0f} s"
          + (f" (impl=\"auto\" reads {tuning.cache_path()} only: merge this file there to "
             f"use it)" if elsewhere else ""), file=out)
    if args.verify:
        if elsewhere:
            print(f"verify: \"auto\" reads {tuning.cache_path()}, not {path}: what it picks "
                  f"ignores this run", file=out)
        _verify(entries, mesh, dtype, rng, args.reps, out)
    return new


def _verify(entries, mesh, dtype, rng, reps, out) -> float:
    """Checks impl="auto" on every tuned shape against the fastest impl, and
    returns the worst over shapes of auto's time over the fastest's.

    Where auto compiles to one impl's very program (the optimized HLO, names
    and metadata aside), auto's time is that impl's: the impls are timed in
    turn (benchmarking.time_interleaved) and the ratio is the median of that
    impl's per-repetition times over the fastest's, exactly 1 when auto
    picked the fastest. Else auto is timed among them. The fastest impl is
    the one of least median time. Timing identical programs apart would
    measure only the machine's spread: on 8 CPU devices that share cores
    they came out 0.81 to 1.93 times each other.
    """
    if not entries:
        print("verify: no tuned shapes to verify", file=out)
        return float("nan")
    n = mesh.shape["tensor"]
    worst = 0.0
    for e in entries:
        args_, specs = _operands(e.op, e.shape, n, dtype, rng)
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args_, specs)]
        programs = {impl: _program(e.op, impl, placed, mesh, specs)
                    for impl in ("auto", *e.times_us)}
        runs_as = next((i for i in e.times_us if programs[i] == programs["auto"]), None)
        timed = list(e.times_us) if runs_as else ["auto", *e.times_us]
        t = benchmarking.time_interleaved({impl: _per_rank(e.op, impl) for impl in timed},
                                          placed, mesh=mesh, in_specs=specs, k1=2, k2=6,
                                          reps=reps, warmup=1)
        fastest = min(e.times_us, key=lambda i: statistics.median(t[i]))
        auto = runs_as or "auto"
        ratio = benchmarking.median_ratio(t[auto], t[fastest])
        worst = max(worst, ratio)
        how = f"auto runs {runs_as}'s program" if runs_as else "auto"
        print(f"verify {e.op} {'x'.join(map(str, e.shape))}: {how} "
              f"{statistics.median(t[auto]) * 1e6:.1f} µs, fastest {fastest} "
              f"{statistics.median(t[fastest]) * 1e6:.1f} µs (tuned best "
              f"{min(e.times_us, key=e.times_us.get)}); auto / fastest = {ratio:.3f}",
              file=out, flush=True)
    print(f"verify: auto is at most {100 * (worst - 1):+.1f}% from the fastest impl", file=out)
    return worst


def _program(op, impl, placed, mesh, specs) -> str:
    """The optimized HLO of ``impl``'s timing loop, names aside
    (:func:`benchmarking.comparable_hlo`)."""
    loop = benchmarking.looped(_per_rank(op, impl), mesh, specs, 2)
    return benchmarking.comparable_hlo(loop.lower(*placed).compile())


def _per_rank_shapes(op, shape, n, dtype) -> list[tuple[int, ...]]:
    """The 2-D per-rank shapes the primitive sees (what resolve() looks up)."""
    if op == "all_reduce":
        return [(1, shape[0] // jnp.dtype(dtype).itemsize)]
    rows, k, n_out = shape
    return [(n * rows if op == "matmul_reduce_scatter" else rows, k), (k, n_out)]


def _check(op, shape, impl, got, want, dtype) -> None:
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    if not math.isfinite(err) or err > tol:
        raise SystemExit(f"jax-flashoverlap-tune: {op} {shape} impl={impl} differs from "
                         f"'xla' (relative error {err:.2e}); not tuning on wrong results")


def _merge_into(path, new: tuning.Table) -> None:
    import os

    path = pathlib.Path(path)
    table = tuning.read(path) if path.exists() else tuning.Table()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(table.merged(new).to_json(), f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a file


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ensure_cpu_devices(8)
    run(args)


if __name__ == "__main__":
    main()
