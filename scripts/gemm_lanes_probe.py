"""Probe (torch on the GPU machine): do row-block GEMMs get back what cutting costs
when consecutive blocks run on two alternating streams?

    python3 scripts/gemm_lanes_probe.py      # writes $OUT/gemm_lanes_probe.json

The fused collective matmuls run a GEMM per row block, one after another on
XLA's stream, and lose throughput to the cut (docs/measurements.md, session notes). If
the loss were the last, partly empty wave of each block, a second stream could
fill it with the next block. For each shape it times, with CUDA events
(median of 7 runs of 10), the whole GEMM, its row blocks in sequence, and the
blocks alternating over two streams, after checking both block variants
against the whole product in float32.
"""

import json
import os
import statistics

import torch

SHAPES = [(4096, 8192, 7168, 4), (4096, 8192, 7168, 2), (4096, 8192, 4096, 4),
          (8192, 8192, 4096, 4), (4096, 8192, 14336, 2)]  # M, K, N, row blocks


def median_us(fn, reps=7, iters=10):
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


def measure(m, k, n, blocks, main_stream, aux_stream):
    """One shape's row: the three variants, checked, then timed."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    b = m // blocks

    def whole():
        torch.mm(x, w, out=y)

    def sequence():
        for i in range(blocks):
            torch.mm(x[i * b:(i + 1) * b], w, out=y[i * b:(i + 1) * b])

    def two_streams():
        forked = torch.cuda.Event()
        forked.record(main_stream)
        aux_stream.wait_event(forked)
        for i in range(blocks):
            with torch.cuda.stream((main_stream, aux_stream)[i % 2]):
                torch.mm(x[i * b:(i + 1) * b], w, out=y[i * b:(i + 1) * b])
        joined = torch.cuda.Event()
        joined.record(aux_stream)
        main_stream.wait_event(joined)

    want = x.float() @ w.float()
    for name, fn in (("whole", whole), ("sequence", sequence), ("two_streams", two_streams)):
        y.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = ((y.float() - want).norm() / want.norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"{name} {m}x{k}x{n}: relative error {err:.3g}")
    return dict(shape=[m, k, n], blocks=blocks, whole_us=median_us(whole),
                sequence_us=median_us(sequence), two_streams_us=median_us(two_streams))


def main():
    torch.manual_seed(0)
    main_stream = torch.cuda.current_stream()
    aux_stream = torch.cuda.Stream()
    rows = []
    for m, k, n, blocks in SHAPES:
        row = measure(m, k, n, blocks, main_stream, aux_stream)
        rows.append(row)
        print(f"{m}x{k}x{n} in {blocks} blocks: whole {row['whole_us']:.1f} us, in sequence "
              f"{row['sequence_us']:.1f} ({row['sequence_us'] / row['whole_us']:.3f}), "
              f"two streams {row['two_streams_us']:.1f} "
              f"({row['two_streams_us'] / row['whole_us']:.3f})", flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gemm_lanes_probe.json"), "w") as f:
        json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(0),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
