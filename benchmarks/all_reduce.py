"""Benchmark: all-reduce latency against message size (jax_flashoverlap.benchmarking's protocol).

    python benchmarks/all_reduce.py --json out.json --plot out.png

bf16 messages of 4 KiB to 256 MiB per rank (powers of 4, plus 2, 8 and
32 MiB) over the local GPUs (``--devices N``: the first N), in one process:
impl="cuda" with each kernel ("one_shot", "two_shot", and "lamport" up to
``cuda_policy.lamport_max_bytes()``, 2 MiB on 2 GPUs) and the copy engines'
two-shot ("copy_engine", up to a receive slot of the transport), impl="auto" (what users
get by default, at the default workspace unless ``--workspace-mb``) and XLA's
psum ("xla"). Messages the default workspace cannot hold fail for "cuda" and
run psum under "auto". Every implementation's result
is checked against psum before it is timed. "transfer" is no all-reduce:
two dependent ``lax.ppermute`` steps to the next rank, each moving the
(n - 1) / n of the message a two-shot's reduce-scatter or all-gather sends
per GPU (checked against the input two ranks back): NCCL's point-to-point
moving a two-shot's NVLink traffic. On 2 H200s it is no floor: at 32 MiB it
took 172.5 us, the two-shot 109.7 (all_reduce_transfer_2xh200.json).

Two loop modes (``--modes``), the baseline timed alike in each:
  loop      one op per fori_loop iteration: XLA's host launches every
            iteration, so small messages measure the runtime's per-op cost.
  unrolled  UNROLL ops per iteration: XLA replays the body as one CUDA graph
            where it can (custom calls can be captured, NCCL calls are not by
            default), as in a model layer that holds several ops.
Prints one markdown table per mode last; the plot is latency against size,
log-log, with the NVLink bandwidth floor.
"""

from __future__ import annotations

import argparse
import json
import os

SIZES = sorted({4 << (2 * i) << 10 for i in range(9)}  # 4 KiB, 16 KiB, ..., 256 MiB
               | {2 << 20, 8 << 20, 32 << 20})
MODES = {"loop": 1, "unrolled": 8}  # mode -> ops per loop iteration
IMPLS = {  # name -> keyword arguments of jax_flashoverlap.all_reduce
    "one_shot": {"impl": "cuda", "algorithm": "one_shot"},
    "two_shot": {"impl": "cuda", "algorithm": "two_shot"},
    "lamport": {"impl": "cuda", "algorithm": "lamport"},  # up to lamport_max_bytes()
    "copy_engine": {"impl": "cuda", "algorithm": "copy_engine"},
    "auto": {"impl": "auto"},
    "xla": {"impl": "xla"},
    "transfer": None,  # not jfo.all_reduce: see _transfer
}
SKIPPED: list[dict] = []  # rows that could not run, and why
NVLINK_BYTES_PER_S = 450e9  # per direction: an H200 with NVLink 4, 18 links of 25 GB/s


def floor_us(size: int, n: int) -> float:
    """NVLink bound: each GPU sends 2 (n - 1) / n of the message."""
    return 2 * (n - 1) / n * size / NVLINK_BYTES_PER_S * 1e6


def time_modes(op, args, *, mesh, in_specs, ops, modes, reps):
    """Times ``op`` in each loop mode over about ``ops`` ops; yields (mode, row fields)."""
    from jax_flashoverlap.benchmarking import time_per_op

    for mode in modes:
        unroll = MODES[mode]
        whole = -(-ops // unroll) * unroll  # whole unrolled iterations only
        t = time_per_op(op, args, mesh=mesh, in_specs=in_specs, k1=2 * unroll,
                        k2=whole + 2 * unroll, reps=reps, unroll=unroll)
        yield mode, dict(mode=mode, unroll=unroll, us=t.median_us, min_us=t.min_s * 1e6,
                         max_us=t.max_s * 1e6, reps=t.reps, k2=whole)


def _transfer(x, n: int):
    """A two-shot's NVLink traffic without its sums: ppermute to the next rank
    of (n - 1) / n of ``x``, twice in a row (the second moves the first's
    result). Returns x[:k] of the rank two back."""
    from jax import lax

    perm = [(i, (i + 1) % n) for i in range(n)]
    k = x.shape[0] * (n - 1) // n
    return lax.ppermute(lax.ppermute(x[:k], "tp", perm), "tp", perm)


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def run(sizes, impls, modes, reps, devices=None):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_flashoverlap as jfo
    from jax_flashoverlap import cuda_policy
    from jax_flashoverlap.benchmarking import first_devices_mesh

    mesh = first_devices_mesh(devices)
    n = mesh.size
    rng = np.random.default_rng(0)

    def per_rank(fn):  # every rank's copy of the result, concatenated
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                                     check_vma=False))

    reference = per_rank(lambda x: lax.psum(x.astype(jnp.float32), "tp"))
    rows = []
    for size in sizes:
        elements = size // 2
        data = rng.standard_normal(n * elements, dtype=np.float32)
        x = jax.device_put(jnp.asarray(data, jnp.bfloat16), NamedSharding(mesh, P("tp")))
        want = np.asarray(reference(x))
        # A rough guess, only to give each loop a few milliseconds of work.
        guess_us = 10 + size / 200e9 * 1e6
        k2 = int(min(500, max(10, 20_000 / guess_us)))
        for name in impls:
            if name == "lamport" and size > cuda_policy.lamport_max_bytes():
                continue
            if name == "transfer":
                op = functools.partial(_transfer, n=n)
                moved = data.reshape(n, elements)[:, :elements * (n - 1) // n]
                expect = np.roll(moved, 2, axis=0).reshape(-1)  # bf16 in, bf16 out
                expect = np.asarray(jnp.asarray(expect, jnp.bfloat16).astype(jnp.float32))
            else:
                op = functools.partial(jfo.all_reduce, axis_name="tp", **IMPLS[name])
                expect = want
            try:
                got = np.asarray(per_rank(op)(x).astype(jnp.float32))
            except (jax.errors.JaxRuntimeError, NotImplementedError, ValueError) as e:
                # An op the workspace cannot hold (an error users get too): the
                # row is listed as skipped, with why, in the JSON's meta.
                reason = str(e).splitlines()[0]
                SKIPPED.append({"size_bytes": size, "impl": name, "error": reason})
                print(f"skip {name} at {_label(size)}: {reason}", flush=True)
                continue
            jfo.check_device_errors()  # a timed-out wait is a fault: it stops the run
            err = float(np.linalg.norm(got - expect) / np.linalg.norm(expect))
            if not err < 1e-2:
                raise SystemExit(f"{name} at {_label(size)}: relative error {err:.3g} vs "
                                 + ("the input two ranks back" if name == "transfer" else "psum"))
            for mode, fields in time_modes(op, [x], mesh=mesh, in_specs=(P("tp"),), ops=k2,
                                           modes=modes, reps=reps):
                jfo.check_device_errors()
                rows.append(dict(size_bytes=size, impl=name, **fields))
                print(f"{_label(size):>8s} {mode:8s} {name:9s} {fields['us']:9.2f} us "
                      f"[{fields['min_us']:.2f}, {fields['max_us']:.2f}]", flush=True)
    return rows, n


def times_by_size(rows, mode) -> dict[int, dict[str, float]]:
    """{size: {impl: µs}} of the rows of one loop mode."""
    by = {}
    for r in rows:
        if r["mode"] == mode:
            by.setdefault(r["size_bytes"], {})[r["impl"]] = r["us"]
    return by


def table(rows, n, mode) -> str:
    from jax_flashoverlap import cuda_policy

    by = times_by_size(rows, mode)
    cols = [c for c in IMPLS if any(c in t for t in by.values())]
    lines = [f"{mode} (ops per loop iteration: {MODES[mode]})", "",
             "| size | " + " | ".join(f"{c} µs" for c in cols)
             + " | xla / best cuda | NVLink floor µs |",
             "|---|" + "---|" * (len(cols) + 2)]
    for size, t in sorted(by.items()):
        cuda = [t[c] for c in cuda_policy.ALL_REDUCE_ALGORITHMS if c in t]
        speedup = f"{t['xla'] / min(cuda):.2f}" if cuda and "xla" in t else "–"
        lines.append(f"| {_label(size)} | "
                     + " | ".join(f"{t[c]:.1f}" if c in t else "–" for c in cols)
                     + f" | {speedup} | {floor_us(size, n):.3g} |")
    return "\n".join(lines)


def plot(rows, n, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, style in zip(MODES, ("-", ":")):
        for name in IMPLS:
            pts = sorted((r["size_bytes"], r["us"]) for r in rows
                         if r["impl"] == name and r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{name} ({mode})")
    sizes = sorted({r["size_bytes"] for r in rows})
    if sizes:
        ax.plot(sizes, [floor_us(s, n) for s in sizes], "k--", lw=0.8,
                label=f"NVLink floor ({NVLINK_BYTES_PER_S / 1e9:.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [_label(s) for s in sizes], rotation=30, fontsize=8)
    ax.set_xlabel("message per rank (bf16)")
    ax.set_ylabel("µs per all-reduce (lower is better)")
    ax.set_title(f"all-reduce on {n} GPUs")
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace-mb", type=int, default=None,
                        help="JAX_FLASHOVERLAP_WORKSPACE_MB for this run (default: the "
                             "library's, 1024; 4096 holds 256 MiB messages on 2 GPUs). Rows "
                             "run with another value are not what users get by default.")
    parser.add_argument("--sizes", nargs="+", type=int, default=SIZES, help="bytes per rank")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--devices", type=int, default=None,
                        help="use the first N local devices (default: all)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    if args.devices is not None and not 1 < args.devices:
        parser.error(f"--devices must be at least 2, got {args.devices}")
    if args.workspace_mb is not None:  # read at the first CUDA op
        os.environ["JAX_FLASHOVERLAP_WORKSPACE_MB"] = str(args.workspace_mb)
    rows, n = run(args.sizes, args.impls, args.modes, args.reps, args.devices)

    from jax_flashoverlap import benchmarking, cuda_policy, settings
    options = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    meta = dict(benchmarking.provenance(options), devices=n, dtype="bfloat16", skipped=SKIPPED,
                workspace_mb=settings.get("JAX_FLASHOVERLAP_WORKSPACE_MB"),
                one_shot_max_bytes=cuda_policy.ONE_SHOT_MAX_BYTES)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.plot:
        plot(rows, n, args.plot)
    for mode in args.modes:
        print(table(rows, n, mode))


if __name__ == "__main__":
    main()
