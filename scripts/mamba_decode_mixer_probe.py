"""Probe: Mamba-2's decode mixer kernel against XLA's ops, by tiling.

    python3 scripts/mamba_decode_mixer_probe.py [BATCH ...]   # $OUT/mamba_decode_mixer_probe.json

The 1.4B model's 48 mixers between in_proj and the gated norm (8 groups of
8 heads of 64, state 128, convolution width 4), one decode step each, the
states carried from step to step as the decode loop carries them (so that
the kernel updates them in place), timed with the project's in-graph
protocol: ``models.mamba_decode_pallas.mixer_step`` at several channel
blocks and warp counts against ``mixer_step_xla`` (the same step in XLA's
fusions), each checked against it first (STATE_TOLERANCE). The floor is the SSM state read
and written once at 4.8 TB/s.
"""

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax_flashoverlap.models import mamba_decode_pallas

from jax_flashoverlap import benchmarking

LAYERS, GROUPS, WIDTH = 48, 8, 4
LAYOUT = mamba_decode_pallas.Layout(8, 64, 128)
HBM = benchmarking.H200_HBM_TB_S * 1e12
# A variant's first-layer state after one step may differ from XLA's step
# by this much (relative to its largest value), or the probe stops.
STATE_TOLERANCE = 1e-4
STEPS, REPS = (4, 12), 5


def decode_loop(step, steps):
    """``steps`` decode steps of LAYERS mixers, the states carried (donated)."""
    def run(zxbcdt, params, rings, states):
        def body(pos, carry):
            rings, states, acc = carry
            new_rings, new_states = [], []
            for ring, state in zip(rings, states):
                y, state, ring = step(zxbcdt, ring, *params, state, pos, LAYOUT)
                acc = acc + y[0, 0, 0, 0].astype(jnp.float32)
                new_rings.append(ring)
                new_states.append(state)
            return new_rings, new_states, acc
        return jax.lax.fori_loop(0, steps, body, (rings, states, jnp.zeros((), jnp.float32)))
    return jax.jit(run, donate_argnums=(2, 3))


def measure(batch, variants, params):
    """Rows of each variant at ``batch``: the median per-step time over
    REPS, and the first layer's state after one step against the first variant's."""
    hpg, p, n = LAYOUT
    c = hpg * p + 2 * n
    keys = jax.random.split(jax.random.key(batch), 3)
    zxbcdt = jax.random.normal(keys[0], (batch, GROUPS, 2 * hpg * p + 2 * n + hpg), jnp.bfloat16)
    # On the device, copied for every run (the loops consume them).
    all_rings = jax.random.normal(keys[1], (LAYERS, WIDTH, batch, GROUPS * c), jnp.bfloat16)
    all_states = jax.random.normal(keys[2], (LAYERS, batch, GROUPS, hpg, p, n), jnp.float32)

    def run(loop):
        args = jax.block_until_ready(([all_rings[i] for i in range(LAYERS)],
                                      [all_states[i] for i in range(LAYERS)]))
        start = time.perf_counter()
        result = jax.block_until_ready(loop(zxbcdt, params, *args))
        return time.perf_counter() - start, result

    state_bytes = LAYERS * batch * GROUPS * hpg * p * n * 4 * 2
    k1, k2 = STEPS
    want = None
    for name, step in variants.items():
        loops = {k: decode_loop(step, k) for k in (1, k1, k2)}
        got = np.asarray(run(loops[1])[1][1][0])
        want = got if want is None else want
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if not err <= STATE_TOLERANCE:
            raise AssertionError(f"{name} at batch {batch}: the state differs from XLA's step "
                                 f"by {err:.3g}, more than {STATE_TOLERANCE:g}")
        for k in STEPS:  # compile and warm up
            run(loops[k])
        per_step = sorted((run(loops[k2])[0] - run(loops[k1])[0]) / (k2 - k1)
                          for _ in range(REPS))
        t = per_step[len(per_step) // 2]
        yield {"batch": batch, "variant": name, "us_48_layers": t * 1e6,
               "us_per_layer": t * 1e6 / LAYERS, "floor_us": state_bytes / HBM * 1e6,
               "state_rel_err_vs_xla": err}


def main():
    out = os.environ.get("OUT", "/tmp")
    batches = [int(a) for a in sys.argv[1:]] or [1, 32]
    rng = np.random.default_rng(0)
    hpg, p, n = LAYOUT
    c = hpg * p + 2 * n
    heads = GROUPS * hpg
    params = (jnp.asarray(rng.standard_normal((WIDTH, GROUPS * c)) * 0.5, jnp.float32),
              jnp.asarray(rng.standard_normal(GROUPS * c), jnp.float32),
              jnp.asarray(rng.uniform(-4, -1, heads), jnp.float32),
              jnp.asarray(np.log(rng.uniform(1, 16, heads)), jnp.float32),
              jnp.asarray(rng.standard_normal(heads), jnp.float32))
    variants = {"xla": mamba_decode_pallas.mixer_step_xla}
    for channels, warps in ((16, 4), (32, 4), (64, 4), (64, 8)):
        variants[f"kernel c{channels} w{warps}"] = functools.partial(
            mamba_decode_pallas.mixer_step, channels=channels, num_warps=warps)
    meta = benchmarking.provenance({"probe": "mamba decode mixer", "layers": LAYERS,
                                    "layout": LAYOUT._asdict(), "steps": list(STEPS),
                                    "reps": REPS})
    rows = []
    for batch in batches:
        for row in measure(batch, variants, params):
            rows.append(row)
            print(json.dumps(row), flush=True)
            # After every row: a run cut short keeps what it measured.
            with open(os.path.join(out, "mamba_decode_mixer_probe.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n| batch | variant | µs per step (48 layers) | µs per layer | floor µs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['variant']} | {r['us_48_layers']:.1f} "
              f"| {r['us_per_layer']:.2f} | {r['floor_us']:.1f} |")


if __name__ == "__main__":
    main()
