"""cuBLAS (torch.matmul) at the shapes of a cutlass_gemm_probe run, same timing.

    python3 scripts/cutlass_gemm_compare.py cutlass_gemm_probe.json

Adds a "cublas" row per shape to the JSON (20 launches per batch, median of
7 batches, as the probe times CUTLASS) and prints, per shape, cuBLAS's time
against each CUTLASS configuration's: whether a GEMM of our own can start
from CUTLASS without losing throughput.
"""

import json
import statistics
import sys

import torch


def median_us(fn, reps=7, iters=10):
    """Median over ``reps`` batches of ``iters`` back-to-back calls, µs a call
    (CUDA events, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / iters)
    return statistics.median(times)


def main(path: str) -> int:
    with open(path) as f:
        result = json.load(f)
    rows = result["rows"]
    shapes = list(dict.fromkeys((r["m"], r["k"], r["n"]) for r in rows))  # in probe order
    torch.manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        us = median_us(lambda a=a, b=b: torch.matmul(a, b), reps=7, iters=20)
        rows.append({"m": m, "k": k, "n": n, "config": "cublas", "us": us,
                     "tflops": 2 * m * n * k / us / 1e6, "error": ""})
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("| M x K x N | cuBLAS us | CUTLASS config | us | cuBLAS / CUTLASS |")
    print("|---|---|---|---|---|")
    for m, k, n in shapes:
        cublas = next(r["us"] for r in rows if (r["m"], r["k"], r["n"]) == (m, k, n)
                      and r["config"] == "cublas")
        for r in rows:
            if (r["m"], r["k"], r["n"]) != (m, k, n) or r["config"] == "cublas":
                continue
            ratio = f"{cublas / r['us']:.3f}" if r["us"] > 0 else r["error"]
            print(f"| {m}x{k}x{n} | {cublas:.1f} | {r['config']} | {r['us']:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
