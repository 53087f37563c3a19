"""Device time per kernel category, read from a jax.profiler trace.

    python benchmarks/kernel_times.py ops [--ops ...] [--shapes MxKxN ...] [--json F]
    python benchmarks/kernel_times.py trace DIR [--iterations N]

``ops``: for each collective matmul and shape (per device, as in
``collective_matmul.py``), traces a loop of impl="cuda" calls and a loop of
XLA's dot on the same per-device work, and reports per call and per
category the kernel time on the first GPU. The GEMM row answers the issue's
question "does the GEMM inside the fused op run at the stand-alone GEMM's
throughput" (the fused op's GEMM kernels, summed, against the dot's; copy
engines and peer waits run beside them). For all_gather_matmul and
matmul_reduce_scatter a third loop runs XLA's dot on the fused op's own row
blocks, one after another and without transfers: if the fused op's GEMMs
match it, the smaller problems cost the throughput; if they are slower, the
transfers beside them do. Wall time is the timing protocol's business
(``collective_matmul.py``); a trace only splits device time.

``trace``: the same table for a trace written elsewhere, e.g. by
``jax-flashoverlap-train --profile DIR``.

Reads the Trace Event JSON that the profiler writes next to its xplane file
(``<host>.trace.json.gz``): GPUs are processes named ``/device:GPU:i``, their
kernels and copies events on threads named ``Stream #...``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

# First match wins; names are the kernels' (demangled) names as CUPTI gives them.
CATEGORIES = (
    ("jfo", re.compile(r"\bjfo::|WaitFlagKernel|AddIntoKernel|FillIfFailedKernel|"
                       r"AllReduceKernel|HierarchicalAllReduceKernel")),
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"cudnn|fmha|flash|attention", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|dot_general", re.I)),
    ("copy", re.compile(r"memcpy|memset", re.I)),
)
WAIT_KERNEL = re.compile(r"WaitFlagKernel")  # spins until a peer's flag arrives
DEVICE_PROCESS = re.compile(r"^/device:GPU:(\d+)")
KERNEL_THREAD = re.compile(r"^Stream\b")


def category(name: str) -> str:
    """The category of a kernel name: jfo, nccl, attention, gemm, copy or other."""
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def load_events(path: str | Path) -> list[dict]:
    """The events of a trace in the Trace Event JSON format: a
    ``<host>.trace.json.gz`` or ``perfetto_trace.json.gz`` file, or a
    directory holding them (the newest)."""
    path = Path(path)
    if path.is_dir():
        found = sorted([*path.rglob("*.trace.json.gz"), *path.rglob("perfetto_trace.json.gz")],
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"no *.trace.json.gz under {path}: not a jax.profiler "
                                    "log directory")
        path = found[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_kernels(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """GPU index -> [(kernel or copy name, start, duration)] on its stream
    threads, in µs."""
    devices, kernel_threads = {}, set()
    for e in events:
        if e.get("ph") != "M":
            continue
        name = e.get("args", {}).get("name", "")
        if e.get("name") == "process_name" and (m := DEVICE_PROCESS.match(name)):
            devices[e["pid"]] = int(m.group(1))
        elif e.get("name") == "thread_name" and KERNEL_THREAD.match(name):
            kernel_threads.add((e["pid"], e["tid"]))
    out: dict[int, list[tuple[str, float, float]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices and (e["pid"], e.get("tid")) in \
                kernel_threads:
            out[devices[e["pid"]]].append(
                (e["name"], float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
    return dict(out)


def occupancy(kernels: list[tuple[str, float, float]], iterations: int = 1) -> dict:
    """Per iteration: the span from the first kernel's start to the last one's
    end, and the part of it some kernel or copy other than a peer-wait kernel
    runs (a wait kernel only spins): span minus busy is where the GPU idles,
    e.g. while the host launches."""
    work = sorted((ts, ts + dur) for name, ts, dur in kernels if not WAIT_KERNEL.search(name))
    if not work:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_fraction": 0.0}
    busy, end = 0.0, work[0][0]
    for lo, hi in work:
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    span = max(ts + dur for _, ts, dur in kernels) - min(ts for _, ts, _ in kernels)
    return {"span_us": span / iterations, "busy_us": busy / iterations,
            "idle_fraction": 1.0 - busy / span if span else 0.0}


def summarize(kernels: list[tuple[str, float, float]], iterations: int = 1,
              top: int = 3) -> dict[str, dict]:
    """Per category: µs and kernel count per iteration, and the ``top`` kernels."""
    by_cat: dict[str, dict] = {}
    for name, _, dur in kernels:
        c = by_cat.setdefault(category(name), {"us": 0.0, "count": 0,
                                                "names": collections.Counter()})
        c["us"] += dur / iterations
        c["count"] += 1
        c["names"][name] += dur / iterations
    for c in by_cat.values():
        c["count"] = c["count"] / iterations
        c["top"] = [(n[:80], round(us, 2)) for n, us in c.pop("names").most_common(top)]
    return by_cat


def trace_loop(fn, args, log_dir: str | Path) -> list[dict]:
    """Runs ``fn(*args)`` once untraced (compile, autotune), once traced."""
    import jax

    fn(*args).block_until_ready()
    with jax.profiler.trace(str(log_dir)):
        fn(*args).block_until_ready()
    return load_events(log_dir)


def _collective_matmul():
    """The sibling benchmark (its operands, impl variants and overrides)."""
    path = Path(__file__).with_name("collective_matmul.py")
    spec = importlib.util.spec_from_file_location("collective_matmul", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dot_in_row_blocks(blocks: int):
    """``x @ w`` as XLA dots on ``blocks`` equal row blocks of x, one after
    another: an optimization barrier orders each block after the previous
    dot, so XLA cannot merge them back into one GEMM."""
    import jax.numpy as jnp
    from jax import lax

    def fn(x, w):
        outs = []
        for xb in jnp.split(x, blocks):
            if outs:
                outs[-1], xb = lax.optimization_barrier((outs[-1], xb))
            outs.append(jnp.dot(xb, w))
        return jnp.concatenate(outs)
    return fn


def gemm_blocks(op: str, fn, overrides: dict, shapes_op, n: int) -> int | None:
    """Equal row blocks of the fused op's GEMMs, from ``collective_matmul._op_fn``'s
    function and dispatch overrides: n blocks of ``chunks`` chunks each for
    impl="cuda" all_gather_matmul and matmul_reduce_scatter. None for other
    ops and impls, and for the "add_after" fold (its own block is one GEMM,
    the others chunked)."""
    from jax_flashoverlap import cuda_policy

    fold = overrides.get("REDUCE_SCATTER_FOLD", cuda_policy.REDUCE_SCATTER_FOLD)
    if (op not in ("all_gather_matmul", "matmul_reduce_scatter")
            or fn.keywords.get("impl") != "cuda"
            or (op == "matmul_reduce_scatter" and fold == "add_after")):
        return None
    chunks = fn.keywords.get("chunks")
    if chunks is None:
        chunks = cuda_policy.collective_matmul_chunks(op, shapes_op, n)
    return n * chunks


def run_ops(ops, shapes, iterations: int, devices: int | None = None,
            impl: str = "cuda") -> list[dict]:
    """Kernel times of ``impl`` and of XLA's dot per (op, shape); see the module doc."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_flashoverlap.benchmarking import first_devices_mesh, looped

    cm = _collective_matmul()
    mesh = first_devices_mesh(devices)
    n = mesh.size
    put = cm.random_operands(mesh)

    rows = []
    for (m, k, cols) in shapes:
        for op in ops:
            shapes_op, _, gemm_shapes = cm._operands(op, n, m, k, cols)
            fn, overrides = cm._op_fn(op, impl)
            runs = {impl: (fn, [put(s) for s in shapes_op]),
                    "gemm_alone": (lambda x, w: jnp.dot(x, w), [put(s) for s in gemm_shapes])}
            blocks = gemm_blocks(op, fn, overrides, shapes_op, n)
            if blocks is not None and gemm_shapes[0][0] % blocks == 0:
                runs["gemm_in_blocks"] = (dot_in_row_blocks(blocks),
                                          [put(s) for s in gemm_shapes])
            row = {"op": op, "shape": [m, k, cols], "iterations": iterations}
            for label, (f, args) in runs.items():
                loop = looped(f, mesh, (P("tp"),) * len(args), iterations)
                with cm._policy_overrides(overrides), tempfile.TemporaryDirectory() as tmp:
                    kernels = device_kernels(trace_loop(loop, args, tmp))
                if not kernels:
                    raise SystemExit("the trace holds no GPU kernels (no GPU, or no CUPTI)")
                row[label] = summarize(kernels[min(kernels)], iterations)
            fused = row[impl].get("gemm", {}).get("us", 0.0)
            alone = row["gemm_alone"].get("gemm", {}).get("us", 0.0)
            row["gemm_throughput_vs_alone"] = alone / fused if fused else None
            in_blocks = row.get("gemm_in_blocks", {}).get("gemm", {}).get("us")
            row["gemm_blocks"] = blocks if in_blocks is not None else None
            rows.append(row)
            print(f"{op:22s} {m}x{k}x{cols:<6d} GEMM kernels {fused:9.1f} us in the fused op, "
                  f"{alone:9.1f} alone: {row['gemm_throughput_vs_alone'] or 0:.3f} of the "
                  "stand-alone throughput"
                  + (f"; XLA's dot in its {blocks} row blocks, no transfers: {in_blocks:.1f} us"
                     if in_blocks is not None else ""), flush=True)
    return rows


def table(summary: dict[str, dict]) -> str:
    lines = ["| category | µs per iteration | kernels per iteration | top kernels (µs) |",
             "|---|---|---|---|"]
    total = sum(c["us"] for c in summary.values())
    for label, c in sorted(summary.items(), key=lambda kv: -kv[1]["us"]):
        top = "; ".join(f"{n} ({us})" for n, us in c["top"])
        lines.append(f"| {label} | {c['us']:.1f} | {c['count']:g} | {top} |")
    lines.append(f"| all (summed, streams overlap) | {total:.1f} | | |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    ops = sub.add_parser("ops", help="the collective matmuls against XLA's dot")
    ops.add_argument("--ops", nargs="+", default=["all_gather_matmul", "matmul_reduce_scatter",
                                                  "matmul_all_reduce"])
    ops.add_argument("--shapes", nargs="+", default=["1024x4096x4096", "2048x8192x7168",
                                                     "4096x8192x4096"])
    ops.add_argument("--iterations", type=int, default=10)
    ops.add_argument("--devices", type=int, default=None)
    ops.add_argument("--impl", default="cuda", help="an impl of collective_matmul.py")
    ops.add_argument("--json")
    tr = sub.add_parser("trace", help="summarise an existing trace")
    tr.add_argument("path", help="the profiler's log dir or a perfetto_trace.json.gz")
    tr.add_argument("--iterations", type=int, default=1, help="divide times by this")
    tr.add_argument("--top", type=int, default=3, help="kernels named per category")
    args = parser.parse_args(argv)
    if args.mode == "trace":
        per_device = device_kernels(load_events(args.path))
        if not per_device:
            raise SystemExit(f"no GPU kernels in {args.path}")
        for device, kernels in sorted(per_device.items()):
            o = occupancy(kernels, args.iterations)
            print(f"\nGPU {device}: span {o['span_us']:.1f} µs per iteration, busy "
                  f"{o['busy_us']:.1f} (kernels and copies other than peer waits), idle "
                  f"{o['idle_fraction']:.1%}\n"
                  + table(summarize(kernels, args.iterations, args.top)))
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    rows = run_ops(args.ops, shapes, args.iterations, args.devices, args.impl)
    if args.json:
        from jax_flashoverlap.benchmarking import gemm_autotune_setting, provenance

        options = {k: v for k, v in vars(args).items() if k != "json"}
        meta = dict(provenance(options), impl=args.impl, iterations=args.iterations,
                    gemm_autotune=gemm_autotune_setting())
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for r in rows:
        print(f"\n{r['op']} {'×'.join(map(str, r['shape']))}, impl={args.impl!r}, GPU 0\n"
              + table(r[args.impl]) + "\n\nXLA's dot alone\n" + table(r["gemm_alone"]))
        if "gemm_in_blocks" in r:
            print(f"\nXLA's dot in {r['gemm_blocks']} row blocks\n" + table(r["gemm_in_blocks"]))


if __name__ == "__main__":
    sys.exit(main())
