"""Probe: why the one-kernel Transformer decode step's warps stall (Nsight Compute).

    python3 scripts/transformer_decode_ncu.py [--ncu PATH] [--json FILE]

Runs itself (``--step``: the 1B Transformer's blocks, batch 1, context 512,
random bf16 weights as ``transformer_decode_probe.py`` makes them, the
kernel at its default options launched three times, no XLA GEMM) under
``ncu`` twice, each time profiling the second launch of
``TransformerDecodeKernel`` with the GPU's clocks left as they are
(``--clock-control none``):
1. the warp-state sampling by SASS instruction (``SourceCounters``) and the
   speed-of-light numbers;
2. the instruction caches' counters (``sm__icc_*``: the SM's; ``gcc__*``:
   the L1.5 between it and L2).
The JSON's rows: each stall reason's share of the samples, the counters,
the size of the code executed at least once and at least once a layer by
every warp, and the instructions with the most samples stalled for want of
an instruction (``no_inst``: a fetch that missed the SM's caches waits on
L2 like a load, behind the weight stream), for a global load or an
mbarrier (``long_sb``) and at a CTA barrier (``barrier``). Nothing is
timed here: the step's time comes from ``transformer_decode_probe.py``.

Each profile takes about 30 s; the step needs no XLA autotuning
(``--xla_gpu_autotune_level=0`` is set for the step) and a JAX process
that does not preallocate the GPU's memory (so that ncu's replays save and
restore only what the kernel touches).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = "regex:TransformerDecodeKernel"
LAYERS, WARPS_PER_CTA = 16, 8
CACHE_COUNTERS = (
    "sm__icc_requests.sum", "sm__icc_requests_lookup_hit.sum",
    "sm__icc_requests_lookup_miss.sum", "sm__icc_requests_lookup_miss_tag_miss.sum",
    "gcc__cache_requests_type_instruction_lookup_hit.sum",
    "gcc__cache_requests_type_instruction_lookup_miss.sum",
    "gcc__cache_requests_type_constant_lookup_hit.sum",
    "gcc__cache_requests_type_constant_lookup_miss.sum")
SOL_METRICS = ("Duration", "SM Frequency", "DRAM Throughput", "Memory Throughput")
# The instructions with most samples of each of these stall reasons (and
# the three before each: a load's wait shows at the instruction that uses it).
SITE_REASONS = ("no_inst", "long_sb", "barrier")
TOP_SITES = 12


def step(meta_path: str) -> None:
    """What ncu profiles: three launches of the kernel, and the run's provenance."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, HERE)
    import transformer_decode_probe as probe

    from jax_flashoverlap import benchmarking, models

    fused = models.transformer_decode_cuda
    config = models.TransformerConfig.preset("1b", dtype="bfloat16")
    x, weights, caches = probe.random_inputs(config, 1, 512, 24)
    call = jax.jit(lambda *a: fused.decode_blocks(*a, config))
    for _ in range(3):
        jax.block_until_ready(call(x, jnp.int32(512), weights, caches))
    with open(meta_path, "w") as f:
        json.dump(benchmarking.provenance({
            "probe": "transformer decode kernel under ncu", "size": "1b", "batch": 1,
            "context": 512, "options": fused.OPTIONS, "profiled_launch": 2}), f)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _ncu(ncu: str, args: list[str]) -> str:
    result = subprocess.run([ncu, *args], capture_output=True, text=True, timeout=500)
    if result.returncode:
        raise SystemExit(f"ncu {' '.join(args[:3])}... failed:\n{result.stdout[-2000:]}"
                         f"\n{result.stderr[-2000:]}")
    return result.stdout


def _profiled(ncu: str, tmp: str, what: list[str], report: str) -> None:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip())
    command = [ncu, "--clock-control", "none", "-k", KERNEL, "--launch-skip", "1",
               "--launch-count", "1", *what, "--import-source", "no", "-f", "-o", report,
               sys.executable, "-P", os.path.abspath(__file__), "--step",
               "--meta", os.path.join(tmp, "meta.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500, env=env)
    if result.returncode or not os.path.exists(report + ".ncu-rep"):
        raise SystemExit(f"profiling failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def _details(text: str) -> dict[str, str]:
    table = list(csv.reader(io.StringIO(text)))
    head = table[0]
    name, value = head.index("Metric Name"), head.index("Metric Value")
    unit = head.index("Metric Unit")
    return {r[name]: f"{r[value]} {r[unit]}".strip() for r in table[1:] if len(r) > value}


def _source_rows(text: str) -> list[dict]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def summarize(sass: list[dict], details: dict, counters: dict) -> list[dict]:
    """The JSON's rows from the source page, the details and the counters."""
    reasons = [k for k in sass[0] if k.startswith("stall_") and "Not Issued" not in k]
    samples = sum(_number(r["Warp Stall Sampling (All Samples)"]) for r in sass)
    totals = collections.Counter()
    for r in sass:
        for k in reasons:
            totals[k] += _number(r[k])
    rows = [{"kind": "stall", "reason": k.removeprefix("stall_"), "samples": int(v),
             "share": v / samples} for k, v in totals.most_common() if v]
    rows += [{"kind": "counter", "metric": k, "value": _number(v)} for k, v in counters.items()]
    rows += [{"kind": "speed_of_light", "metric": k, "value": details[k]}
             for k in SOL_METRICS if k in details]
    executed = [(int(r["Address"], 16), _number(r["Instructions Executed"])) for r in sass]
    origin = min(a for a, _ in executed)
    # "every layer": by every warp of the 128 CTAs that have an item in every
    # weight stage of the 1B model.
    for label, least in (("once", 1), ("every layer", LAYERS * 128 * WARPS_PER_CTA)):
        hot = [a for a, n in executed if n >= least]
        rows.append({"kind": "code", "executed": label, "instructions": len(hot),
                     "bytes": 16 * len(hot),
                     "lines_128b": len({(a - origin) // 128 for a in hot})})
    for reason in SITE_REASONS:
        key = "stall_" + reason
        for i in sorted(range(len(sass)), key=lambda i: -_number(sass[i][key]))[:TOP_SITES]:
            r = sass[i]
            rows.append({"kind": reason + "_site", "offset": hex(int(r["Address"], 16) - origin),
                         "sass": r["Source"].strip(),
                         "before": [p["Source"].strip() for p in sass[max(0, i - 3):i]],
                         "samples": int(_number(r[key])), "share": _number(r[key]) / samples,
                         "executed": int(_number(r["Instructions Executed"]))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--meta", help=argparse.SUPPRESS)
    parser.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                       "transformer_decode_ncu.json"))
    args = parser.parse_args()
    if args.step:
        step(args.meta)
        return
    if not os.path.exists(args.ncu):
        raise SystemExit(f"no ncu at {args.ncu}: pass --ncu PATH")
    with tempfile.TemporaryDirectory() as tmp:
        sampled, cached = os.path.join(tmp, "sampled"), os.path.join(tmp, "cached")
        print("profiling the warps' stalls ...", flush=True)
        _profiled(args.ncu, tmp, ["--section", "SpeedOfLight", "--section", "WarpStateStats",
                                  "--section", "SourceCounters"], sampled)
        print("profiling the instruction caches ...", flush=True)
        _profiled(args.ncu, tmp, ["--metrics", ",".join(CACHE_COUNTERS)], cached)
        sass = _source_rows(_ncu(args.ncu, ["-i", sampled + ".ncu-rep", "--page", "source",
                                            "--csv", "--print-source", "sass"]))
        details = _details(_ncu(args.ncu, ["-i", sampled + ".ncu-rep", "--page", "details",
                                           "--csv"]))
        counters = {k: v.split()[0] for k, v in _details(_ncu(
            args.ncu, ["-i", cached + ".ncu-rep", "--page", "details", "--csv"])).items()
            if k in CACHE_COUNTERS}
        with open(os.path.join(tmp, "meta.json")) as f:
            meta = json.load(f)
    rows = summarize(sass, details, counters)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for row in rows:
        print(json.dumps(row))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
