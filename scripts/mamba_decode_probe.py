"""Probe: where the one-kernel Mamba-2 decode step spends its time.

    python3 scripts/mamba_decode_probe.py [--shape mamba2-1.3b] [--batch B]
                                          [--schedule MASK ...] [--json FILE]

The blocks of a published Mamba-2 shape (``models.shapes``) with random
weights and states in the kernel's layout (``models.mamba_decode_cuda``).
Each variant (a row for every ``--schedule``) is first checked against the
kernel's JAX reference in float32 (within twice the bf16 reference's own
error, or CHECK_TOLERANCE, and the SSM states within STATE_TOLERANCE); then
timed as a decode loop, (T(K2) - T(K1)) / (K2 - K1) with the states carried
and donated, median of REPS; then one traced step gives, per point of a
layer (``models.mamba_decode_cuda.TRACE_EVENTS``), when the last CTA and
the median CTA passed it, from the median CTA's start of the layer, the
median over layers. The floor is the weights and the states read once over
the GPU's datasheet bandwidth (``--hbm-tb-s`` otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashoverlap import benchmarking, models

fused = models.mamba_decode_cuda
CHECK_TOLERANCE = 2e-2
STATE_TOLERANCE = 2e-2
STEPS, REPS = (8, 24), 5
POSITION = 512


def random_inputs(config, batch: int, seed: int = 0):
    """(x [b, d] bf16, weights, states) at ``config``'s shapes, drawn on the
    device (a 1.3B model's worth of numbers)."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    layers, d, inner = config.num_layers, config.embed_dim, config.inner_dim
    heads, g, n, p = config.num_heads, config.num_groups, config.state_dim, config.head_dim
    channels = inner + 2 * g * n
    columns = fused.in_proj_layout(config)["columns"]

    def normal(shape, scale, dtype=jnp.float32):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    def uniform(shape, low, high):
        return jax.random.uniform(next(keys), shape, jnp.float32, low, high)

    weights = fused.MambaDecodeWeights(
        norm=1 + normal((layers, d), 0.1),
        in_proj=normal((layers, columns // 16, d, 16), d ** -0.5, jnp.bfloat16),
        out_proj=normal((layers, d // 16, inner, 16), inner ** -0.5, jnp.bfloat16),
        conv_weight=normal((layers, config.conv_width, channels), 0.5),
        conv_bias=normal((layers, channels), 0.1),
        dt_bias=uniform((layers, heads), -4.0, -2.0),
        a_log=uniform((layers, heads), 0.0, float(np.log(16.0))),
        d_skip=1 + normal((layers, heads), 0.1),
        gate_norm=1 + normal((layers, inner), 0.1))
    conv = normal((layers, config.conv_width, batch, channels), 1.0, jnp.bfloat16)
    ssm = normal((layers, batch, g, heads // g, p, n), 0.1)
    states = tuple(models.mamba.SSMCache(conv[i], ssm[i]) for i in range(layers))
    return normal((batch, d), 1.0, jnp.bfloat16), weights, states


def relative(a, want) -> float:
    a, want = np.asarray(a, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(a - want) / np.linalg.norm(want))


def references(config, x, weights, states) -> tuple:
    """(the JAX reference's output and states in float32, its output in bf16)."""
    pos = jnp.int32(POSITION)
    bf16, _ = jax.jit(lambda *a: fused.reference(*a, config=config))(x, pos, weights, states)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                       (x, weights))
    exact = dataclasses.replace(config, dtype="float32")
    want, want_states = jax.jit(lambda *a: fused.reference(*a, config=exact))(
        f32[0], pos, f32[1], states)
    return want, want_states, bf16


def check(config, x, weights, states, refs) -> dict:
    """The kernel's errors against the reference in float32 (``refs``, from
    :func:`references`), beside the bf16 reference's; exits if they are out
    of bounds."""
    want, want_states, bf16 = refs
    got, got_states = jax.jit(lambda *a: fused.decode_blocks(*a, config))(
        x, jnp.int32(POSITION), weights, jax.tree.map(jnp.copy, states))
    errors = {"check_error": relative(got, want),
              "check_bf16_reference_error": relative(bf16, want),
              "state_error": max(relative(a.ssm, b.ssm) for a, b in zip(got_states, want_states))}
    print(json.dumps(errors), flush=True)
    if not (errors["check_error"] <= max(2 * errors["check_bf16_reference_error"],
                                         CHECK_TOLERANCE)
            and errors["state_error"] <= STATE_TOLERANCE):
        raise SystemExit(f"the kernel's step is off: {errors}")
    return errors


def per_step_us(config, x, weights, states) -> list[float]:
    def loop(steps):
        def run(x, weights, states):
            def body(i, carry):
                return fused.decode_blocks(carry[0], POSITION + i, weights, carry[1], config)
            return jax.lax.fori_loop(0, steps, body, (x, states))
        return jax.jit(run, donate_argnums=2)

    return benchmarking.loop_step_us(
        loop, lambda: (x, weights, jax.tree.map(jnp.copy, states)), STEPS, REPS)


def timeline_of(values: np.ndarray, events: tuple[str, ...]) -> dict:
    """A traced step's layer, from ``values`` [layers, ctas, row] (ns, the
    kernel's trace rows of the grid's CTAs; ``events`` names the first
    columns, ``layer_start`` first): {point: (last CTA, median CTA)} in us
    from the median CTA's start of the layer, over the CTAs that pass the
    point, the median over layers; each ``*_ns`` duration and the last two
    columns (thread 0 issuing copies, thread 32 waiting for them) as the
    median CTA's "*_us"; "layer_us", the median time between layers'
    starts. The median CTA's start, not the first: CTAs with no item in a
    layer's last stages start the next layer early and wait at its norm."""
    starts = np.median(values[:, :, 0], axis=1)
    durations = {"issue_ns": -2, "warp1_copy_wait_ns": -1,
                 **{name: e for e, name in enumerate(events) if name.endswith("_ns")}}
    timeline = {name.replace("_ns", "_us"): float(np.median(values[:, :, e])) / 1e3
                for name, e in durations.items()}
    for e, name in enumerate(events):
        if name in durations:
            continue
        last, median = [], []
        for layer in range(values.shape[0]):
            passed = values[layer, values[layer, :, e] > 0, e] - starts[layer]
            if passed.size:
                last.append(passed.max())
                median.append(np.median(passed))
        timeline[name] = (float(np.median(last)) / 1e3, float(np.median(median)) / 1e3)
    timeline["layer_us"] = float(np.median(np.diff(starts))) / 1e3
    return timeline


def layer_timeline(config, x, weights, states) -> dict:
    """:func:`timeline_of` one traced step."""
    call = jax.jit(lambda *a: fused.traced(*a, config))
    call(x, POSITION, weights, jax.tree.map(jnp.copy, states))
    words = np.asarray(call(x, POSITION, weights, jax.tree.map(jnp.copy, states))[2], np.int64)
    values = words[..., 0] + (words[..., 1] << 32)   # [layers, ctas, row]
    return timeline_of(values[:, values[0, :, 0] > 0], fused.TRACE_EVENTS)


def measure(config, x, weights, states, refs, hbm_tb_s: float) -> dict:
    """One row: checked, timed, traced."""
    errors = check(config, x, weights, states, refs)
    steps = per_step_us(config, x, weights, states)
    state_bytes = sum(a.nbytes for s in states for a in s)
    floor_us = (sum(w.nbytes for w in weights) + state_bytes) / (hbm_tb_s * 1e12) * 1e6
    return {**errors, "per_step_us": statistics.median(steps), "per_step_us_min": steps[0],
            "per_step_us_max": steps[-1], "floor_us": floor_us,
            "x_floor": statistics.median(steps) / floor_us,
            "layer_timeline": layer_timeline(config, x, weights, states)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mamba2-1.3b",
                        help="a Mamba-2 name of models.shapes.NAMES or a checkpoint directory")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hbm-tb-s", type=float, default=None,
                        help="HBM TB/s for the floor (default: the GPU's datasheet)")
    bits = fused.SCHEDULE_BITS
    parser.add_argument("--schedule", nargs="+", type=int,
                        default=sorted({fused.SCHEDULE, 0, *bits, sum(bits)}), metavar="MASK",
                        help="bit masks of models.mamba_decode_cuda.SCHEDULE, a row each "
                             "(default: 0, the module's, each bit alone and all of them)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                       "mamba_decode_probe.json"))
    args = parser.parse_args()
    kind, config = models.shapes.config_of(args.shape)
    if kind != "mamba":
        parser.error(f"--shape {args.shape} is not a Mamba-2 model")
    config = dataclasses.replace(config, dtype="bfloat16")
    hbm_tb_s = args.hbm_tb_s or benchmarking.hbm_tb_s(jax.devices()[0].device_kind)
    if hbm_tb_s is None:
        parser.error(f"no datasheet bandwidth for {jax.devices()[0].device_kind}: pass --hbm-tb-s")
    x, weights, states = random_inputs(config, args.batch)
    meta = benchmarking.provenance({"probe": "mamba decode kernel", "steps": list(STEPS),
                                    "reps": REPS, "position": POSITION, "hbm_tb_s": hbm_tb_s,
                                    **vars(args)})
    refs = references(config, x, weights, states)
    rows = []
    for schedule in args.schedule:
        fused.SCHEDULE = schedule  # read while tracing
        jax.clear_caches()
        rows.append({"schedule": schedule, "batch": args.batch,
                     **measure(config, x, weights, states, refs, hbm_tb_s)})
        print(json.dumps(rows[-1]), flush=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for row in rows:
        t = row["layer_timeline"]
        print(f"\nschedule {row['schedule']}: step "
              f"{row['per_step_us']:.1f} us [{row['per_step_us_min']:.1f}, "
              f"{row['per_step_us_max']:.1f}], floor {row['floor_us']:.1f} us "
              f"({row['x_floor']:.2f}x); a layer {t['layer_us']:.2f} us")
        print("waits (median CTA, us): " + ", ".join(
            f"{k[:-3]} {v:.2f}" for k, v in t.items() if k.endswith("_wait_us") or k == "issue_us"))
        print("| point of the layer | last CTA (us) | median CTA (us) |\n|---|---|---|")
        for name in fused.TRACE_EVENTS:
            if name in t:
                print(f"| {name} | {t[name][0]:.2f} | {t[name][1]:.2f} |")


if __name__ == "__main__":
    main()
