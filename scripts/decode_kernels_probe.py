"""Probe: which kernels would bring the one-GPU decode step closer to the HBM floor?

    python3 scripts/decode_kernels_probe.py [gemm|attention] [ROWS ...]   # $OUT/...json

The 1B Transformer's decode step spent 608 µs per token in its 64 weight
GEMMs (~3.3 TB/s) and 130 µs in cuDNN's attention at batch 1, context 512
(benchmarks/results/decode_profile_1xh200.txt). This times, with the
project's in-graph protocol (benchmarking.time_per_op):

- the 16 layers' weight GEMMs as the decode step chains them, with XLA's
  Triton GEMM fusions (default) against cuBLAS (``xla_gpu_enable_triton_gemm``
  off) and the library's decode kernel (``decode_matmul(impl="cuda")``),
  next to the time the weights take to stream at 4.8 TB/s;
- the attention over a 16-layer stack of KV caches: cuDNN (the model's
  default), jax's Pallas flash-decoding kernel (``pallas.ops.gpu.decode_attention.gqa``)
  and XLA's einsums, each checked against a float32 reference first.
"""

import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import decode_attention
from jax.sharding import PartitionSpec as P

from jax_flashoverlap import benchmarking
from jax_flashoverlap.decode_matmul import TILE_COLUMNS, _kernel_dot, _xla_dot

LAYERS, D, HEADS, KV, H, F = 16, 2048, 16, 8, 128, 8192
HBM = benchmarking.H200_HBM_TB_S * 1e12


def gemm_chain(x, *weights, dot=_xla_dot):
    """The decode step's weight GEMMs of LAYERS layers, x: [m, D]."""
    for wqkv, wo, wgu, wd in zip(*(iter(weights),) * 4):
        a = dot(x, wqkv)[:, :D]
        h = x + dot(a, wo)
        g = dot(h, wgu)
        x = h + dot(jax.nn.silu(g[:, :F]) * g[:, F:], wd)
    return x


def attention(impl, q, caches, length):
    """LAYERS dependent attentions: q [b, HEADS, H], caches [(k, v) [b, KV, L, H]]."""
    for k, v in caches:
        b = q.shape[0]
        if impl == "cudnn":
            out = jax.nn.dot_product_attention(
                q[:, None], k.swapaxes(1, 2), v.swapaxes(1, 2), implementation="cudnn",
                key_value_seq_lengths=jnp.full((b,), length, jnp.int32))[:, 0]
        elif impl.startswith("pallas"):
            splits = int(impl.split(":")[1]) if ":" in impl else 16
            out = decode_attention.gqa(q, k.swapaxes(1, 2), v.swapaxes(1, 2),
                                       kv_seq_len=jnp.full((b,), length, jnp.int32),
                                       k_splits=splits)
        else:
            qg = q.reshape(b, KV, -1, H)
            s = jnp.einsum("bgqh,bglh->bgql", qg, k, preferred_element_type=jnp.float32)
            s = jnp.where(jnp.arange(k.shape[2]) < length, s / math.sqrt(H), -jnp.inf)
            p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
            out = jnp.einsum("bgql,bglh->bgqh", p, v).reshape(b, HEADS, H)
        q = out.astype(q.dtype)
    return q


def reference_chain(x, weights):
    """gemm_chain in float64 numpy (on the bf16 inputs)."""
    x = np.asarray(x, np.float64)
    for wqkv, wo, wgu, wd in zip(*(iter(np.asarray(w, np.float64) for w in weights),) * 4):
        h = x + (x @ wqkv)[:, :D] @ wo
        g = h @ wgu
        x = h + (g[:, :F] / (1 + np.exp(-g[:, :F])) * g[:, F:]) @ wd
    return x


def reference_attention(q, k, v, length):
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    b = q.shape[0]
    qg = q.reshape(b, KV, -1, H)
    s = np.einsum("bgqh,bglh->bgql", qg, k[:, :, :length]) / math.sqrt(H)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bgql,bglh->bgqh", p, v[:, :, :length]).reshape(b, HEADS, H)


def main():
    out = os.environ.get("OUT", "/tmp")
    mesh = benchmarking.first_devices_mesh(1)
    rng = np.random.default_rng(0)
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    shapes = [(D, (HEADS + 2 * KV) * H), (HEADS * H, D), (D, 2 * F), (F, D)]
    # Scaled by 1/K, the residual stream stays near its input's size over the layers.
    weights = [jnp.asarray(rng.standard_normal(s, np.float32) / s[0], jnp.bfloat16)
               for _ in range(LAYERS) for s in shapes]
    weight_bytes = sum(w.size * 2 for w in weights)
    options = {"triton": None, "cublas": {"xla_gpu_enable_triton_gemm": False},
               **{f"jfo{tile}": None for tile in TILE_COLUMNS}}

    def kernel(tile):  # decode_matmul(impl="cuda")'s kernel with a tile width
        return lambda x, w: _kernel_dot(x.reshape(-1, x.shape[-1]), w, tile).reshape(
            *x.shape[:-1], w.shape[1])
    row_counts = [int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 4, 8]
    for m in row_counts if "attention" not in sys.argv[1:] else ():
        x = jnp.asarray(rng.standard_normal((m, D), np.float32), jnp.bfloat16)
        args = [x, *weights]
        specs = (P(),) * len(args)
        want = reference_chain(x, weights)
        for name, opts in options.items():
            chain = (functools.partial(gemm_chain, dot=kernel(int(name[3:])))
                     if name.startswith("jfo") else gemm_chain)
            fn = jax.jit(chain)
            got = fn.lower(*args).compile(opts)(*args) if opts else fn(*args)
            err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) /
                        np.max(np.abs(want)))
            t = benchmarking.time_per_op(chain, args, mesh=mesh, in_specs=specs,
                                         k1=2, k2=6, reps=5, compiler_options=opts)
            record({"kind": "gemm", "rows": m, "gemm": name, "us": t.median_us,
                    "floor_us": weight_bytes / HBM * 1e6,
                    "tb_s": weight_bytes / t.median_s / 1e12, "rel_err_vs_float64": err})

    attention_cases = ((1, 512), (8, 512), (1, 4096), (32, 512))
    for b, length in attention_cases if "gemm" not in sys.argv[1:] else ():
        q = jnp.asarray(rng.standard_normal((b, HEADS, H), np.float32), jnp.bfloat16)
        caches = [tuple(jnp.asarray(rng.standard_normal((b, KV, length, H), np.float32),
                                    jnp.bfloat16) for _ in range(2)) for _ in range(LAYERS)]
        flat = [q] + [t for kv in caches for t in kv]
        cache_bytes = sum(t.size * 2 for t in flat[1:])
        for impl in ("cudnn", "pallas", "pallas:8", "pallas:32", "xla"):
            def op(q, *flat, impl=impl, length=length):
                return attention(impl, q, list(zip(flat[::2], flat[1::2])), length)
            try:
                got = jax.jit(functools.partial(op, impl=impl, length=length))(q, *caches[0])
                err = float(np.max(np.abs(np.asarray(got, np.float64)
                                          - reference_attention(q, *caches[0], length))))
                t = benchmarking.time_per_op(op, flat, mesh=mesh, in_specs=(P(),) * len(flat),
                                             k1=2, k2=6, reps=5)
                record({"kind": "attention", "batch": b, "context": length, "impl": impl,
                        "us_16_layers": t.median_us, "max_abs_err": err,
                        "floor_us": cache_bytes / HBM * 1e6})
            except Exception as e:  # noqa: BLE001 - a probe reports what fails
                record({"kind": "attention", "batch": b, "context": length, "impl": impl,
                        "error": f"{type(e).__name__}: {str(e)[:300]}"})

    meta = benchmarking.provenance({"probe": "decode kernels"})
    with open(os.path.join(out, "decode_kernels_probe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
