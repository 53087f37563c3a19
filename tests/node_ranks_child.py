"""One rank of a job whose ranks are processes, run through the launcher
(``--share-gpu``: several ranks on one GPU) by tests/test_node_transport.py.

    python -m jax_flashoverlap.cli.launch -n N --share-gpu [--mps] \\
        tests/node_ranks_child.py ops|faults|mismatch|killed [--rounds R] [--json PATH]

``ops``: the four ops with impl="cuda" over an axis of all N processes, in
three dtypes and odd shapes, on data drawn from one seed in every process,
each shard against its float64 reference. ``faults``: R rounds per kind
(error, skip, stall) of a fault injected into one rank's next call, on
every op: each call returns exact rows or NaN on every rank, or raises,
never a wrong finite number; then a collective reset() and an exact call.
``mismatch``: R rounds per kind (shape, dtype) and op in which one rank
calls the op with other shapes or another dtype than its peers: every rank
gets NaN or an error, never a wrong finite number, and the error names the
two calls. ``killed``: the last rank is killed (SIGKILL) with a call
dispatched and held on its GPU; every other rank's call ends in NaN or an
error, and the launcher stops the job, naming the killed rank.
``--compile-cache DIR`` loads each round's fresh executable from JAX's
persistent cache instead of compiling it again.

Prints one ``RESULT {json}`` line per rank at the end (rank 0 also writes
its own to ``--json``); exits 1 on any wrong number.
NCCL refuses two ranks on one GPU, so nothing here uses XLA's collectives.
"""

import argparse
import collections
import functools
import json
import os
import signal
import sys
import time

from jax_flashoverlap import distributed

distributed.initialize()

import jax  # noqa: E402  (after initialize, which must come first)
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from support import assert_close, case  # noqa: E402

import jax_flashoverlap as jfo  # noqa: E402
from jax_flashoverlap import faults, settings  # noqa: E402

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce")
DTYPES = ("float32", "bfloat16", "float16")
# (rows per rank, batch, k per rank, columns per rank): odd sizes, and one
# large enough for the chunked schedules and the two-shot all-reduce.
SHAPES = ((3, 5, 12, 7), (129, 1, 200, 72))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("ops", "faults", "mismatch", "killed"))
    p.add_argument("--rounds", type=int, default=3, help="faults (or mismatches) per kind and op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--compile-cache", default=None, metavar="DIR")
    return p.parse_args()


def runner(mesh, op, in_specs, out_specs):
    fn = functools.partial(getattr(jfo, op), axis_name="tensor", impl="cuda")
    if op == "all_reduce":
        fn = (lambda f: lambda x: f(x[0]))(fn)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def global_arrays(mesh, args, in_specs):
    """Each process builds its shards of the global operands from the same data."""
    def one(a, spec):
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                            lambda idx: host[idx])
    return [one(a, s) for a, s in zip(args, in_specs)]


def shards(out, expected):
    """(this process's result shard as float64, its part of ``expected``)."""
    return [(np.asarray(s.data, np.float64), expected[s.index]) for s in out.addressable_shards]


def run_ops(mesh, rng, counts):
    n = mesh.size
    for op in OPS:
        for dtype in DTYPES:
            for dims in SHAPES:
                args, in_specs, out_specs, expected = case(op, n, rng, dtype, dims=dims,
                                                           batch=dims[1] > 1)
                f = runner(mesh, op, in_specs, out_specs)
                for _ in range(2):  # a second call on fresh data: no stale message passes
                    got = f(*global_arrays(mesh, args, in_specs))
                    for y, want in shards(got, expected):
                        assert_close(y, want, dtype)
                    counts["checked"] += 1
                    args, _, _, expected = case(op, n, rng, dtype, dims=dims, batch=dims[1] > 1)
                print(f"ok {op} {dtype} dims={dims}", flush=True)


def warm_up(mesh, op, rng):
    """(in_specs, out_specs) of op in float32, after one call of it under a
    wide bound: the node's set-up, cuBLASLt's choice of GEMM algorithm and
    the first launches take a while on some ranks, which a short bound would
    count as a fault. The executable is dropped: its waits keep the wide
    bound, so the rounds compile their own under the configured one."""
    n = mesh.size
    args, in_specs, out_specs, _ = case(op, n, rng, "float32", dims=SHAPES[1], batch=False)
    timeout_ms = settings.get("JAX_FLASHOVERLAP_TIMEOUT_MS")
    os.environ["JAX_FLASHOVERLAP_TIMEOUT_MS"] = "20000"
    f = round_executable(mesh, op, in_specs, out_specs, args, None)
    jax.block_until_ready(f(*global_arrays(mesh, args, in_specs)))
    os.environ["JAX_FLASHOVERLAP_TIMEOUT_MS"] = str(timeout_ms)
    return in_specs, out_specs


def exact_call(mesh, op, rng, in_specs, out_specs, f):
    """One call on fresh data, checked against float64 (after a reset(): that
    it left the transport sound); returns the executable it ran."""
    args, _, _, expected = case(op, mesh.size, rng, "float32", dims=SHAPES[1], batch=False)
    f = round_executable(mesh, op, in_specs, out_specs, args, f)
    for y, want in shards(f(*global_arrays(mesh, args, in_specs)), expected):
        assert_close(y, want, "float32")
    return f


def timed_reset(seconds):
    tick = time.perf_counter()
    jfo.reset()
    seconds["reset"] += time.perf_counter() - tick


def run_faults(mesh, rng, rounds, counts, seconds):
    """Each round: one exact call (which checks the previous round's
    reset()); one fault on a rank every process draws alike; three calls on
    fresh data, each exact, NaN, or an error; a collective reset()."""
    n, me = mesh.size, jax.process_index()
    timeout_ms = int(settings.get("JAX_FLASHOVERLAP_TIMEOUT_MS"))
    for op in OPS:
        (in_specs, out_specs), f = warm_up(mesh, op, rng), None
        for kind in ("error", "skip", "stall"):
            for _ in range(rounds):
                tick = time.perf_counter()
                f = exact_call(mesh, op, rng, in_specs, out_specs, f)
                victim = int(rng.integers(n))
                distributed.check_same("fault round", {"op": op, "kind": kind, "victim": victim})
                if me == victim:
                    faults.inject_fault(kind, device=jax.local_devices()[0], call=1,
                                        stall_ms=3 * timeout_ms)
                counts[f"{kind}_injected"] += me == victim
                seconds["compile_and_exact_call"] += time.perf_counter() - tick
                tick = time.perf_counter()
                outcomes = []
                for _ in range(3):
                    args, _, _, expected = case(op, n, rng, "float32", dims=SHAPES[1],
                                                batch=False)
                    outcomes.append(call_once(f, mesh, args, in_specs, expected))
                    counts[f"{kind}_{outcomes[-1]}"] += 1
                took = time.perf_counter() - tick
                print(f"round {op} {kind} victim={victim}: {' '.join(outcomes)} in {took:.2f} s",
                      flush=True)
                seconds["faulted_calls"] += took
                seconds[f"faulted_calls {op} {kind}"] += took
                timed_reset(seconds)
            print(f"ok faults {op} {kind}", flush=True)
        exact_call(mesh, op, rng, in_specs, out_specs, f)  # the last reset, checked


def run_mismatches(mesh, rng, rounds, counts, seconds):
    """Each round: one exact call (which checks the previous round's
    reset()); one call in which a rank every process draws alike runs the
    op on other shapes (SHAPES[0] against SHAPES[1]) or in bfloat16 against
    float32, each rank on its own fresh data; a collective reset()."""
    n, me = mesh.size, jax.process_index()
    for op in OPS:
        (in_specs, out_specs), f = warm_up(mesh, op, rng), None
        for kind in ("shape", "dtype"):
            for _ in range(rounds):
                tick = time.perf_counter()
                f = exact_call(mesh, op, rng, in_specs, out_specs, f)
                victim = int(rng.integers(n))
                distributed.check_same("mismatch round", {"op": op, "kind": kind,
                                                          "victim": victim})
                usual = case(op, n, rng, "float32", dims=SHAPES[1], batch=False)
                dtype, dims = ("float32", SHAPES[0]) if kind == "shape" else ("bfloat16", SHAPES[1])
                other = case(op, n, rng, dtype, dims=dims, batch=False)
                own_args, _, _, own_expected = other if me == victim else usual
                # Each process compiles its own program: nothing in XLA compares them.
                g = runner(mesh, op, in_specs, out_specs).lower(
                    *global_arrays(mesh, own_args, in_specs)).compile()
                distributed.check_same("mismatched call", {"op": op})
                seconds["compile_and_exact_call"] += time.perf_counter() - tick
                tick = time.perf_counter()
                errors = []
                tolerance = 2e-2 if own_args[0].dtype != np.float32 else 1e-4
                outcome = call_once(g, mesh, own_args, in_specs, own_expected, errors, tolerance)
                counts[f"{kind}_{outcome}"] += 1
                counts[f"{kind}_named"] += any("ran different calls" in e for e in errors)
                print(f"round {op} {kind} victim={victim}: {outcome}", flush=True)
                seconds["mismatched_calls"] += time.perf_counter() - tick
                timed_reset(seconds)
            print(f"ok mismatches {op} {kind}", flush=True)
        exact_call(mesh, op, rng, in_specs, out_specs, f)  # the last reset, checked


def run_killed(mesh, rng, counts):
    """One exact call, then the last rank dies with its next call dispatched
    and held on its GPU (an injected stall far beyond the timeout: without
    it the call can finish before the kill lands, and the others' results are
    exact); the others report that call's outcome and wait to be stopped.
    The launcher's SIGTERM, which comes as soon as it sees the killed rank,
    is held off until the outcome is printed."""
    n, me = mesh.size, jax.process_index()
    op = "all_gather_matmul"
    (in_specs, out_specs), f = warm_up(mesh, op, rng), None
    f = exact_call(mesh, op, rng, in_specs, out_specs, f)
    args, _, _, expected = case(op, n, rng, "float32", dims=SHAPES[1], batch=False)
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    distributed.check_same("killed round", {"op": op})
    if me == n - 1:
        timeout_ms = int(settings.get("JAX_FLASHOVERLAP_TIMEOUT_MS"))
        faults.inject_fault("stall", device=jax.local_devices()[0], stall_ms=20 * timeout_ms)
        f(*global_arrays(mesh, args, in_specs))  # dispatched, not waited for
        os.kill(os.getpid(), signal.SIGKILL)
    outcome = call_once(f, mesh, args, in_specs, expected)
    counts[f"killed_{outcome}"] += 1
    print(f"killed outcome={outcome}", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stopped:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)  # the launcher stops this rank once it sees the killed one


def round_executable(mesh, op, in_specs, out_specs, args, previous):
    """``previous``, or a new executable where there is none or for the ops
    XLA captures into a command buffer (it does not run one again after
    its execution failed). Then every process waits for the others: no
    rank's first call starts late enough to time out on its own."""
    if previous is None or op in ("all_reduce", "matmul_all_reduce"):
        previous = runner(mesh, op, in_specs, out_specs).lower(
            *global_arrays(mesh, args, in_specs)).compile()
    distributed.check_same("round start", {"op": op})
    return previous


def call_once(f, mesh, args, in_specs, expected, errors=None, tolerance=1e-4) -> str:
    """"exact", "nan" (every inexact row holds a NaN), "error" (raised, its
    message appended to ``errors``), or "wrong" (a finite row off its
    reference by more than ``tolerance`` of its scale: the outcome that
    must never be)."""
    try:
        got = shards(f(*global_arrays(mesh, args, in_specs)), expected)
        jfo.check_device_errors()
    except (jax.errors.JaxRuntimeError, RuntimeError) as e:
        if errors is not None:
            errors.append(str(e))
        return "error"
    outcome = "exact"
    for y, want in got:
        rows, ref = y.reshape(-1, y.shape[-1]), want.reshape(-1, want.shape[-1])
        finite = ~np.isnan(rows).any(axis=-1)
        if not finite.all():
            outcome = "nan"
        scale = max(np.abs(ref).max(), 1e-30)
        if (np.abs(rows[finite] - ref[finite]) > tolerance * scale).any():
            return "wrong"
    return outcome


def main():
    args = parse_args()
    n, me = jax.process_count(), jax.process_index()
    mesh = Mesh(np.asarray(jax.devices()), ("tensor",))
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", f"{args.compile_cache}/{me}")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    rng = np.random.default_rng(args.seed)  # the same draws in every process
    counts, seconds = collections.Counter(), collections.Counter()
    start = time.perf_counter()
    if args.mode == "ops":
        run_ops(mesh, rng, counts)
    elif args.mode == "faults":
        run_faults(mesh, rng, args.rounds, counts, seconds)
    elif args.mode == "mismatch":
        run_mismatches(mesh, rng, args.rounds, counts, seconds)
    else:
        run_killed(mesh, rng, counts)
    result = {"mode": args.mode, "ranks": n, "rank": me, "seconds": time.perf_counter() - start,
              "counts": dict(counts),
              "phase_seconds": {k: round(v, 3) for k, v in seconds.items()}}
    print("RESULT " + json.dumps(result), flush=True)
    if args.json and me == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(k.endswith("_wrong") for k in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
