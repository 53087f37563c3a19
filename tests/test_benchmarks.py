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
