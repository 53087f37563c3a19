"""The benchmark scripts' plumbing on CPUs (their numbers come from the GPU machine)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax_flashoverlap

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ROOT = Path(jax_flashoverlap.__file__).resolve().parents[1]


def _load(name):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_hierarchical_benchmark_runs_in_two_processes(tmp_path):
    """psum only (no NVSHMEM build on CPUs), each process its own node."""
    out = tmp_path / "h.json"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.launch", "--cpu", "-n", "2", "--node-size",
         "1", "--timeout", "240", str(BENCHMARKS / "hierarchical_all_reduce.py"),
         "--impls", "xla", "--sizes", "4096", "--modes", "loop", "--reps", "2",
         "--json", str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["meta"]["processes"] == 2 and result["meta"]["node_size"] == 1
    assert [(r["size_bytes"], r["impl"], r["mode"]) for r in result["rows"]] == [
        (4096, "xla", "loop")]
    assert "| 4 KiB |" in proc.stdout


def test_hierarchical_table_ratios():
    bench = _load("hierarchical_all_reduce")
    rows = [dict(size_bytes=4096, impl="nvshmem", mode="loop", us=6.0),
            dict(size_bytes=4096, impl="xla", mode="loop", us=18.0)]
    single = [dict(size_bytes=4096, impl="two_shot", mode="loop", us=4.0)]
    line = bench.table(rows, 2, 1, "loop", single).splitlines()[-1]
    assert line.startswith("| 4 KiB | 6.0 | 18.0 | 3.00 | 1.50 |"), line


def test_collective_matmul_cuda_rows_run_the_cuda_kernels():
    """Every "cuda_*" row times impl="cuda" (an earlier version timed "auto"
    for "cuda_fused", which picked XLA on some shapes), with its overrides."""
    bench = _load("collective_matmul")
    fused = {"MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES": -1}
    add_after = {"REDUCE_SCATTER_FOLD": "add_after"}
    cases = [("matmul_all_reduce", "cuda_fused", None, fused),
             ("matmul_all_reduce", "cuda_chunks2", 2, fused),
             ("matmul_reduce_scatter", "cuda_chunks4", 4, {}),
             ("matmul_reduce_scatter", "cuda_add_after", None, add_after),
             ("matmul_reduce_scatter", "cuda_add_after_chunks2", 2, add_after),
             ("all_gather_matmul", "cuda", None, {})]
    for op, impl, chunks, overrides in cases:
        fn, got = bench._op_fn(op, impl)
        assert fn.keywords["impl"] == "cuda", (op, impl, fn.keywords)
        assert fn.keywords.get("chunks") == chunks, (op, impl, fn.keywords)
        assert got == overrides, (op, impl, got)
    assert bench._op_fn("all_gather_matmul", "cuda_fused") is None
    assert bench._op_fn("matmul_all_reduce", "cuda_add_after") is None


def test_dispatch_overrides_are_restored():
    bench = _load("collective_matmul")
    from jax_flashoverlap import dispatch
    before = dispatch.REDUCE_SCATTER_FOLD
    with bench._dispatch_overrides({"REDUCE_SCATTER_FOLD": "add_after"}):
        assert dispatch.REDUCE_SCATTER_FOLD == "add_after"
    assert dispatch.REDUCE_SCATTER_FOLD == before
