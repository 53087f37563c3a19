"""Writes docs/results.md, and the README's headline table, from benchmarks/results/*.json.

    python3 docs/make_results.py          # rewrites both
    python3 docs/make_results.py --check  # exits 1 if either is stale

Every number comes from a results file and every ratio is computed from the
raw values. Each table names its file, the commit and date of the run, and
the settings that were not the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- headline: docs/make_results.py -->", "<!-- end of headline -->"

# The latest run of each kind at the defaults of its time.
COLLECTIVE_MATMULS = ["collective_matmul_xla_waits_2xh200.json",
                      "collective_matmul_mar_auto_2xh200.json"]
ALL_REDUCE = "all_reduce_lamport_auto_2xh200.json"
NVSHMEM = "hierarchical_all_reduce_2xh200.json"
TRAINING = [("train_step_impls_2xh200.json", "transformer"),
            ("train_step_mamba_auto_xla_ops_2xh200.json", "mamba")]
DECODE = "decode_1xh200.json"
# The attention kernel's inputs packed (its default) against apart.
DECODE_PACKED = "decode_attention_packed_inputs_contexts_1xh200.json"
# decode_blocks "layers" against "cuda" (what "auto" runs up to 2 rows per
# device), in one process.
DECODE_BLOCKS = "decode_blocks_cuda_batches_1xh200.json"
# Published models' shapes (benchmarks/decode.py --config) on random weights.
# One table per GPU: each floor is that GPU's own datasheet bandwidth.
DECODE_SHAPES = ("decode_real_shapes_1xh200.json", "decode_real_shapes_1xh100.json",
                 "decode_mamba_kernel_1xh100.json")
SSD = "ssd_decay_outer_1xh200.json"
# The Mamba-2 1.4B step at the defaults against the Transformer 1B step of
# the same process.
MAMBA_STEP = "train_step_mamba_decay_outer_1xh200.json"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _source(name: str, doc: dict, nondefault: str = "") -> str:
    meta, first = doc["meta"], doc["rows"][0]
    date = str(meta["date"])[:10]
    made = (" (commit and date reconstructed from git)" if "provenance" in meta
            else " (rows reconstructed from the run's log; see its meta)"
            if "reconstructed_from" in meta else "")
    extra = f"; not at the defaults: {nondefault}" if nondefault else ""
    kind = meta.get("device_kind") or first.get("device", "")
    count = meta.get("devices") or meta.get("processes")
    if count is None and "mesh" in first:
        count = math.prod(int(v) for v in str(first["mesh"]).split("x"))
    return (f"`benchmarks/results/{name}`: {count}x {kind}, commit {str(meta['commit'])[:7]}, "
            f"{date}{made}{extra}.")


def _shape(s) -> str:
    return "×".join(map(str, s))


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def collective_matmul_table() -> tuple[str, list]:
    times, sources = {}, []
    for name in COLLECTIVE_MATMULS:  # later files win for the same op and shape
        doc = _load(name)
        sources.append(_source(name, doc))
        for r in doc["rows"]:
            times.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["us"]
    lines = ["| op | rows×k×n per rank | cuda µs | xla µs | GEMM alone µs | xla / cuda | "
             "cuda / GEMM |", "|---|---|---|---|---|---|---|"]
    speedups = {}
    for (op, shape), t in sorted(times.items()):
        if "cuda" not in t or "xla" not in t:
            continue
        gemm = t.get("gemm")
        lines.append(f"| {op} | {_shape(shape)} | {t['cuda']:.1f} | {t['xla']:.1f} | "
                     + (f"{gemm:.1f}" if gemm else "–") + f" | {t['xla'] / t['cuda']:.2f} | "
                     + (f"{t['cuda'] / gemm:.2f}" if gemm else "–") + " |")
        speedups.setdefault(op, []).append(t["xla"] / t["cuda"])
    return "\n".join(lines) + "\n\n" + "\n".join(f"From {s}" for s in sources), speedups


def all_reduce_table() -> tuple[str, list]:
    doc = _load(ALL_REDUCE)
    rows = [r for r in doc["rows"] if r.get("unroll", 1) > 1]
    t = {}
    for r in rows:
        t.setdefault(r["size_bytes"], {})[r["impl"]] = r["us"]
    lines = ["| bf16 message per rank | \"auto\" µs | lamport µs | one-shot µs | psum µs | "
             "psum / \"auto\" |", "|---|---|---|---|---|---|"]
    ratios = []
    for size, v in sorted(t.items()):
        cells = " | ".join(f"{v[k]:.1f}" if k in v else "–"
                           for k in ("auto", "lamport", "one_shot", "xla"))
        lines.append(f"| {_size(size)} | {cells} | {v['xla'] / v['auto']:.2f} |")
        ratios.append((size, v["auto"], v["xla"]))
    unroll = rows[0]["unroll"]
    source = _source(ALL_REDUCE, doc, f"JAX_FLASHOVERLAP_WORKSPACE_MB="
                     f"{doc['meta']['workspace_mb']} (these sizes fit the default 1024 too)")
    return (f"{unroll} all-reduces per loop iteration (as in a model's layer).\n\n"
            + "\n".join(lines) + f"\n\nFrom {source}"), ratios


def nvshmem_table() -> str:
    doc = _load(NVSHMEM)
    t = {}
    for r in doc["rows"]:
        if r.get("unroll", 1) > 1:
            t.setdefault(r["size_bytes"], {})[r["impl"]] = r["us"]
    lines = ["| bf16 message per process | NVSHMEM µs | psum µs | psum / NVSHMEM |",
             "|---|---|---|---|"]
    for size, v in sorted(t.items()):
        if "nvshmem" in v and "xla" in v:
            lines.append(f"| {_size(size)} | {v['nvshmem']:.1f} | {v['xla']:.1f} | "
                         f"{v['xla'] / v['nvshmem']:.2f} |")
    return ("2 processes, one GPU each, each GPU its own node (the cross-node path), "
            "several all-reduces per loop iteration.\n\n" + "\n".join(lines)
            + f"\n\nFrom {_source(NVSHMEM, doc)}")


def training_table() -> tuple[str, dict]:
    lines = ["| model | impl | step ms, median [min, max] | MFU | vs xla |",
             "|---|---|---|---|---|"]
    sources, gains = [], {}
    for name, model in TRAINING:
        doc = _load(name)
        sources.append(_source(name, doc))
        rows = [r for r in doc["rows"] if r["model"] == model]
        xla = {r["model"]: r["step_ms"] for r in rows if r["impl"] == "xla"}
        for r in rows:
            lines.append(f"| {r['model']} {r['size']} | {r['impl']} | {r['step_ms']:.1f} "
                         f"[{r['step_ms_min']:.1f}, {r['step_ms_max']:.1f}] | "
                         f"{100 * r['mfu']:.1f}% | {xla[r['model']] / r['step_ms']:.3f}× |")
            if r["impl"] == "auto":
                gains[r["model"]] = xla[r["model"]] / r["step_ms"]
    setting = ("mesh 1x2 (tensor-parallel over 2 GPUs, sequence parallel), batch 1, "
               "sequence 8192, bf16.")
    return setting + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(
        f"From {s}" for s in sources), gains


def _decode_step(r: dict) -> str:
    """What a decode row's step ran, as the tables name it."""
    return ("every block in one kernel" if r.get("decode_blocks") == "cuda"
            else f"layers, {r['decode_attention']} attention" if r["model"] == "transformer"
            else "layers")


def decode_table() -> tuple[str, list]:
    doc = _load(DECODE)
    lines = ["| model | batch | context | decode step | per token ms | HBM floor ms | × floor | "
             "prefill ms |", "|---|---|---|---|---|---|---|---|"]
    rows = doc["rows"]
    for r in rows:
        lines.append(f"| {r['model']} {r['size']} | {r['batch']} | {r['context']} | "
                     f"{_decode_step(r)} | "
                     f"{r['per_token_ms']:.3f} | {r['hbm_floor_ms']:.3f} | "
                     f"{r['per_token_ms'] / r['hbm_floor_ms']:.2f} | {r['prefill_ms']:.2f} |")
    return ("One H200 (TP=1), impl \"xla\" (one GPU: no communication), bf16, the models' "
            "default decode settings (the step column: what they ran). The floor is "
            "the bytes of weights and cache one token reads, at 4.8 TB/s.\n\n"
            + "\n".join(lines) + f"\n\nFrom {_source(DECODE, doc)}{_runs_note(doc)}\n\n"
            + packed_inputs_note()), rows


def _runs_note(doc: dict) -> str:
    """Which commit and date ran which rows, for the runs (meta.runs) other
    than the one :func:`_source` names."""
    meta = doc["meta"]
    named = (str(meta["commit"])[:7], str(meta["date"])[:10])
    by_run: dict[tuple[str, str], list[str]] = {}
    for run in meta.get("runs", []):
        key = (run["commit"][:7], str(run["date"])[:10])
        if key != named:
            by_run.setdefault(key, []).extend(run["rows"])
    return "".join(f" At {commit}, {date}: {', '.join(rows)}."
                   for (commit, date), rows in by_run.items())


def packed_inputs_note() -> str:
    """The attention kernel's packed inputs (its default) against its inputs
    apart, in one process."""
    doc = _load(DECODE_PACKED)
    by = {(r["packed_inputs"], r["context"]): r["per_token_ms"] for r in doc["rows"]}
    pairs = ", ".join(f"context {context} {packed:.3f} against {by[False, context]:.3f} ms "
                      f"({by[False, context] / packed:.3f}×)"
                      for (is_packed, context), packed in sorted(by.items()) if is_packed)
    return ("With `decode_blocks=\"layers\"` the attention kernel (batch 1) takes q, k and v "
            "packed in one array (`models.decode_attention_pallas.PACKED_INPUTS`); the "
            f"Transformer at batch 1, packed against apart in one process: {pairs}. From "
            f"{_source(DECODE_PACKED, doc)}")


def decode_blocks_table() -> tuple[str, dict]:
    """The one-kernel decode step against the layers, in one process."""
    lines = ["| batch | context | layers ms | one kernel ms | one kernel × floor | speed-up |",
             "|---|---|---|---|---|---|"]
    doc = _load(DECODE_BLOCKS)
    gains = {}
    by = {(r["decode_blocks"], r["batch"], r["context"]): r for r in doc["rows"]}
    for (blocks, batch, context), r in sorted(by.items()):
        layers = by.get(("layers", batch, context))
        if blocks != "cuda" or layers is None:
            continue
        gains[batch] = layers["per_token_ms"] / r["per_token_ms"]
        lines.append(f"| {batch} | {context} | {layers['per_token_ms']:.3f} | "
                     f"{r['per_token_ms']:.3f} | {r['per_token_ms'] / r['hbm_floor_ms']:.2f} | "
                     f"{gains[batch]:.3f}× |")
    source = _source(DECODE_BLOCKS, doc, 'decode_blocks "layers" or "cuda" as each row says')
    return ("One H200, the 1B Transformer, bf16: `decode_blocks=\"cuda\"` (every block of a "
            "step as one CUDA kernel, what the default \"auto\" runs up to 2 rows per device) "
            "against \"layers\" in the same process.\n\n"
            + "\n".join(lines) + f"\n\nFrom {source}"), gains


def decode_shapes_table() -> str:
    """Decoding at published models' shapes, LM head and all, and the time
    to the first token after the prompt: a table per GPU."""
    tables = []
    for name in DECODE_SHAPES:
        doc = _load(name)
        lines = ["| shape | parameters | decode step | per token ms, median [min, max] | "
                 "HBM floor ms | × floor | time to first token ms |",
                 "|---|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['size']} | {r.get('param_dtype', 'float32')} | {_decode_step(r)} | "
                         f"{r['per_token_ms']:.3f} [{r['per_token_ms_min']:.3f}, "
                         f"{r['per_token_ms_max']:.3f}] | {r['hbm_floor_ms']:.3f} | "
                         f"{r['per_token_ms'] / r['hbm_floor_ms']:.2f} | {r['prefill_ms']:.2f} |")
        missing = [f"{run['decode_args'].split()[1]}: {run['outcome']}"
                   for run in doc["meta"].get("runs", []) if "outcome" in run]
        tables.append(f"One {doc['meta']['device_kind']}, floor at "
                      f"{doc['meta']['settings']['hbm_tb_s']} TB/s:\n\n" + "\n".join(lines)
                      + f"\n\nFrom {_source(name, doc)}"
                      + "".join(f" Not measured: {m}." for m in missing))
    return ("bf16 compute, batch 1, context 512, random weights at each model's real shape "
            "(`benchmarks/decode.py --config`): the floor counts every weight a token reads, "
            "the LM heads (tied 128,256- and 50,288-token ones included) and the cache, over "
            "the GPU's datasheet bandwidth. \"parameters\" is the dtype the weights are kept "
            "in (`param_dtype`); the time to first token is the 512-token prompt's prefill."
            "\n\n" + "\n\n".join(tables))


def mamba_tables() -> tuple[str, dict]:
    """The SSD per layer (XLA, Pallas, cuDNN attention for scale) and the
    one-GPU training step of Mamba-2 next to the Transformer's."""
    doc = _load(SSD)
    by = {(r["what"], r["phase"]): r for r in doc["rows"] if "shape" in r}
    attention = by[("cudnn attention", "forward+backward")]["ms"]
    ssd = ["| per layer | forward ms | forward + backward ms | fwd + bwd vs cuDNN attention |",
           "|---|---|---|---|"]
    for what in ("ssd xla", "ssd pallas", "ssd pallas keeps states", "cudnn attention"):
        fwd, both = by[(what, "forward")], by[(what, "forward+backward")]
        ssd.append(f"| {what} | {fwd['ms']:.3f} | {both['ms']:.3f} | "
                   f"{both['ms'] / attention:.2f}× |")
    shapes = (f"SSD: {by[('ssd pallas', 'forward')]['shape']}; attention: "
              f"{by[('cudnn attention', 'forward')]['shape']}.")
    step_doc = _load(MAMBA_STEP)
    rows = step_doc["rows"]
    transformer = next(r for r in rows if r["model"] == "transformer")
    mamba = next(r for r in rows if r["model"] == "mamba")
    steps = ["| model | step ms, median [min, max] | × Transformer step | MFU |",
             "|---|---|---|---|"]
    for r in rows:
        steps.append(f"| {r['model']} {r['size']} | {r['step_ms']:.1f} [{r['step_ms_min']:.1f}, "
                     f"{r['step_ms_max']:.1f}] | {r['step_ms'] / transformer['step_ms']:.2f}× | "
                     f"{100 * r['mfu']:.1f}% |")
    numbers = {"ssd_speedup": by[("ssd xla", "forward+backward")]["ms"]
               / by[("ssd pallas", "forward+backward")]["ms"],
               "ssd_vs_attention": by[("ssd pallas", "forward+backward")]["ms"] / attention,
               "step_ratio": mamba["step_ms"] / transformer["step_ms"],
               "peak_gb": mamba["peak_memory_gb"]}
    text = (f"One H200, bf16, batch 1, sequence 8192. {shapes}\n\n" + "\n".join(ssd)
            + "\n\nTraining steps at the defaults (mesh 1x1, impl \"xla\", no `--remat`, "
            "layers unrolled; Mamba-2's SSD, convolution backward and gated norm at \"auto\": "
            "the Pallas kernels), both models in one process; the process's peak memory "
            f"{mamba['peak_memory_gb']:.1f} GB:\n\n" + "\n".join(steps)
            + f"\n\nFrom {_source(SSD, doc)}\nFrom {_source(MAMBA_STEP, step_doc)}")
    return text, numbers


def results_md() -> str:
    cm, _ = collective_matmul_table()
    ar, _ = all_reduce_table()
    tr, _ = training_table()
    dec, _ = decode_table()
    mamba, _ = mamba_tables()
    return f"""# Measured results

Generated by `docs/make_results.py` from `benchmarks/results/*.json`; do not
edit by hand. Every time is a median of in-graph runs on random data,
checked against a reference first (the protocol in
`jax_flashoverlap/benchmarking.py`); every ratio is computed from the raw
values.

## Collective matmuls, 2 H200s, bf16

{cm}

## All-reduce, 2 H200s in one process

{ar}

## All-reduce across processes (NVSHMEM)

{nvshmem_table()}

## Training step

{tr}

## Mamba-2's SSD and training step, one H200

{mamba}

## Decoding

{dec}

![decoding](../benchmarks/results/decode_1xh200.png)

### The one-kernel decode step

{decode_blocks_table()[0]}

### Published models' shapes

{decode_shapes_table()}

What was tried instead, and why not: [design.md](design.md); the models'
options: [models.md](models.md). The earlier runs those pages quote are in
the git history of `benchmarks/results/`.
"""


def headline() -> str:
    _, speedups = collective_matmul_table()
    _, ratios = all_reduce_table()
    _, gains = training_table()
    _, decode = decode_table()
    _, mamba = mamba_tables()
    small = [xla / auto for size, auto, xla in ratios if size <= 64 << 10]
    # What "auto" runs with the shipped table: the faster of the two per shape.
    cm = "; ".join(f"{op} {max(1, min(v)):.2f}–{max(v):.2f}×"
                   for op, v in sorted(speedups.items()))
    shapes = len(next(iter(speedups.values())))
    tf = next(r for r in decode if r["model"] == "transformer" and r["batch"] == 1)
    _, gain = decode_blocks_table()
    lines = [
        "| what (bf16) | measured | |",
        "|---|---|---|",
        f"| all-reduce, 2 H200s, ≤ 64 KiB per rank | {min(small):.2f}–{max(small):.2f}× "
        f"faster than psum | median {statistics.median(small):.2f}×; run with "
        f"JAX_FLASHOVERLAP_WORKSPACE_MB={_load(ALL_REDUCE)['meta']['workspace_mb']}, "
        f"which these sizes do not need |",
        f"| collective matmuls, 2 H200s, {shapes} shapes each | {cm} the speed of \"xla\" | "
        f"\"auto\": the faster of \"cuda\" and \"xla\" per shape |",
        f"| training step, 2 H200s, \"auto\" | Transformer 1B {gains['transformer']:.3f}×, "
        f"Mamba-2 1.4B {gains['mamba']:.3f}× faster than \"xla\" | |",
        f"| Mamba-2 1.4B training, one H200, sequence 8192 | SSD layer forward + backward "
        f"{mamba['ssd_speedup']:.2f}× faster with the Pallas kernels, "
        f"{mamba['ssd_vs_attention']:.2f}× the time of cuDNN attention's at the 1B "
        f"Transformer layer; step {mamba['step_ratio']:.2f}× "
        f"the Transformer 1B step of the same process | no `--remat`, peak "
        f"{mamba['peak_gb']:.1f} GB |",
        f"| Transformer 1B decode, one H200, batch 1 | {tf['per_token_ms']:.3f} ms per token, "
        f"{tf['per_token_ms'] / tf['hbm_floor_ms']:.2f}× the HBM floor | every block in one "
        f"CUDA kernel (`decode_blocks=\"auto\"`): {gain[1]:.3f}× (batch 1) and {gain[2]:.3f}× "
        f"(batch 2) the speed of the layers' step in one process |",
    ]
    return "\n".join(lines)


def readme_with_headline(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + headline() + "\n" + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    outputs = {DOC: results_md(), README: readme_with_headline(README.read_text())}
    stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run python3 docs/make_results.py")
        return 1 if stale else 0
    for p in stale:
        p.write_text(outputs[p])
    return 0


if __name__ == "__main__":
    sys.exit(main())
