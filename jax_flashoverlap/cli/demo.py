"""Demo: runs every op with each implementation, checks it, times it.

    jax-flashoverlap-demo            # or: python -P -m jax_flashoverlap.cli.demo

On a machine without GPUs it runs on 8 CPU devices (and says so); on GPUs it
uses all local GPUs along one tensor-parallel axis. Results are checked
against the "xla" implementation before anything is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from .devices import ensure_cpu_devices
from .flags import HelpFormatter


def _cases(n: int, on_gpu: bool):
    """(op, per-device shapes) pairs: m_local x k x n_local."""
    m, k, cols = (1024, 4096, 4096) if on_gpu else (64, 256, 128)
    return {
        "all_gather_matmul": ((m, k), (k, cols)),
        "matmul_reduce_scatter": ((n * m, k), (k, cols)),
        "matmul_all_reduce": ((m, k), (k, cols)),
        "all_reduce": ((m, cols),),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jax-flashoverlap-demo",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--reps", type=int, default=5, help="timing repetitions")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1 (the median of the timings), got {args.reps}")
    ensure_cpu_devices(8)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_flashoverlap as jfo
    from jax_flashoverlap import benchmarking, dispatch

    on_gpu = jax.default_backend() == "gpu"
    devices = jax.devices()[:8]
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tensor",))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(f"jax_flashoverlap {jfo.__version__} on {n} {devices[0].platform.upper()} device(s)"
          f"{'' if on_gpu else ' (no GPU found: CPU devices, pure-JAX paths)'}; "
          f"build: {jfo.build_info()}", flush=True)
    impls = ["xla", "decomposed", "auto"]
    if on_gpu and jfo.build_info()["cuda"]:
        impls.append("cuda")
    rng = np.random.default_rng(0)
    rows = []
    for op, shapes in _cases(n, on_gpu).items():
        specs = (P("tensor"),) * len(shapes)
        global_args = [jax.device_put(
            jnp.asarray(rng.standard_normal((n * s[0], *s[1:]), dtype=np.float32), dtype),
            NamedSharding(mesh, spec)) for s, spec in zip(shapes, specs)]
        auto = dispatch.resolve(op, shapes, dtype, n, platform=jax.default_backend()).impl
        reference = None
        for impl in impls:
            fn = functools.partial(getattr(jfo, op), axis_name="tensor", impl=impl)
            run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("tensor"),
                                        check_vma=False))
            try:
                out = np.asarray(run(*global_args), np.float32)
            except NotImplementedError as e:  # a CUDA kernel not built yet
                print(f"  {op:22s} {impl:10s} skipped: {e}")
                continue
            reference = out if reference is None else reference
            err = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
            if err > (2e-2 if dtype == jnp.bfloat16 else 1e-4):
                raise SystemExit(f"{op} impl={impl}: relative error {err:.2e} vs xla")
            t = benchmarking.time_per_op(fn, global_args, mesh=mesh, in_specs=specs,
                                         reps=args.reps)
            rows.append(dict(op=op, impl=impl, runs=auto if impl == "auto" else impl,
                             us=t.median_us, spread=t.spread(), rel_err_vs_xla=err))
            print(f"  {op:22s} {impl:10s} {t.median_us:10.1f} us  (spread {t.spread():.0%}, "
                  f"error vs xla {err:.1e})", flush=True)
    base = {r["op"]: r for r in rows if r["impl"] == "xla"}
    print(f"\n{'op':22s} {'impl':10s} {'runs':10s} {'us':>10s} {'spread':>7s} "
          f"{'err vs xla':>10s} {'xla/impl':>9s}")
    for r in rows:
        print(f"{r['op']:22s} {r['impl']:10s} {r['runs']:10s} {r['us']:10.1f} "
              f"{r['spread']:7.0%} {r['rel_err_vs_xla']:10.1e} "
              f"{_ratio(base[r['op']], r):>9s}")
    print("\nxla/impl: above 1 is faster than xla. \"same\": the row runs XLA's own "
          "program, so any difference is the timing's spread.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": n, "platform": devices[0].platform, "rows": rows}, f, indent=1)
    return 0


def _ratio(xla: dict, row: dict) -> str:
    """xla's time over the row's, or "same" where the row runs xla itself."""
    if row["runs"] == "xla":
        return "same"
    return f"{xla['us'] / row['us']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
