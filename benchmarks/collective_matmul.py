"""Benchmark: the collective matmuls, every implementation, in-graph (benchmarking.py).

    python benchmarks/collective_matmul.py --json out.json [--plot out.png]

For each op and per-device shape (m_shard x K x n_shard) it times, in one
process: impl "cuda", "cuda_fused" (matmul_all_reduce's fused kernel, which
impl="cuda" replaces by dot + all-reduce for small results), "xla", "auto",
"decomposed" (the ring schedule) and "decomposed_bidirectional" (AllGather
and ReduceScatter only), the same dot
alone ("gemm") and the collective alone ("comm"); XLA's windowed einsum
("xla_windowed") runs in a child process because its flags are read once at
start-up. Every implementation's result is checked against "xla" before it is
timed. ``--chunks 2 4`` adds impl="cuda" with those chunk counts (the data
for choosing it automatically); ``--add-after`` adds matmul_reduce_scatter
with the partials added after the own GEMM instead of fed to it;
``--part-aligns 8 256`` adds the fused matmul_all_reduce with those row
alignments of each rank's part of a chunk.
``--devices N`` runs on the first N local GPUs (TP=N); the CUDA kernels
always send directly to every peer (NVLink/NVSwitch), so the ring and
bidirectional variants are schedules of the pure-JAX path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys

SHAPES = [(1024, 4096, 4096), (2048, 8192, 7168), (2048, 8192, 14336),
          (4096, 8192, 4096), (8192, 8192, 14336), (128, 8192, 8192)]
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
IMPLS = ("cuda", "cuda_fused", "xla", "auto", "decomposed", "decomposed_bidirectional")
WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true")


def _operands(op, n, m, k, cols):
    """Per-device operand shapes and the comm-only and gemm-only equivalents."""
    if op == "all_gather_matmul":
        return ((m, k), (k, cols)), ("all_gather", (m, k)), ((n * m, k), (k, cols))
    if op == "matmul_reduce_scatter":
        return ((n * m, k), (k, cols)), ("psum_scatter", (n * m, cols)), ((n * m, k), (k, cols))
    return ((m, k), (k, cols)), ("psum", (m, cols)), ((m, k), (k, cols))


# Rows that run impl="cuda" with a dispatch setting changed, "<prefix>" or
# "<prefix>_chunksC": prefix -> (the ops it applies to, the overrides).
VARIANTS = {
    "cuda_add_after": (("matmul_reduce_scatter",), {"REDUCE_SCATTER_FOLD": "add_after"}),
    "cuda_xla_waits": (("all_gather_matmul", "matmul_reduce_scatter"),
                       {"PEER_WAIT_STREAM": "xla"}),
    "cuda_tile_signalled": (("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"),
                            {"ALL_GATHER_GEMM": "tile_signalled",
                             "REDUCE_SCATTER_GEMM": "tile_signalled",
                             "MATMUL_ALL_REDUCE_GEMM": "tile_signalled"}),
}


def _op_fn(op, impl):
    """(per-device function, dispatch overrides) of ``impl``, an entry of
    IMPLS, "cuda_chunksC", or a VARIANTS prefix with an optional "_chunksC";
    None where it does not apply.

    The overrides patch :mod:`jax_flashoverlap.dispatch` while the function is
    lowered: matmul_all_reduce must run its fused kernel, which impl="cuda"
    replaces by dot + all-reduce for small results ("cuda_fused" and the
    chunked rows time the fused kernel; "cuda" times what users get);
    "cuda_add_after" runs matmul_reduce_scatter's other fold,
    "cuda_tile_signalled" the ops' tile-signalled CUTLASS GEMMs (the
    fused kernel's, for matmul_all_reduce),
    "cuda_xla_waits" the peer waits on XLA's stream and "cuda_part_alignA"
    the fused matmul_all_reduce with parts aligned to A rows.
    """
    import jax_flashoverlap as jfo

    call = functools.partial(getattr(jfo, op), axis_name="tp")
    fused = {"MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES": -1} if op == "matmul_all_reduce" else {}
    if impl == "cuda_fused":
        if op != "matmul_all_reduce":
            return None
        return functools.partial(call, impl="cuda"), fused
    overrides = {}
    for prefix, (variant_ops, variant_overrides) in VARIANTS.items():
        if impl.startswith(prefix):
            if op not in variant_ops:
                return None
            overrides = dict(variant_overrides)
            impl = "cuda" + impl[len(prefix):]  # "cuda" or "cuda_chunksC"
            break
    if impl.startswith("cuda_part_align"):
        if op != "matmul_all_reduce":
            return None
        align = int(impl[len("cuda_part_align"):])
        return (functools.partial(call, impl="cuda"),
                {**fused, "MATMUL_ALL_REDUCE_PART_ALIGN": align})
    if impl.startswith("cuda_chunks"):
        chunks = int(impl[len("cuda_chunks"):])
        return functools.partial(call, impl="cuda", chunks=chunks), {**fused, **overrides}
    if impl == "decomposed_bidirectional":
        if op == "matmul_all_reduce":
            return None
        return functools.partial(call, impl="decomposed", topology="bidirectional"), {}
    # A variant of matmul_all_reduce changes its fused kernel: time that one.
    return functools.partial(call, impl=impl), {**fused, **overrides} if overrides else {}


@contextlib.contextmanager
def _policy_overrides(overrides):
    """Patches jax_flashoverlap.cuda_policy (read at lowering: new jits only)."""
    from jax_flashoverlap import cuda_policy

    saved = {name: getattr(cuda_policy, name) for name in overrides}
    for name, value in overrides.items():
        setattr(cuda_policy, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cuda_policy, name, value)


def random_operands(mesh, seed=0):
    """``put(shape)``: fresh standard-normal bf16 data of per-device ``shape``
    on every device of ``mesh``, sharded along dim 0 over its "tp" axis."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)

    def put(shape):
        data = rng.standard_normal((mesh.size * shape[0], *shape[1:]), dtype=np.float32)
        return jax.device_put(jnp.asarray(data, jnp.bfloat16), NamedSharding(mesh, P("tp")))
    return put


def _reference(op, n, x, w):
    """The outputs of every rank, concatenated as out_specs=P("tp") gives
    them, from the global operands by plain float32 einsums at the highest
    precision: no collective of XLA's or ours. Rank d holds x's and w's d-th
    row blocks."""
    import jax
    import jax.numpy as jnp

    def outputs(x, w):
        wb = w.reshape(n, -1, w.shape[-1]).astype(jnp.float32)
        xf = x.astype(jnp.float32)
        dot = jax.lax.Precision.HIGHEST
        if op == "all_gather_matmul":  # rank d: all of x @ its w block
            return jnp.einsum("ik,dkc->dic", xf, wb, precision=dot).reshape(-1, w.shape[-1])
        summed = jnp.einsum("dik,dkc->ic", xf.reshape(n, -1, x.shape[-1]), wb, precision=dot)
        if op == "matmul_reduce_scatter":  # rank d: row block d of the sum
            return summed
        return jnp.tile(summed, (n, 1))  # matmul_all_reduce: the sum on every rank

    return jax.jit(outputs)(x, w)


def run(ops, shapes, impls, reps, devices=None, check=True, interleaved=False):
    """Rows of per-op times (``us``, ``min_us``, ``max_us``), every impl checked first.

    With ``interleaved``, the impls that change no dispatch setting are timed
    by one :func:`~jax_flashoverlap.benchmarking.time_interleaved` call per op
    and shape, and each of their rows also has ``vs_xla``: the median over
    repetitions of its time over xla's in the same repetition.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jax_flashoverlap.benchmarking import (
        Timing,
        first_devices_mesh,
        median_ratio,
        time_interleaved,
        time_per_op,
    )

    mesh = first_devices_mesh(devices)
    n = mesh.size
    put = random_operands(mesh)

    def loop_lengths(expected_us):
        return dict(k1=2, k2=int(min(50, max(6, 30_000 / max(expected_us, 1)))), reps=reps)

    def timed(fn, args, expected_us):
        return time_per_op(fn, args, mesh=mesh, in_specs=(P("tp"),) * len(args),
                           **loop_lengths(expected_us))

    def row(op, shape, impl, t, **extra):
        return dict(op=op, shape=list(shape), impl=impl, us=t.median_us, min_us=t.min_s * 1e6,
                    max_us=t.max_s * 1e6, **extra)

    rows = []
    for (m, k, cols) in shapes:
        gemm_us = 2 * n * m * k * cols / 700e12 * 1e6  # a guess, only sizes the loops
        for op in ops:
            shapes_op, (comm_name, comm_shape), gemm_shapes = _operands(op, n, m, k, cols)
            args = [put(s) for s in shapes_op]
            reference = (np.asarray(_reference(op, n, *args), np.float32) if check else None)
            together = {}  # impl -> fn, timed interleaved after the loop
            for impl in impls:
                picked = _op_fn(op, impl)
                if picked is None:
                    continue
                fn, overrides = picked
                with _policy_overrides(overrides):
                    if check:
                        run_once = jax.jit(jax.shard_map(fn, mesh=mesh,
                                                         in_specs=(P("tp"),) * 2,
                                                         out_specs=P("tp"), check_vma=False))
                        try:
                            out = np.asarray(run_once(*args).astype(jnp.float32))
                        except NotImplementedError as e:
                            print(f"skip {op} {impl}: {e}", flush=True)
                            continue
                        err = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
                        if not err < 2e-2:
                            raise SystemExit(f"{op} {impl} {m}x{k}x{cols}: rel err {err:.3g}")
                    if interleaved and not overrides:
                        together[impl] = fn
                        continue
                    t = timed(fn, args, gemm_us)
                rows.append(row(op, (m, k, cols), impl, t))
                print(f"{op:22s} {m}x{k}x{cols:<6d} {impl:13s} {t.median_us:9.1f} us",
                      flush=True)
            if together:
                est = time_interleaved(together, args, mesh=mesh,
                                       in_specs=(P("tp"),) * len(args), **loop_lengths(gemm_us))
                for impl, times in est.items():
                    extra = {"vs_xla": median_ratio(times, est["xla"])} if "xla" in est else {}
                    rows.append(row(op, (m, k, cols), impl, Timing.of(times), **extra))
                    print(f"{op:22s} {m}x{k}x{cols:<6d} {impl:13s} "
                          f"{rows[-1]['us']:9.1f} us  {extra.get('vs_xla', float('nan')):.3f}x xla",
                          flush=True)
            if "xla" not in impls:
                continue
            g = [put(s) for s in gemm_shapes]
            gemm = timed(lambda x, w: jnp.dot(x, w), g, gemm_us)
            collective = {"all_gather": lambda a: lax.all_gather(a, "tp", tiled=True),
                          "psum_scatter": lambda a: lax.psum_scatter(a, "tp", tiled=True),
                          "psum": lambda a: lax.psum(a, "tp")}[comm_name]
            comm = timed(collective, [put(comm_shape)], gemm_us / 4)
            for name, t in (("gemm", gemm), ("comm", comm)):
                rows.append(row(op, (m, k, cols), name, t))
                print(f"{op:22s} {m}x{k}x{cols:<6d} {name:13s} {t.median_us:9.1f} us",
                      flush=True)
    return rows


def _windowed(args) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {WINDOWED_FLAGS}")
    out = subprocess.run([sys.executable, __file__, "--child-windowed", "--reps", str(args.reps),
                          "--devices", str(args.devices or 0), "--ops", *args.ops,
                          "--shapes", *args.shapes],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:  # keep the other rows: report, write no xla_windowed rows
        print(f"xla_windowed child failed (rc={out.returncode}):\n{out.stderr[-3000:]}",
              file=sys.stderr)
        return []
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    for r in rows:
        r["impl"] = "xla_windowed"
    return rows


def table(rows) -> str:
    by, vs_xla = {}, {}
    for r in rows:
        by.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["us"]
        if "vs_xla" in r:
            vs_xla.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["vs_xla"]
    paired = [c for c in ("cuda", "auto") if any(c in v for v in vs_xla.values())]
    present = {r["impl"] for r in rows}
    chunked = sorted(c for c in present if c.startswith("cuda_chunks"))
    variants = sorted(c for c in present if c.startswith(tuple(VARIANTS)))
    cols = [c for c in ("cuda", "cuda_fused", *chunked, *variants, "auto", "xla",
                        "xla_windowed", "decomposed", "decomposed_bidirectional", "gemm", "comm")
            if c in present]
    lines = ["| op | shape | " + " | ".join(f"{c} µs" for c in cols) + " | cuda/gemm | xla/cuda |"
             + "".join(f" {c}/xla interleaved |" for c in paired),
             "|---|---|" + "---|" * (len(cols) + 2 + len(paired))]
    def fmt(v):
        return f"{v:.1f}" if v is not None else "–"

    def ratio(t, a, b):
        return f"{t[a] / t[b]:.2f}" if a in t and b in t else "–"

    for (op, shape), t in by.items():
        lines.append(f"| {op} | {'×'.join(map(str, shape))} | "
                     + " | ".join(fmt(t.get(c)) for c in cols)
                     + f" | {ratio(t, 'cuda', 'gemm')} | {ratio(t, 'xla', 'cuda')} |"
                     + "".join(f" {vs_xla.get((op, shape), {}).get(c, float('nan')):.3f} |"
                               for c in paired))
    return "\n".join(lines)


def plot(rows, path):
    """Bars of each implementation's time over the GEMM alone (1.0 = no overhead)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ["cuda", "xla", "xla_windowed", "decomposed"]
    fig, axes = plt.subplots(1, len(OPS), figsize=(6 * len(OPS), 4.5), sharey=True)
    for ax, op in zip(axes, OPS):
        times = {}
        for r in rows:
            if r["op"] == op:
                times.setdefault(tuple(r["shape"]), {})[r["impl"]] = r["us"]
        shapes = [s for s, t in times.items() if "gemm" in t]
        for i, impl in enumerate(impls):
            vals = [times[s].get(impl, 0) / times[s]["gemm"] for s in shapes]
            ax.bar([j + 0.2 * i for j in range(len(shapes))], vals, 0.2, label=impl)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([j + 0.3 for j in range(len(shapes))],
                      ["×".join(map(str, s)) for s in shapes], rotation=30, fontsize=7)
        ax.set_title(op)
    axes[0].set_ylabel("time / GEMM alone (lower is better)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=list(OPS))
    parser.add_argument("--shapes", nargs="+", default=["x".join(map(str, s)) for s in SHAPES])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--chunks", nargs="+", type=int, default=[],
                        help="also time impl='cuda' with each of these chunk counts "
                             "(rows 'cuda_chunksC'; the default is the op's own)")
    parser.add_argument("--add-after", action="store_true",
                        help="also time matmul_reduce_scatter folding the partials in "
                             "after its own GEMM (rows 'cuda_add_after', with each --chunks)")
    parser.add_argument("--xla-waits", action="store_true",
                        help="also time the fused all_gather_matmul and matmul_reduce_scatter "
                             "waiting for peers on XLA's stream (rows 'cuda_xla_waits', with "
                             "each --chunks)")
    parser.add_argument("--tile-signalled", action="store_true",
                        help="also time each op with its tile-signalled CUTLASS GEMM (row "
                             "'cuda_tile_signalled'; matmul_all_reduce's fused kernel; needs "
                             "the CUTLASS build, all_gather_matmul 2 devices)")
    parser.add_argument("--part-aligns", nargs="+", type=int, default=[],
                        help="also time the fused matmul_all_reduce with each of these "
                             "cuda_policy.MATMUL_ALL_REDUCE_PART_ALIGN (rows 'cuda_part_alignA')")
    parser.add_argument("--devices", type=int, default=None,
                        help="use the first N local devices (default: all)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--interleaved", action="store_true",
                        help="time the impls of each op and shape in turn, one repetition "
                             "each at a time, and give each its median ratio to xla "
                             "(column 'vs xla'); variants with changed settings are timed "
                             "alone as before")
    parser.add_argument("--no-windowed", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--child-windowed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if args.child_windowed:
        rows = run(args.ops, shapes, ["xla"], args.reps, args.devices or None)
        print(json.dumps([r for r in rows if r["impl"] == "xla"]))
        return
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
    impls = args.impls + [f"cuda_chunks{c}" for c in args.chunks]
    if args.add_after:
        impls += ["cuda_add_after"] + [f"cuda_add_after_chunks{c}" for c in args.chunks]
    if args.xla_waits:
        impls += ["cuda_xla_waits"] + [f"cuda_xla_waits_chunks{c}" for c in args.chunks]
    if args.tile_signalled:
        impls.append("cuda_tile_signalled")
    impls += [f"cuda_part_align{a}" for a in args.part_aligns]
    rows = run(args.ops, shapes, impls, args.reps, args.devices, interleaved=args.interleaved)
    if not args.no_windowed:
        rows += _windowed(args)
    import jax

    from jax_flashoverlap.benchmarking import gemm_autotune_setting, provenance
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "child_windowed")}
    meta = dict(provenance(settings), devices=len(jax.devices()[:args.devices]),
                dtype="bfloat16", gemm_autotune=gemm_autotune_setting())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    print(table(rows))


if __name__ == "__main__":
    main()
