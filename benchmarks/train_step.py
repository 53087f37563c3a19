"""Benchmark: training-step time, tokens/s and MFU of both models, per impl.

    python benchmarks/train_step.py --json out.json        # 1B models, TP=2 + SP, seq 8192

For each model and ``impl`` it builds the training step of
``jax_flashoverlap.cli.train`` (AdamW, bf16 compute, float32 parameters) on a
``--mesh`` (default 1x2: tensor parallelism over two GPUs with sequence
parallelism), runs ``--warmup`` steps (compilation, autotuning), then times,
``--reps`` times, a run of k = ``--steps`` and one of 2k back-to-back steps,
each blocked at its end (so dispatch overlaps the device as in training). A
step's time is the median of (T(2k) - T(k)) / k, the protocol's difference:
it leaves out what a run pays once, such as starting on an empty queue,
which T(k) / k ("from idle", also recorded) spreads over its k steps.
"host dispatch" is the median time per step until the host had dispatched
a 2k-run's last step; "first call" the median time the first step's call of
a run took to return, on an idle device: the host's own cost of a step
(near the step time, the host bounds it), where the step is unrolled; in a
scanned one the host may also wait on the device for loop conditions.
Every loss must be finite. An impl that raises ``NotImplementedError`` (no
CUDA kernel for an op) is skipped with a message.
Results go to ``--json`` after each row; a markdown table is printed last.
MFU is against the H200's 989 TFLOP/s dense bf16 datasheet peak per GPU.
Each row records the first GPU's peak memory since the process started:
run one model per process to read that model's.
The Transformer's attention is ``--attention`` (default auto: cuDNN flash
attention where supported); each row records which ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time

from jax_flashoverlap import benchmarking, models
from jax_flashoverlap.cli import train
from jax_flashoverlap.cli.data import load_corpus
from jax_flashoverlap.cli.devices import ensure_cpu_devices


def step_times(runs, k: int) -> tuple[list[float], float, float]:
    """Per-step seconds from pairs of timed runs.

    Args:
      runs: per repetition ((T(k), dispatched), (T(2k), dispatched)): the
        seconds of a k-step and a 2k-step run, and of each the seconds until
        its last step was dispatched.
      k: steps of the shorter run.

    Returns:
      The sorted (T(2k) - T(k)) / k of every pair, the median T(k) / k (from
      an idle device), and the median dispatch time per step of the 2k-runs.
    """
    per_step = sorted((long_s - short_s) / k for (short_s, _), (long_s, _) in runs)
    from_idle = statistics.median(short_s / k for (short_s, _), _ in runs)
    dispatch = statistics.median(dispatched / (2 * k) for _, (_, dispatched) in runs)
    return per_step, from_idle, dispatch


def variant_flags(variant: str) -> list[str]:
    """A ``--mamba-variants`` entry as trainer flags: "default" adds none;
    "residuals=all,no-fuse-skip" gives ``--residuals all
    --no-fuse-skip`` (commas, so that no shell quoting is needed)."""
    flags = []
    for token in (t.strip() for t in variant.split(",")):
        if token and token != "default":
            name, _, value = token.partition("=")
            flags += [f"--{name}"] + ([value] if value else [])
    return flags


def _peak_memory_gb() -> float | None:
    """The first device's peak memory in use since the process started (GB),
    None where the backend keeps no statistics (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None


def _measure(model: str, impl: str, variant: str, args: argparse.Namespace) -> dict:
    import jax

    targs = train.parse_args([
        "--model", model, "--size", args.size, "--mesh", args.mesh, "--batch", str(args.batch),
        "--seq-len", str(args.seq_len), "--impl", impl, "--steps", "1000", "--no-progress",
        *(["--dtype", args.dtype] if args.dtype else []), *(["--remat"] if args.remat else []),
        *(["--attention", args.attention] if model == "transformer"
          else ["--ssd", args.ssd, "--conv", args.conv]),
        *({None: [], True: ["--scan-layers"], False: ["--unroll-layers"]}[args.scan_layers]),
        *variant_flags(variant)])
    trainer = train.build(targs)
    corpus = load_corpus(None, targs.seq_len)
    batches = [trainer.tokens(corpus, i) for i in range(args.steps)]
    losses = []

    first_calls = []

    def run(count: int) -> tuple[float, float]:
        """Seconds for ``count`` steps, and of them the seconds until the host
        had dispatched the last (where it nears the first, the host bounds the
        step). Records how long the first step's call took to return, on an
        idle device: the host's own cost of one step, before a full launch
        queue makes it wait for the device."""
        start = time.perf_counter()
        for i in range(count):
            trainer.state, loss, _ = trainer.step(trainer.state, batches[i % len(batches)])
            losses.append(loss)
            if i == 0:
                first_calls.append(time.perf_counter() - start)
        dispatched = time.perf_counter() - start
        jax.block_until_ready((trainer.state, losses[-1]))
        return time.perf_counter() - start, dispatched

    k = args.steps
    with jax.set_mesh(trainer.mesh):
        warmup_s, _ = run(args.warmup)  # Mostly compilation.
        del first_calls[:]
        runs = [(run(k), run(2 * k)) for _ in range(args.reps)]
    per_step, from_idle_s, dispatch_s = step_times(runs, k)
    losses = [float(v) for v in losses]
    if not all(math.isfinite(v) for v in losses):
        raise FloatingPointError(f"{model} impl={impl}: non-finite loss {losses}")
    step_s = statistics.median(per_step)
    if not step_s > 0:
        raise RuntimeError(f"{model} impl={impl}: T(2k) - T(k) = {step_s * k:.3g} s, the runs' "
                           f"spread exceeds {k} steps; raise --steps")
    return {
        "model": model, "size": args.size, "params": trainer.num_params, "impl": impl,
        "attention": trainer.attention,
        "ssd": getattr(trainer.config, "ssd_impl", None),
        "conv": getattr(trainer.config, "conv_impl", None),
        "norm_backward": getattr(trainer.config, "norm_backward", None),
        "residuals": getattr(trainer.config, "residuals", None),
        "fuse_skip": getattr(trainer.config, "fuse_skip", None),
        "chunk_size": getattr(trainer.config, "chunk_size", None),
        "ssd_tiling": (dataclasses.asdict(trainer.config.ssd_tiling)
                       if hasattr(trainer.config, "ssd_tiling") else None),
        "variant": variant,
        "scan_layers": trainer.config.scan_layers,
        "mesh": args.mesh, "batch": args.batch, "seq_len": args.seq_len,
        "dtype": trainer.config.dtype, "device": jax.devices()[0].device_kind,
        "step_ms": step_s * 1e3, "step_ms_min": per_step[0] * 1e3,
        "step_ms_max": per_step[-1] * 1e3, "reps": args.reps, "steps_per_rep": args.steps,
        "step_ms_from_idle": from_idle_s * 1e3, "dispatch_ms": dispatch_s * 1e3,
        "first_call_ms": statistics.median(first_calls) * 1e3,
        "tokens_per_s": args.batch * args.seq_len / step_s,
        "peak_memory_gb": _peak_memory_gb(),
        "mfu": trainer.flops_per_step / step_s / trainer.peak_flops
        if trainer.peak_flops else None,
        "loss_first": losses[0], "loss_last": losses[-1], "warmup_s": warmup_s,
    }


def _check_against_xla(row: dict, rows: list[dict]) -> None:
    """The first step (same parameters, same batch) must lose what the model's
    first "xla" row's did, to the dtype's rounding, before any speed-up of
    ``row`` is reported."""
    xla = [r for r in rows if r["model"] == row["model"] and r["impl"] == "xla"]
    if not xla:
        return
    want, got = xla[0]["loss_first"], row["loss_first"]
    tolerance = 1e-4 if row["dtype"] == "float32" else 2e-2
    if not abs(got - want) <= tolerance * abs(want):
        raise SystemExit(f"{row['model']} impl={row['impl']}: first-step loss {got:.6g} differs "
                         f"from xla's {want:.6g} by more than {tolerance:g} (relative)")


def _kernels(row: dict) -> str:
    """The row's attention, or its SSD and convolution, and its extra flags."""
    if row.get("attention"):
        return row["attention"]
    parts = [f"{name} {row[name]}" for name in ("ssd", "conv") if row.get(name)]
    if row.get("variant", "default") != "default":
        parts.append(row["variant"])
    return ", ".join(parts) or "–"


def _table(rows: list[dict]) -> str:
    xla = {}
    for r in rows:  # Each model's first "xla" row is its baseline.
        if r["impl"] == "xla":
            xla.setdefault(r["model"], r["step_ms"])
    lines = ["| model | params | impl | kernels | step (ms), median [min, max] | "
             "from idle (ms) | host dispatch (ms) | first call (ms) | tokens/s | MFU | "
             "speed-up vs xla |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        speedup = f"{xla[r['model']] / r['step_ms']:.3f}x" if r["model"] in xla else "–"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:,.1f}M | {r['impl']} | "
                     f"{_kernels(r)} | "
                     f"{r['step_ms']:.1f} [{r['step_ms_min']:.1f}, {r['step_ms_max']:.1f}] | "
                     f"{r['step_ms_from_idle']:.1f} | {r['dispatch_ms']:.1f} | "
                     f"{r['first_call_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {speedup} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here (after each one)")
    parser.add_argument("--models", nargs="+", default=["transformer", "mamba"])
    parser.add_argument("--impls", nargs="+", default=["xla", "auto", "cuda"],
                        help="the first-step loss of each is checked against xla's, which "
                             "runs first")
    parser.add_argument("--size", default="1b", choices=tuple(models.SIZES))
    parser.add_argument("--mesh", default="1x2", help="DATAxTENSOR")
    parser.add_argument("--batch", type=int, default=1, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU")
    parser.add_argument("--remat", action="store_true")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--unroll-layers", dest="scan_layers", action="store_false", default=None,
                        help="unset: the trainer's default (jax-flashoverlap-train --help)")
    layers.add_argument("--scan-layers", dest="scan_layers", action="store_true")
    parser.add_argument("--attention", default="auto", choices=models.ATTENTION_IMPLS,
                        help="the Transformer's attention (auto: cuDNN where supported)")
    parser.add_argument("--ssd", default="auto", choices=models.SSD_IMPLS,
                        help="Mamba-2's SSD within chunks (auto: Pallas kernels on GPUs)")
    parser.add_argument("--conv", default="auto", choices=models.CONV_IMPLS,
                        help="the backward of Mamba-2's convolution + SiLU (auto: the Pallas "
                             "kernel on GPUs)")
    parser.add_argument("--mamba-variants", nargs="+", default=["default"], metavar="FLAGS",
                        help="Mamba-2 runs once per FLAGS, extra jax-flashoverlap-train flags "
                             "without their dashes, joined by commas (e.g. default "
                             "residuals=all residuals=all,norm-backward=recompute), in "
                             "turn in this process; the first is the baseline")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10,
                        help="k: steps of the shorter timed run (the longer has 2k)")
    parser.add_argument("--reps", type=int, default=5, help="pairs of timed runs")
    args = parser.parse_args(argv)
    ensure_cpu_devices(train.CPU_DEVICES)  # CPU smoke runs; GPUs are unaffected.

    rows = []
    cases = [(model, impl, variant) for model in args.models for impl in args.impls
             for variant in (args.mamba_variants if model == "mamba" else ["default"])]
    for model, impl, variant in cases:
        label = f"{model}/{args.size} impl={impl} {variant}"
        print(f"--- {label}", flush=True)
        try:
            row = _measure(model, impl, variant, args)
        except NotImplementedError as e:
            print(f"skip {label}: {e}", flush=True)
            continue
        finally:
            gc.collect()  # Drop the last model's buffers before the next one.
        _check_against_xla(row, rows)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            meta = benchmarking.provenance(
                {k: v for k, v in vars(args).items() if k != "json"})
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nTraining step, mesh {args.mesh} (data x tensor), batch {args.batch}, "
          f"seq {args.seq_len}; MFU vs 989 TFLOP/s per GPU\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
