"""Probe: do row-block GEMMs lose less when consecutive blocks run on alternating streams?"""
import statistics, torch, json, os
torch.manual_seed(0)
dev = torch.device("cuda:0")
def bench(fn, reps=7, iters=10):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters): fn()
        e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / iters)
    return statistics.median(ts)
main = torch.cuda.current_stream()
aux = [torch.cuda.Stream() for _ in range(3)]
rows_out = []
for (M, K, N, blocks) in [(4096, 8192, 7168, 4), (4096, 8192, 7168, 2), (4096, 8192, 4096, 4), (8192, 8192, 4096, 4), (4096, 8192, 14336, 2)]:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    b = M // blocks
    def whole(): torch.mm(x, w, out=y)
    def seq():
        for i in range(blocks): torch.mm(x[i*b:(i+1)*b], w, out=y[i*b:(i+1)*b])
    def lanes(k):
        def f():
            ev = torch.cuda.Event(); ev.record(main)
            for s in aux[:k-1]: s.wait_event(ev)
            streams = [main] + aux[:k-1]
            for i in range(blocks):
                s = streams[i % k]
                with torch.cuda.stream(s):
                    torch.mm(x[i*b:(i+1)*b], w, out=y[i*b:(i+1)*b])
            for s in aux[:k-1]:
                e2 = torch.cuda.Event(); e2.record(s); main.wait_event(e2)
        return f
    ref = (x.float() @ w.float())
    for name, fn in [("whole", whole), ("seq", seq), ("2 lanes", lanes(2))]:
        y.zero_(); fn(); torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (name, err)
    r = dict(shape=[M, K, N], blocks=blocks, whole=bench(whole), seq=bench(seq), lanes2=bench(lanes(2)))
    r["seq_over_whole"] = r["seq"] / r["whole"]; r["lanes2_over_whole"] = r["lanes2"] / r["whole"]
    rows_out.append(r)
    print(f"{M}x{K}x{N} blocks {blocks}: whole {r['whole']:.1f} us, seq {r['seq']:.1f} ({r['seq_over_whole']:.3f}), 2 lanes {r['lanes2']:.1f} ({r['lanes2_over_whole']:.3f})", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(0), rows=rows_out), open(f"{out}/gemm_lanes_probe.json", "w"), indent=1)
