"""Benchmark: the SSD scan per layer, XLA against the Pallas kernels, next to
cuDNN flash attention at the Transformer's layer.

    python benchmarks/ssd.py --json out.json      # Mamba-2 1.4B's layer, sequence 8192

At Mamba-2 1.4B's layer shape (batch 1, 64 heads of 64 in 8 groups, state
128, chunk 256, bf16) it times :func:`models.mamba.ssd` forward, and
forward + backward (the gradients of every input), with ``impl`` "xla" and
"pallas" (also keeping the chunk states for the backward, and with every
tile's decays as exponentials of differences, see ``_full_decays``), and cuDNN
flash attention at the 1B Transformer's layer (16 heads of 128, 8 KV heads,
causal) the same way, in one process, by the project's
protocol (``jax_flashoverlap.benchmarking``). Before timing, the Pallas
results are checked against XLA's (relative error by norm, bf16 tolerance).
``--sweep`` also times the chunk output's kernels alone per tiles (rows x
columns, ``--sweep-tiles``), warps per program and pipeline stages, each
tiling checked against the default first (one that does not fit is recorded as
skipped); ``--sweep-only`` times only that. ``--norm`` also times a layer's
two norms, the mixer's gated norm ([seq, batch, inner] in groups) and the
block's norm ([seq, batch, embed], ungated, one group), XLA's ops against
:mod:`models.norm_pallas`'s kernels, checked first the same way; with
``--sweep`` the kernels per rows per program and warps. The JSON is
rewritten after each row.
TFLOP/s count the SSD's FLOPs as ``MambaConfig.ssd_flops_per_token`` does
(forward + backward as three forwards).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_flashoverlap import benchmarking, models

TOLERANCE = 1e-2  # bf16
# (rows per program, warps) of the norm kernels under --norm --sweep, per norm:
# tiles of 2048 to 16384 values either way.
NORM_SWEEPS = {"gated norm": [(rows, warps) for rows in (4, 8, 16, 32) for warps in (4, 8)],
               "block norm": [(rows, warps) for rows in (1, 2, 4, 8) for warps in (4, 8)]}
# (rows per tile, tiles per program, warps) of the convolution's backward
# kernel under --conv --sweep.
CONV_SWEEP = [(rows, steps, warps) for rows in (16, 32) for steps in (1, 4, 16)
              for warps in (4, 8)]


def ssd_inputs(config: models.MambaConfig, seq_len: int, batch: int, key) -> tuple[jax.Array, ...]:
    """(x, dt, a, b, c) of one layer, random, distributed as the model's."""
    g, hpg = config.num_groups, config.num_heads // config.num_groups
    keys = jax.random.split(key, 5)
    dtype = jnp.dtype(config.dtype)
    x = jax.random.normal(keys[0], (seq_len, batch, g, hpg, config.head_dim), dtype)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (seq_len, batch, g, hpg)) - 4.0)
    a = -jax.random.uniform(keys[2], (g, hpg), minval=1.0, maxval=16.0)
    b, c = (jax.random.normal(k, (seq_len, batch, g, config.state_dim), dtype)
            for k in keys[3:])
    return x, dt, a, b, c


@contextlib.contextmanager
def _full_decays():
    """While the Pallas kernels are traced inside, the tiles wholly below the
    diagonal take their decays as rows x cols exponentials of differences,
    as every tile did before the outer products (d1da4da): to A/B those."""
    kernels = models.ssd_pallas
    outer = kernels._decay_below
    kernels._decay_below = lambda rows, cols, last: jnp.exp(rows[:, None] - cols[None, :])
    try:
        yield
    finally:
        kernels._decay_below = outer


def ssd_ops(config: models.MambaConfig, impl: str, keep_chunk_states: bool = False,
            full_decays: bool = False):
    """(forward, forward + backward) of one layer's SSD; ``keep_chunk_states``
    as :func:`models.mamba.ssd` takes it; ``full_decays``: see
    :func:`_full_decays`."""
    decays = _full_decays if full_decays else contextlib.nullcontext

    def ssd(*t):
        return models.mamba.ssd(*t, config.chunk_size, impl=impl,
                                keep_chunk_states=keep_chunk_states)

    def forward(*t):
        with decays():
            return ssd(*t)

    def backward(*t):
        probe = jnp.ones_like(t[0], jnp.float32)
        # The kernels' backward is traced by jax.grad, after the forward's
        # trace: the whole gradient runs inside the one context.
        with decays():
            return jax.grad(lambda *u: jnp.sum(ssd(*u) * probe), argnums=tuple(range(5)))(*t)
    return forward, backward


def attention_ops(config: models.TransformerConfig, seq_len: int, batch: int, key):
    """The Transformer layer's causal cuDNN attention: args, forward, forward + backward."""
    h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    keys = jax.random.split(key, 3)
    q = jax.random.normal(keys[0], (batch, seq_len, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (batch, seq_len, kv, d), jnp.bfloat16) for kk in keys[1:])

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def backward(q, k, v):
        return jax.grad(lambda *t: jnp.sum(forward(*t).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)
    return (q, k, v), forward, backward


def tiling_sweep(config: models.MambaConfig, inputs, mesh, reps: int,
                 tiles: list[tuple[int, int]], warps: list[int], stages: list[int],
                 rows: list[dict], save) -> list[dict]:
    """The chunk output's kernels alone (``models.ssd_pallas.chunk_output``),
    forward and forward + backward, per tiling: every (rows, columns) of the
    intra-chunk tiles in ``tiles``, warps per program in ``warps`` and
    software-pipeline stages in ``stages``: the rows appended to ``rows``,
    ``save()`` called after each, and returned."""
    x, dt, a, b, c = inputs
    s, chunk = x.shape[0], config.chunk_size
    x, dt, b, c = (t.reshape(s // chunk, chunk, *t.shape[1:]) for t in (x, dt, b, c))
    operands = models.ssd_pallas.chunk_operands(x, dt, jnp.cumsum(dt * a, axis=1), b, c)
    batch, groups, heads, p = x.shape[2:]
    # In x's dtype, as the model passes the entering states.
    state = jax.random.normal(jax.random.key(1),
                              (batch, groups, heads, s // chunk, p, c.shape[-1]), x.dtype)
    operands = (*operands, state)

    def default_forward(*t):
        return models.ssd_pallas.chunk_output(*t, chunk_size=chunk)
    want = {"forward": jax.jit(default_forward)(*operands),
            "forward+backward": jax.jit(jax.grad(lambda *u: jnp.sum(default_forward(*u)),
                                                 argnums=tuple(range(6))))(*operands)}
    first = len(rows)
    for (block, cols), num_warps, num_stages in itertools.product(tiles, warps, stages):
        def forward(*t, block=block, cols=cols, num_warps=num_warps, num_stages=num_stages):
            return models.ssd_pallas.chunk_output(*t, chunk_size=chunk, block=block,
                                                  block_cols=cols, num_warps=num_warps,
                                                  num_stages=num_stages)

        def backward(*t, forward=forward):
            return jax.grad(lambda *u: jnp.sum(forward(*u)), argnums=tuple(range(6)))(*t)

        for phase, fn in (("forward", forward), ("forward+backward", backward)):
            row = {"what": "chunk_output kernels", "block": block, "block_cols": cols,
                   "num_warps": num_warps, "num_stages": num_stages, "phase": phase}
            try:
                err = relative_error(jax.jit(fn)(*operands), want[phase])
                if not err <= TOLERANCE:
                    raise AssertionError(f"chunk_output at tiles {block}x{cols}, {num_warps} "
                                         f"warps, {num_stages} stages, {phase}: relative error "
                                         f"{err:.3g} against the default tiling > {TOLERANCE}")
                row["relative_error"] = err
                t = benchmarking.time_per_op(fn, operands, mesh=mesh,
                                             in_specs=(P(),) * 6, k1=2, k2=8, reps=reps)
            except jax.errors.JaxRuntimeError as e:  # e.g. tiles beyond shared memory
                row["skipped"] = str(e).splitlines()[0]
            else:
                row.update(ms=t.median_s * 1e3, ms_min=t.min_s * 1e3,
                           ms_max=t.max_s * 1e3, reps=t.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    return rows[first:]


def parse_tiles(texts: list[str]) -> list[tuple[int, int]]:
    """["128x64", ...] -> [(128, 64), ...]."""
    return [tuple(int(side) for side in text.split("x")) for text in texts]


def print_sweep(sweep: list[dict]) -> None:
    """The sweep's rows as a table, forward and forward + backward side by side."""
    print("\n| tiles | warps | stages | forward (ms) | forward + backward (ms) |"
          "\n|---|---|---|---|---|")
    for fwd, both in zip(sweep[::2], sweep[1::2]):
        cells = (f"{r['ms']:.3f}" if "ms" in r else "failed" for r in (fwd, both))
        print(f"| {fwd['block']}x{fwd['block_cols']} | {fwd['num_warps']} | "
              f"{fwd['num_stages']} | {' | '.join(cells)} |")


def norm_ops(config: models.MambaConfig, which: str, seq_len: int, batch: int, key,
             tilings):
    """One of a Mamba-2 layer's norms at ``config``'s shape, ``which`` "gated
    norm" (the mixer's, before out_proj) or "block norm" (the block's, before
    in_proj): (operands (x, gate, weight, the output's gradient) or (x,
    weight, the output's gradient), the shape in words) and, per
    implementation, (forward, forward + backward); the kernels once per (rows
    per program, warps) in ``tilings`` ((None, None): the defaults)."""
    gated = which == "gated norm"
    dim = config.inner_dim if gated else config.embed_dim
    group = config.inner_dim // config.num_groups if gated else dim
    kx, kz, kw, kd = jax.random.split(key, 4)
    shape = (seq_len, batch, dim)
    x = jax.random.normal(kx, shape, jnp.dtype(config.dtype))
    weight = 1.0 + 0.1 * jax.random.normal(kw, (dim,))
    # The output's gradient is an operand, random like the rest: from a sum's
    # constant gradient XLA would fold the backward into the forward.
    inputs = (x, jax.random.normal(kz, shape, x.dtype), weight) if gated else (x, weight)
    operands = (*inputs, jax.random.normal(kd, shape, x.dtype))
    described = f"[{seq_len}, {batch}, {dim}] {config.dtype}, groups of {group}"

    def with_grad(norm):
        def unpacked(*t):  # (x, gate, weight) or (x, weight) -> norm(x, gate, weight)
            return norm(*t) if gated else norm(t[0], None, t[1])

        def forward_and_backward(*t):  # (output, the inputs' gradients), as training needs
            out, vjp = jax.vjp(unpacked, *t[:-1])
            return out, vjp(t[-1])
        return lambda *t: unpacked(*t[:-1]), forward_and_backward

    ops = {"xla": with_grad(lambda x, g, w: models.layers.rms_norm(
        x, w, eps=config.norm_eps, group_size=group, gate=g))}
    for rows, warps in tilings:
        name = "pallas" if rows is None else f"pallas rows {rows} warps {warps}"
        ops[name] = with_grad(functools.partial(
            models.norm_pallas.gated_rms_norm, eps=config.norm_eps, group_size=group, rows=rows,
            num_warps=warps))
    return (operands, described), ops


def conv_ops(config: models.MambaConfig, seq_len: int, batch: int, key,
             tilings: list[tuple[int, int, int]] = ()):
    """A Mamba-2 layer's in_proj split, convolutions and SiLU
    (:func:`models.conv_pallas.split_conv_silu`) at ``config``'s shape:
    (operands (in_proj's output, weight, bias, the outputs' gradients), the
    shape in words) and, per backward ("xla", "pallas", and the kernel at
    each (rows per program, warps) in ``tilings``), (forward, forward +
    backward)."""
    g = config.num_groups
    layout = models.conv_pallas.Layout(config.num_heads // g, config.head_dim, config.state_dim)
    dtype = jnp.dtype(config.dtype)
    keys = jax.random.split(key, 8)
    zxbcdt = jax.random.normal(keys[0], (seq_len, batch, g, layout.width), dtype)
    weight = 0.5 * jax.random.normal(keys[1], (config.conv_width, g * layout.conv_channels), dtype)
    bias = 0.1 * jax.random.normal(keys[2], (g * layout.conv_channels,), dtype)
    inputs = (zxbcdt, weight, bias)
    shapes = jax.eval_shape(lambda *t: models.conv_pallas.split_conv_silu(*t, layout, impl="xla"),
                            *inputs)
    # The outputs' gradients are operands, random: from a sum's constant
    # gradient XLA would fold the backward into the forward.
    grads = tuple(jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys[3:], shapes))

    def op(impl, **tiling):
        def forward(*t):
            return models.conv_pallas.split_conv_silu(*t[:3], layout, impl=impl, **tiling)

        def forward_and_backward(*t):
            out, vjp = jax.vjp(lambda *u: forward(*u), *t[:3])
            return out, vjp(t[3:])
        return forward, forward_and_backward
    described = (f"[{seq_len}, {batch}, {g}, {layout.width}] {config.dtype}, "
                 f"width {config.conv_width}")
    ops = {impl: op(impl) for impl in ("xla", "pallas")}
    for rows, steps, warps in tilings:
        ops[f"pallas rows {rows}x{steps} warps {warps}"] = op(
            "pallas", block_rows=rows, steps=steps, num_warps=warps)
    return ((*inputs, *grads), described), ops


def relative_error(got, want) -> float:
    """Worst relative error by norm over the leaves of two pytrees."""
    errs = [float(jnp.linalg.norm((g - w).astype(jnp.float32))
                  / jnp.maximum(jnp.linalg.norm(w.astype(jnp.float32)), 1e-30))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return max(errs)


def time_conv(config, args, key, mesh, rows: list[dict], save) -> None:
    """The --conv rows, each backward checked against XLA's first: appended
    to ``rows``, ``save()`` after each, and printed as a table."""
    (operands, shape), ops = conv_ops(config, args.seq_len, args.batch, key,
                                      CONV_SWEEP if args.sweep else [])
    times = {}
    phases = ("forward", "forward+backward")
    want = {phase: jax.jit(fn)(*operands) for phase, fn in zip(phases, ops["xla"])}
    for impl, op in ops.items():
        for phase, fn in zip(phases, op):
            err = relative_error(jax.jit(fn)(*operands), want[phase])
            if not err <= TOLERANCE:
                raise AssertionError(f"conv {impl}, {phase}: relative error {err:.3g} > "
                                     f"{TOLERANCE}")
            t = benchmarking.time_per_op(fn, operands, mesh=mesh,
                                         in_specs=(P(),) * len(operands), k1=2, k2=8,
                                         reps=args.reps)
            times[impl, phase] = t.median_s * 1e3
            rows.append({"what": f"conv {impl}", "phase": phase, "shape": shape,
                         "relative_error": err, "ms": t.median_s * 1e3,
                         "ms_min": t.min_s * 1e3, "ms_max": t.max_s * 1e3, "reps": t.reps})
            print(json.dumps(rows[-1]), flush=True)
            save()
    print(f"\n| convolution ({shape}) | forward (ms) | forward + backward (ms) |\n|---|---|---|")
    for impl in ops:
        print(f"| {impl} | {times[impl, 'forward']:.4f} | {times[impl, 'forward+backward']:.4f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=None, help="default: the 1.4B model's")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the chunk output's kernels alone per tile side and warps "
                             "(with --norm, the norm's kernels per rows and warps; with "
                             "--conv, the convolution's backward kernel)")
    parser.add_argument("--sweep-tiles", nargs="+", default=["32x32", "64x64", "128x128"],
                        metavar="ROWSxCOLS", help="the --sweep's intra-chunk tiles")
    parser.add_argument("--sweep-warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--sweep-stages", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--sweep-only", action="store_true",
                        help="only the --sweep (no XLA, default-tiling or attention rows)")
    parser.add_argument("--norm", action="store_true",
                        help="also time the mixer's gated norm, XLA's ops against the kernels")
    parser.add_argument("--conv", action="store_true",
                        help="also time in_proj's split, the convolutions and their SiLU, "
                             "XLA's backward against the kernel")
    parser.add_argument("--conv-only", action="store_true", help="only the --conv rows")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("benchmarks/ssd.py times the Pallas GPU kernels: it needs a CUDA GPU",
              file=sys.stderr)
        return 2
    config = models.MambaConfig.preset("1b", **({"chunk_size": args.chunk} if args.chunk else {}))
    mesh = benchmarking.first_devices_mesh(1)
    key = jax.random.key(0)
    inputs = ssd_inputs(config, args.seq_len, args.batch, key)
    rows = []
    meta = benchmarking.provenance({k: v for k, v in vars(args).items() if k != "json"})

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)

    def sweep():
        print_sweep(tiling_sweep(config, inputs, mesh, args.reps, parse_tiles(args.sweep_tiles),
                                 args.sweep_warps, args.sweep_stages, rows, save))

    if args.sweep_only:
        sweep()
        return 0
    if args.conv or args.conv_only:
        time_conv(config, args, key, mesh, rows, save)
        if args.conv_only:
            return 0

    ops = {impl: ssd_ops(config, impl) for impl in ("xla", "pallas")}
    ops["pallas keeps states"] = ssd_ops(config, "pallas", keep_chunk_states=True)
    ops["pallas full decays"] = ssd_ops(config, "pallas", full_decays=True)
    errors = {}
    for i, phase in enumerate(("forward", "forward+backward")):
        want = jax.jit(ops["xla"][i])(*inputs)
        for impl in ("pallas", "pallas keeps states", "pallas full decays"):
            err = relative_error(jax.jit(ops[impl][i])(*inputs), want)
            errors[phase if impl == "pallas" else f"{phase}, {impl.removeprefix('pallas ')}"] = err
            print(f"{impl} vs xla, {phase}: relative error {err:.2e}", flush=True)
            if not err <= TOLERANCE:
                raise AssertionError(f"{impl}, {phase}: relative error {err:.3g} > {TOLERANCE}")

    meta["pallas_relative_error"] = errors

    def timed(name, op, operands, shape, flops=None):
        for phase, fn, work in zip(("forward", "forward+backward"), op,
                                   (flops, flops and 3 * flops)):
            t = benchmarking.time_per_op(fn, operands, mesh=mesh,
                                         in_specs=(P(),) * len(operands), k1=2, k2=8,
                                         reps=args.reps)
            rows.append({"what": name, "phase": phase, "shape": shape, "ms": t.median_s * 1e3,
                         "ms_min": t.min_s * 1e3, "ms_max": t.max_s * 1e3, "reps": t.reps,
                         "tflop_per_s": work / t.median_s / 1e12 if work else None})
            print(json.dumps(rows[-1]), flush=True)
            save()

    ssd_shape = (f"batch {args.batch}, seq {args.seq_len}, {config.num_heads} heads of "
                 f"{config.head_dim}, {config.num_groups} groups, state {config.state_dim}, "
                 f"chunk {config.chunk_size}, {config.dtype}")
    flops = config.ssd_flops_per_token() * args.seq_len * args.batch
    for impl, op in ops.items():
        timed(f"ssd {impl}", op, inputs, ssd_shape, flops)
    tconfig = models.TransformerConfig.preset("1b")
    attn_args, *attn_op = attention_ops(tconfig, args.seq_len, args.batch, key)
    timed("cudnn attention", attn_op, attn_args,
          f"batch {args.batch}, seq {args.seq_len}, {tconfig.num_heads} heads of "
          f"{tconfig.head_dim}, {tconfig.num_kv_heads} KV heads, causal, bfloat16")

    if args.norm:
        for which, sweep in NORM_SWEEPS.items():
            (norm_inputs, norm_shape), norms = norm_ops(
                config, which, args.seq_len, args.batch, key,
                [(None, None)] + (sweep if args.sweep else []))
            for name, op in norms.items():
                for i, phase in enumerate(("forward", "forward+backward")):
                    err = relative_error(jax.jit(op[i])(*norm_inputs),
                                         jax.jit(norms["xla"][i])(*norm_inputs))
                    if not err <= TOLERANCE:
                        raise AssertionError(f"{which} {name}, {phase}: relative error "
                                             f"{err:.3g} > {TOLERANCE}")
                timed(f"{which} {name}", op, norm_inputs, norm_shape)
            print(f"\n| {which} ({norm_shape}) | forward (ms) | forward + backward (ms) |"
                  "\n|---|---|---|")
            by_norm = {(r["what"], r["phase"]): r["ms"] for r in rows}
            for name in norms:
                print(f"| {name} | {by_norm[(f'{which} {name}', 'forward')]:.4f} | "
                      f"{by_norm[(f'{which} {name}', 'forward+backward')]:.4f} |")
    by = {(r["what"], r["phase"]): r["ms"] for r in rows}
    if args.sweep:
        sweep()
    lines = ["| what | forward (ms) | forward + backward (ms) | fwd+bwd vs cuDNN attention |",
             "|---|---|---|---|"]
    attention = by[("cudnn attention", "forward+backward")]
    for what in ("ssd xla", "ssd pallas", "ssd pallas keeps states", "ssd pallas full decays",
                 "cudnn attention"):
        both = by[(what, "forward+backward")]
        lines.append(f"| {what} | {by[(what, 'forward')]:.3f} | {both:.3f} | "
                     f"{both / attention:.2f}x |")
    speedup = by[("ssd xla", "forward+backward")] / by[("ssd pallas", "forward+backward")]
    print(f"\nSSD per layer ({ssd_shape}); pallas fwd+bwd {speedup:.2f}x faster than xla\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
