"""Probe: where the one-kernel Transformer decode step spends its time.

    python3 scripts/transformer_decode_probe.py [--batch B] [--context C]
                                                [--chunk-bytes BYTES ...]
                                                [--ring-slots N ...]
                                                [--options MASK ...] [--json FILE]

The 1B Transformer's blocks (16 layers, width 2048, 16 heads of 128 over 8
KV heads, MLP 8192) with random bf16 weights in the kernel's layout
(``models.transformer_decode_cuda``), the caches filled to ``context``.
First the kernel's step is checked against its JAX reference in float32
(CHECK_TOLERANCE); then the step is timed as a decode loop, (T(K2) -
T(K1)) / (K2 - K1) with the caches carried and donated, median of REPS;
then one step's grid-barrier clock readings (%globaltimer) are summed per
stage: the stage's work up to its last CTA's arrival at the barrier, and
the barrier (last arrival to CTA 0's release); and one step's trace gives,
per point of a layer (``models.transformer_decode_cuda.TRACE_EVENTS``), when
the last CTA and the median CTA passed it, from the layer's first CTA's
start, the median over layers.

``--chunk-bytes``, ``--ring-slots`` and ``--options`` (the kernel's optional
paths, ``models.transformer_decode_cuda.OPTIONS``, bit flags) each take
several values: a row for each combination.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashoverlap import benchmarking, models

fused = models.transformer_decode_cuda
# What runs between the kernel's grid barriers (QKV and attention are
# joined by per-KV-head counts).
STAGES = ("qkv_attention", "out", "gate_up", "down")
assert len(STAGES) == fused.BARRIERS_PER_LAYER
HBM_TB_S = benchmarking.H200_HBM_TB_S
# The kernel's step against the reference in float32 (relative): within
# twice the reference's own bf16 error, or this.
CHECK_TOLERANCE = 2e-2
STEPS, REPS = (8, 24), 5


def random_inputs(config, batch: int, context: int, steps: int, seed: int = 0):
    """(x [b, d], weights, caches with positions 0..context-1 filled)."""
    rng = np.random.default_rng(seed)
    d, f, h = config.embed_dim, config.mlp_dim, config.head_dim
    kv, heads, layers = config.num_kv_heads, config.num_heads, config.num_layers

    def normal(shape, scale):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, jnp.bfloat16)

    weights = fused.DecodeWeights(
        attn_norm=jnp.asarray(1 + 0.1 * rng.standard_normal((layers, d)), jnp.float32),
        mlp_norm=jnp.asarray(1 + 0.1 * rng.standard_normal((layers, d)), jnp.float32),
        qkv=normal((layers, kv * (heads // kv + 2) * h // 32, d, 32), d ** -0.5),
        out=normal((layers, d // 16, heads * h, 16), (heads * h) ** -0.5),
        gate_up=normal((layers, 2 * f // 64, d, 64), d ** -0.5),
        down=normal((layers, d // 16, f, 16), f ** -0.5))
    length = context + steps + 1
    caches = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            c = np.zeros((batch, kv, length, h), np.float32)
            c[:, :, :context] = rng.standard_normal((batch, kv, context, h))
            pair.append(jnp.asarray(c, jnp.bfloat16))
        caches.append(models.transformer.KVCache(*pair))
    return normal((batch, d), 1.0), weights, tuple(caches)


def check(config, x, weights, caches, context: int) -> tuple[float, float]:
    """(the kernel's relative error, the bf16 reference's), against the
    reference in float32."""
    got, _ = jax.jit(lambda *a: fused.decode_blocks(*a, config))(x, context, weights, caches)
    bf16, _ = jax.jit(lambda *a: fused.reference(*a, config=config))(
        x, jnp.int32(context), weights, caches)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, weights, caches))
    exact_config = dataclasses.replace(config, dtype="float32")
    want, _ = jax.jit(lambda *a: fused.reference(*a, config=exact_config))(
        f32[0], jnp.int32(context), f32[1], f32[2])
    want = np.asarray(want, np.float64)

    def error(a):
        return float(np.linalg.norm(np.asarray(a, np.float64) - want) / np.linalg.norm(want))

    return error(got), error(bf16)


def decode_loop(config, steps: int, context: int):
    def run(x, weights, caches):
        def body(i, carry):
            x, caches = carry
            y, caches = fused.decode_blocks(x, context + i, weights, caches, config)
            return y, caches
        return jax.lax.fori_loop(0, steps, body, (x, caches))
    return jax.jit(run, donate_argnums=2)


def per_step_us(config, x, weights, caches, context: int) -> list[float]:
    return benchmarking.loop_step_us(
        lambda k: decode_loop(config, k, context),
        lambda: (x, weights, jax.tree.map(jnp.copy, caches)), STEPS, REPS)


def stage_breakdown(config, x, weights, caches, context: int) -> dict:
    call = jax.jit(lambda *a: fused.stage_times(*a, config))
    call(x, context, weights, jax.tree.map(jnp.copy, caches))  # compile, warm up
    words = np.asarray(call(x, context, weights, jax.tree.map(jnp.copy, caches))[2], np.int64)
    times = words[:, 0] + (words[:, 1] << 32)
    start, end = times[0], times[1]
    arrivals, releases = times[2::2], times[3::2]   # barrier k at index k - 1
    if not arrivals.all():  # POLLED_HANDOFFS: no grid barriers
        return {"kernel_us": (end - start) / 1e3}
    work = {s: 0.0 for s in STAGES}
    waits = {s: 0.0 for s in STAGES}
    previous = start
    for k in range(len(arrivals)):
        stage = STAGES[k % len(STAGES)]
        work[stage] += (arrivals[k] - previous) / 1e3
        waits[stage] += (releases[k] - arrivals[k]) / 1e3
        previous = releases[k]
    work["down"] += (end - previous) / 1e3
    return {"kernel_us": (end - start) / 1e3, "work_us": work, "barrier_us": waits}


def layer_timeline(config, x, weights, caches, context: int) -> dict:
    """{event: (last CTA, median CTA) in us from the layer's first start},
    medians over layers; "<stage>_copy_wait_us": the median CTA's waits for
    weight copies in the stage; "layer_us": a layer's length."""
    call = jax.jit(lambda *a: fused.stage_times(*a, config, trace=True))
    call(x, context, weights, jax.tree.map(jnp.copy, caches))
    words = np.asarray(call(x, context, weights, jax.tree.map(jnp.copy, caches))[3], np.int64)
    clocks = words[..., 0] + (words[..., 1] << 32)  # [layers, ctas, events]
    clocks = clocks[:, clocks[0, :, 0] > 0]          # the grid's CTAs
    starts = clocks[:, :, 0].min(axis=1)
    timeline = {}
    for e, name in enumerate(fused.TRACE_EVENTS):
        if name.endswith("_ns"):
            timeline[name.replace("_ns", "_us")] = float(
                np.median(np.median(clocks[:, :, e], 1))) / 1e3
            continue
        last, median = [], []
        for layer in range(clocks.shape[0]):
            passed = clocks[layer, clocks[layer, :, e] > 0, e] - starts[layer]
            if passed.size:
                last.append(passed.max())
                median.append(np.median(passed))
        if last:
            timeline[name] = (float(np.median(last)) / 1e3, float(np.median(median)) / 1e3)
    timeline["layer_us"] = float(np.median(np.diff(starts))) / 1e3
    return timeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b", choices=("small", "1b"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--hbm-tb-s", type=float, default=HBM_TB_S,
                        help="HBM bandwidth per GPU for the floor, TB/s (default: the H200's)")
    parser.add_argument("--chunk-bytes", nargs="+", type=int, default=[None],
                        metavar="BYTES",
                        help="each of these weight slots (models.transformer_decode_cuda."
                             "CHUNK_BYTES), a row each (default: the module's)")
    parser.add_argument("--ring-slots", nargs="+", type=int, default=[None], metavar="N",
                        help="each of these counts of weight slots (models.transformer_decode_"
                             "cuda.RING_SLOTS; 0: as many as fit), a row each (with every "
                             "--chunk-bytes; default: the module's)")
    parser.add_argument("--options", nargs="+", type=int, default=[fused.OPTIONS],
                        metavar="MASK",
                        help="each of these bit masks of the kernel's optional paths "
                             "(models.transformer_decode_cuda.OPTIONS), a row each (with every "
                             "--chunk-bytes; default: the module's)")
    parser.add_argument("--no-stages", action="store_true",
                        help="time the step only: no stage clocks or trace (for a build that "
                             "compiles them out)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                       "transformer_decode_probe.json"))
    args = parser.parse_args()
    config = models.TransformerConfig.preset(args.size, dtype="bfloat16")
    x, weights, caches = random_inputs(config, args.batch, args.context, STEPS[1])
    meta = benchmarking.provenance({"probe": "transformer decode kernel", "steps": list(STEPS),
                                    "reps": REPS, **vars(args)})
    rows = []
    for chunk_bytes, ring_slots, options in itertools.product(
            args.chunk_bytes, args.ring_slots, args.options):
        # Read while tracing: each variant traced afresh.
        if chunk_bytes is not None:
            fused.CHUNK_BYTES = chunk_bytes
        if ring_slots is not None:
            fused.RING_SLOTS = ring_slots
        fused.OPTIONS = options
        jax.clear_caches()
        rows.append({"chunk_bytes": fused.CHUNK_BYTES, "ring_slots": fused.RING_SLOTS,
                     "options": options, **measure(config, x, weights, caches, args.context,
                                                  args.hbm_tb_s, not args.no_stages)})
        print(json.dumps(rows[-1]), flush=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for row in rows:
        slots = row.get("ring_slots") or "as many as fit"
        print(f"\nslots of {row['chunk_bytes']} bytes ({slots}), options {row['options']}: step "
              f"{row['per_step_us']:.1f} us [{row['per_step_us_min']:.1f}, "
              f"{row['per_step_us_max']:.1f}], floor {row['floor_us']:.1f} us "
              f"({row['x_floor']:.2f}x)")
        if "kernel_us" not in row:
            continue
        print(f"one step's kernel, start to end: {row['kernel_us']:.1f} us")
        if "work_us" in row:
            print("| stage | work to the last arrival (us, all layers) "
                  "| barrier (us, all layers) |")
            print("|---|---|---|")
            for stage in STAGES:
                print(f"| {stage} | {row['work_us'][stage]:.1f} | "
                      f"{row['barrier_us'][stage]:.1f} |")
        timeline = row["layer_timeline"]
        waits = ", ".join(f"{k[:-len('_us')]} {v:.2f}" for k, v in timeline.items()
                          if k.endswith("_wait_us") or k == "issue_us")
        print(f"a layer: {timeline['layer_us']:.2f} us; the median CTA's thread 0 waiting "
              f"for copies in each stage, issuing them, and thread 32 waiting (us): {waits}")
        print("| point of the layer | last CTA (us) | median CTA (us) |")
        print("|---|---|---|")
        for name in fused.TRACE_EVENTS:
            if name in timeline:
                print(f"| {name} | {timeline[name][0]:.2f} | {timeline[name][1]:.2f} |")


def measure(config, x, weights, caches, context: int, hbm_tb_s: float = HBM_TB_S,
            stages: bool = True) -> dict:
    """One row: checked, timed, and (with `stages`) one step's stages."""
    error, bf16_error = check(config, x, weights, caches, context)
    print(f"relative error against the float32 reference: {error:.3g} (the bf16 "
          f"reference's: {bf16_error:.3g})", flush=True)
    if not error <= max(2 * bf16_error, CHECK_TOLERANCE):
        raise SystemExit(f"the kernel's step is off by {error:.3g}")
    steps = per_step_us(config, x, weights, caches, context)
    batch = x.shape[0]
    weight_bytes = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in weights)
    cache_bytes = 2 * config.num_layers * batch * config.num_kv_heads * config.head_dim \
        * 2 * (context + 1)
    floor_us = (weight_bytes + cache_bytes) / (hbm_tb_s * 1e12) * 1e6
    breakdown = ({**stage_breakdown(config, x, weights, caches, context),
                  "layer_timeline": layer_timeline(config, x, weights, caches, context)}
                 if stages and jax.default_backend() == "gpu" else {})
    return {"batch": batch, "context": context, "check_error": error,
            "check_bf16_reference_error": bf16_error,
            "per_step_us": statistics.median(steps), "per_step_us_min": steps[0],
            "per_step_us_max": steps[-1], "floor_us": floor_us,
            "x_floor": statistics.median(steps) / floor_us, **breakdown}


if __name__ == "__main__":
    main()
