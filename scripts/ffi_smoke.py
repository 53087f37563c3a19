"""GPU smoke test of the raw `_ffi` handlers (no package needed).

Run on a machine with >= 2 NVLink-connected GPUs after building the extension:

    cmake -S ffi -B build -G Ninja -DPython_EXECUTABLE=$(which python3) \
        -DJFO_CUDA_ARCHITECTURES=90 && cmake --build build
    python3 scripts/ffi_smoke.py [--short]

Checks every fused op against XLA (all_gather / psum_scatter / psum + dot in
f32) under `jax.shard_map` through the FFI contract alone (attributes passed
by hand), runs interleaved back-to-back calls, then tests the wait timeout
(last: it leaves the pair's epochs out of step). Timing lives in
benchmarks/collective_matmul.py. Writes JSON to $OUT (or .).
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# A CMake build in build/ (see above), else the installed package's module.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "build"))
try:
    import _ffi  # noqa: E402
except ImportError:
    from jax_flashoverlap import _ffi  # noqa: E402

for _name, _fn in _ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _fn, platform="CUDA")

AXIS = "x"
DEVICES = jax.devices()[:2]
N = len(DEVICES)
MESH = Mesh(np.array(DEVICES), (AXIS,))
ORDINALS = np.array([d.local_hardware_id for d in DEVICES], np.int32)
TIMEOUT_MS = 10000
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3, jnp.float32: 1e-4}


def _common(timeout_ms=TIMEOUT_MS, ordinals=ORDINALS):
    return dict(group_ordinals=ordinals, n=np.int32(N), timeout_ms=np.int32(timeout_ms))


def ag_order():
    return np.array([[(r + i) % N for i in range(N)] for r in range(N)], np.int32).reshape(-1)


def rs_order():
    return np.array([[(r + 1 + i) % N for i in range(N)] for r in range(N)], np.int32).reshape(-1)


def ar_chunk_rows(m, chunks):
    """Decreasing sizes m/2, m/4, ..., rest (multiples of 16 where possible)."""
    sizes, left = [], m
    for i in range(chunks - 1):
        s = max((m >> (i + 1)) // 16 * 16, 1)
        if s >= left:
            break
        sizes.append(s)
        left -= s
    return np.array(sizes + [left], np.int32)


# Local (per-device) op bodies, used inside shard_map.
def ag_local(x, w, chunks, **kw):
    m, k = x.shape
    out = (
        jax.ShapeDtypeStruct((N * m, w.shape[1]), x.dtype),
        jax.ShapeDtypeStruct((N * m, k), x.dtype),
    )
    return jax.ffi.ffi_call("jfo_all_gather_matmul", out)(
        x, w, order=ag_order(), chunks=np.int32(chunks),
        waits_on_xla_stream=np.int32(0), **_common(**kw)
    )


def rs_local(x, w, chunks, **kw):
    out = jax.ShapeDtypeStruct((x.shape[0] // N, w.shape[1]), x.dtype)
    return jax.ffi.ffi_call("jfo_matmul_reduce_scatter", out)(
        x, w, order=rs_order(), chunks=np.int32(chunks), add_after=np.int32(0),
        waits_on_xla_stream=np.int32(0), **_common(**kw)
    )


def ar_local(x, w, chunks, **kw):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return jax.ffi.ffi_call("jfo_matmul_all_reduce", out)(
        x, w, chunk_rows=ar_chunk_rows(x.shape[0], chunks), **_common(**kw)
    )


def _dot32(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def ag_ref(x, w):
    return _dot32(lax.all_gather(x, AXIS, tiled=True), w)


def rs_ref(x, w):
    return lax.psum_scatter(_dot32(x, w), AXIS, scatter_dimension=0, tiled=True)


def ar_ref(x, w):
    return lax.psum(_dot32(x, w), AXIS)


# Global layouts: AG shards x by rows and w by columns; RS/AR shard the
# contraction dimension K. Each device's y is stacked along rows.
SPECS = {
    "ag": ((P(AXIS), P(None, AXIS)), P(AXIS)),
    "rs": ((P(None, AXIS), P(AXIS)), P(AXIS)),
    "ar": ((P(None, AXIS), P(AXIS)), P(AXIS)),
}
LOCAL = {"ag": ag_local, "rs": rs_local, "ar": ar_local}
REF = {"ag": ag_ref, "rs": rs_ref, "ar": ar_ref}


def smap(f, op, out_specs=None):
    in_specs, default_out = SPECS[op]
    return jax.jit(
        jax.shard_map(
            f,
            mesh=MESH,
            in_specs=in_specs,
            out_specs=default_out if out_specs is None else out_specs,
            check_vma=False,
        )
    )


def global_inputs(op, m, k, n_cols, dtype, seed):
    """Per-device x: AG [m, K]; RS [N*m, K]; AR [m, K]. w: [K, n_cols]."""
    kx, kw = jax.random.split(jax.random.key(seed))
    rows = {"ag": N * m, "rs": N * m, "ar": m}[op]
    xshape = (rows, k) if op == "ag" else (rows, N * k)
    wshape = (k, N * n_cols) if op == "ag" else (N * k, n_cols)
    x = jax.random.normal(kx, xshape, jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, wshape, jnp.float32) / np.sqrt(k)).astype(dtype)
    in_specs = SPECS[op][0]
    return tuple(jax.device_put(a, jax.sharding.NamedSharding(MESH, s))
                 for a, s in zip((x, w), in_specs))


_FNS = {}


def op_fn(op, chunks):
    key = (op, chunks)
    if key not in _FNS:

        def body(x, w):
            out = LOCAL[op](x, w, chunks)
            return out if op == "ag" else (out,)

        outs = (P(AXIS), P(AXIS)) if op == "ag" else (P(AXIS),)
        _FNS[key] = smap(body, op, outs)
    return _FNS[key]


def ref_fn(op):
    if ("ref", op) not in _FNS:
        _FNS[("ref", op)] = smap(REF[op], op)
    return _FNS[("ref", op)]


def check(op, m, k, n_cols, dtype, chunks, seed, results):
    x, w = global_inputs(op, m, k, n_cols, dtype, seed)
    outs = op_fn(op, chunks)(x, w)
    ref = np.asarray(ref_fn(op)(x, w))
    y = np.asarray(outs[0].astype(jnp.float32))
    err = (
        float(np.max(np.abs(y - ref)) / (np.max(np.abs(ref)) + 1e-30))
        if np.all(np.isfinite(y))
        else float("nan")
    )
    ok = err <= TOL[dtype]  # NaN fails
    if op == "ag":  # x_gathered: each device holds the full gathered x
        xg = np.asarray(outs[1].astype(jnp.float32)).reshape(N, N * m, k)
        xfull = np.asarray(x.astype(jnp.float32))
        ok = ok and all(np.array_equal(xg[d], xfull) for d in range(N))
    name = f"{op} {m}x{k}x{n_cols} {jnp.dtype(dtype).name} chunks={chunks}"
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e}", flush=True)
    results.append({"case": name, "ok": bool(ok), "rel_err": err})
    return ok


def test_scale():
    x = jnp.arange(1000, dtype=jnp.float32)
    f = jax.jit(
        lambda x: jax.ffi.ffi_call("jfo_scale", jax.ShapeDtypeStruct(x.shape, x.dtype))(
            x, scale=np.float32(2.5)
        )
    )
    ok = bool(np.allclose(np.asarray(f(jax.device_put(x, DEVICES[0]))), np.asarray(x) * 2.5))
    print(f"  {'ok  ' if ok else 'FAIL'} jfo_scale", flush=True)
    return ok


def correctness(results, short):
    ok = test_scale()
    shapes = [(256, 512, 384), (200, 320, 136), (1024, 1024, 1024), (64, 2048, 256)]
    seed = 0
    for dtype in (jnp.bfloat16, jnp.float32) if short else (jnp.bfloat16, jnp.float16, jnp.float32):
        for m, k, n_cols in shapes[1:2] if short else shapes:
            for op in ("ag", "rs", "ar"):
                for chunks in (1, 3) if dtype != jnp.bfloat16 else (1, 2, 4):
                    seed += 1
                    ok &= check(op, m, k, n_cols, dtype, chunks, seed, results)
    return ok


def back_to_back(results, calls=200):
    """Interleaved ops, fresh data per call; all outputs checked at the end."""
    m, k, n_cols = 512, 1024, 768
    sets = {
        op: [global_inputs(op, m, k, n_cols, jnp.bfloat16, 1000 + 7 * i + j) for i in range(4)]
        for j, op in enumerate(("ag", "rs", "ar"))
    }
    refs = {op: [np.asarray(ref_fn(op)(*s)) for s in sets[op]] for op in sets}
    pending = []
    for i in range(calls):
        op = ("ag", "rs", "ar")[i % 3]
        idx, chunks = (i // 3) % 4, 1 + (i % 4)
        pending.append((op, idx, op_fn(op, chunks)(*sets[op][idx])[0]))
    worst = 0.0
    for op, idx, y in pending:
        y = np.asarray(y.astype(jnp.float32))
        ref = refs[op][idx]
        err = (
            float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
            if np.all(np.isfinite(y))
            else float("inf")
        )
        worst = max(worst, err)
    ok = worst <= TOL[jnp.bfloat16]
    print(
        f"  {'ok  ' if ok else 'FAIL'} {calls} back-to-back interleaved calls: "
        f"worst rel err {worst:.2e}",
        flush=True,
    )
    results.append({"case": f"{calls} back-to-back", "ok": bool(ok), "rel_err": worst})
    return ok


def timeouts(results):
    """Run AG on device 0 alone: its wait for device 1 must time out (NaN
    output, pending_error), the next call must raise, and a fresh group whose
    second member never arrives must fail the rendezvous naming it. Leaves
    the epochs of the pair (0, 1) out of step: run last."""
    x = jax.device_put(jnp.ones((128, 256), jnp.bfloat16), DEVICES[0])
    w = jax.device_put(jnp.ones((256, 128), jnp.bfloat16), DEVICES[0])
    f = jax.jit(lambda x, w: ag_local(x, w, 1, timeout_ms=300)[0])
    t0 = time.perf_counter()
    y = np.asarray(f(x, w).astype(jnp.float32))
    took = time.perf_counter() - t0
    nan_ok = bool(np.all(np.isnan(y)))
    msg = _ffi.pending_error()
    print(
        f"  {'ok  ' if nan_ok and msg else 'FAIL'} timeout after {took * 1e3:.0f} ms: "
        f"all NaN={nan_ok}, pending_error={msg!r}",
        flush=True,
    )
    f(x, w).block_until_ready()  # times out again, leaving a record
    try:
        f(x, w).block_until_ready()
        raised = ""
    except Exception as e:  # noqa: BLE001 - any XLA runtime error will do
        raised = str(e).splitlines()[0][:300]
    print(
        f"  {'ok  ' if 'timed out' in raised else 'FAIL'} next call raised: {raised!r}", flush=True
    )
    g = jax.jit(lambda x, w: ag_local(x, w, 1, timeout_ms=300, ordinals=ORDINALS[::-1].copy())[0])
    try:
        g(x, w).block_until_ready()
        rendezvous = ""
    except Exception as e:  # noqa: BLE001
        rendezvous = str(e).splitlines()[0][:300]
    print(
        f"  {'ok  ' if 'to initialize' in rendezvous else 'FAIL'} rendezvous timeout: "
        f"{rendezvous!r}",
        flush=True,
    )
    ok = nan_ok and bool(msg) and "timed out" in raised and "to initialize" in rendezvous
    results.append(
        {
            "case": "timeouts",
            "ok": ok,
            "pending_error": msg,
            "raised": raised,
            "rendezvous": rendezvous,
        }
    )
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", action="store_true", help="fewer correctness cases")
    args = parser.parse_args()
    start = time.perf_counter()
    print("build_info:", _ffi.build_info(), "devices:", DEVICES, "ordinals:", ORDINALS, flush=True)
    results = []
    print("correctness:", flush=True)
    ok = correctness(results, args.short)
    ok &= back_to_back(results, calls=60 if args.short else 200)
    print(f"checks took {time.perf_counter() - start:.0f} s", flush=True)
    print("timeouts (last: they desynchronise the pair):", flush=True)
    ok &= timeouts(results)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "ffi_smoke.json"), "w") as f:
        json.dump(
            {"ok": bool(ok), "checks": results, "build_info": _ffi.build_info()},
            f,
            indent=1,
        )
    print("ALL OK" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
