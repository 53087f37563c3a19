"""The benchmark scripts' plumbing on CPUs (their numbers come from the GPU machine)."""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jax_flashoverlap
from jax_flashoverlap import benchmarking

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ROOT = Path(jax_flashoverlap.__file__).resolve().parents[1]


def _load(name, folder=BENCHMARKS):
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(folder))


@pytest.mark.slow  # two processes through the launcher
def test_hierarchical_benchmark_runs_in_two_processes(tmp_path):
    """psum only (no NVSHMEM build on CPUs), each process its own node."""
    out = tmp_path / "h.json"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.cli.launch", "--cpu", "-n", "2", "--node-size",
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
    xla_waits = {"PEER_WAIT_STREAM": "xla"}
    tile_signalled = {"ALL_GATHER_GEMM": "tile_signalled",
                      "REDUCE_SCATTER_GEMM": "tile_signalled",
                      "MATMUL_ALL_REDUCE_GEMM": "tile_signalled"}
    cases = [("matmul_all_reduce", "cuda_fused", None, fused),
             ("matmul_all_reduce", "cuda_chunks2", 2, fused),
             ("matmul_reduce_scatter", "cuda_chunks4", 4, {}),
             ("matmul_reduce_scatter", "cuda_add_after", None, add_after),
             ("matmul_reduce_scatter", "cuda_add_after_chunks2", 2, add_after),
             ("all_gather_matmul", "cuda_xla_waits", None, xla_waits),
             ("matmul_reduce_scatter", "cuda_xla_waits_chunks2", 2, xla_waits),
             ("all_gather_matmul", "cuda_tile_signalled", None, tile_signalled),
             ("matmul_reduce_scatter", "cuda_tile_signalled", None, tile_signalled),
             ("matmul_all_reduce", "cuda_tile_signalled", None, {**fused, **tile_signalled}),
             ("matmul_all_reduce", "cuda_part_align8", None,
              {**fused, "MATMUL_ALL_REDUCE_PART_ALIGN": 8}),
             ("all_gather_matmul", "cuda", None, {}),
             ("matmul_all_reduce", "cuda", None, {})]  # what users get: no override
    for op, impl, chunks, overrides in cases:
        fn, got = bench._op_fn(op, impl)
        assert fn.keywords["impl"] == "cuda", (op, impl, fn.keywords)
        assert fn.keywords.get("chunks") == chunks, (op, impl, fn.keywords)
        assert got == overrides, (op, impl, got)
    assert bench._op_fn("all_gather_matmul", "cuda_fused") is None
    assert bench._op_fn("matmul_all_reduce", "cuda_add_after") is None
    assert bench._op_fn("matmul_all_reduce", "cuda_xla_waits") is None
    assert bench._op_fn("matmul_reduce_scatter", "cuda_part_align8") is None


def test_policy_overrides_are_restored():
    bench = _load("collective_matmul")
    from jax_flashoverlap import cuda_policy
    before = cuda_policy.REDUCE_SCATTER_FOLD
    with bench._policy_overrides({"REDUCE_SCATTER_FOLD": "add_after"}):
        assert cuda_policy.REDUCE_SCATTER_FOLD == "add_after"
    assert cuda_policy.REDUCE_SCATTER_FOLD == before


def _synthetic_trace(path):
    """Two GPUs' processes as the profiler names them, kernels on stream threads."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 8, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 7, "tid": 13, "name": "thread_name",
         "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 8, "tid": 13, "name": "thread_name",
         "args": {"name": "Stream #13(Compute)"}},
    ]
    kernels = [("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 100.0),
               ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 60.0),
               ("void jfo::internal::WaitFlagKernel(unsigned int const*, unsigned int)", 30.0),
               ("MemcpyP2P", 20.0), ("loop_add_fusion", 8.0),
               ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 4.0)]
    events = meta + [{"ph": "X", "pid": 7, "tid": 13, "ts": i, "dur": d, "name": n}
                     for i, (n, d) in enumerate(kernels)]
    events += [{"ph": "X", "pid": 7, "tid": 2, "ts": 0, "dur": 500.0,
                "name": "jax_flashoverlap_matmul_reduce_scatter.1"},
               {"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 900.0, "name": "PjitFunction"},
               {"ph": "X", "pid": 8, "tid": 13, "ts": 0, "dur": 50.0, "name": "nvjet_x"}]
    import gzip
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)


def test_kernel_times_reads_stream_threads_of_each_gpu(tmp_path):
    kt = _load("kernel_times")
    _synthetic_trace(tmp_path / "plugins" / "profile" / "run")
    per_device = kt.device_kernels(kt.load_events(tmp_path))
    assert sorted(per_device) == [0, 1]
    assert len(per_device[0]) == 6 and per_device[1] == [("nvjet_x", 0.0, 50.0)]
    summary = kt.summarize(per_device[0], iterations=2)
    assert summary["gemm"]["us"] == 80.0 and summary["gemm"]["count"] == 1
    assert summary["jfo"]["us"] == 15.0
    assert summary["copy"]["us"] == 10.0
    assert summary["nccl"]["us"] == 2.0 and summary["other"]["us"] == 4.0
    assert "| gemm | 80.0 | 1 |" in kt.table(summary)
    gemms = [("a_gemm", 0.0, 1.0), ("b_gemm", 1.0, 3.0), ("c_gemm", 4.0, 2.0)]
    assert kt.summarize(gemms, top=2)["gemm"]["top"] == [("b_gemm", 3.0), ("c_gemm", 2.0)]


def test_kernel_times_occupancy_leaves_out_peer_waits_and_overlaps():
    kt = _load("kernel_times")
    kernels = [("gemm", 0.0, 10.0), ("MemcpyP2P", 5.0, 10.0),  # overlapping: busy 0-15
               ("void jfo::internal::WaitFlagKernel(unsigned int const*)", 15.0, 20.0),
               ("loop_add_fusion", 25.0, 5.0), ("gemm", 36.0, 4.0)]  # idle 15-25, 30-36
    o = kt.occupancy(kernels, iterations=2)
    assert o == {"span_us": 20.0, "busy_us": 12.0, "idle_fraction": 0.4}


def test_kernel_times_categories():
    kt = _load("kernel_times")
    assert kt.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert kt.category("gemm_fusion_dot_general_3") == "gemm"
    assert kt.category("void jfo::(anonymous namespace)::AddIntoKernel<__nv_bfloat16>()") \
        == "jfo"
    assert kt.category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kt.category("MemcpyD2D") == "copy"
    assert kt.category("input_reduce_fusion") == "other"


def test_kernel_times_on_a_trace_without_gpus_says_so(tmp_path):
    import jax
    import jax.numpy as jnp
    kt = _load("kernel_times")
    f = jax.jit(lambda a: (a @ a).sum())
    kt.trace_loop(f, [jnp.ones((64, 64))], tmp_path)
    with pytest.raises(SystemExit, match="no GPU kernels"):
        kt.main(["trace", str(tmp_path)])


def test_kernel_times_ops_mode_runs_up_to_the_trace():
    """On CPUs the loop compiles, runs and is traced; the trace has no GPU."""
    kt = _load("kernel_times")
    with pytest.raises(SystemExit, match="no GPU kernels"):
        kt.main(["ops", "--ops", "matmul_reduce_scatter", "--shapes", "16x32x8",
                 "--iterations", "2", "--devices", "2", "--impl", "xla"])


def test_dot_in_row_blocks_is_the_dot_and_keeps_its_blocks():
    import jax
    import jax.numpy as jnp
    import numpy as np
    kt = _load("kernel_times")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((12, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    f = jax.jit(kt.dot_in_row_blocks(4))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    text = f.lower(x, w).as_text()
    assert text.count("dot_general") == 4
    # Each block after the first enters through a barrier with the dot before it.
    assert text.count("optimization_barrier") == 3


def test_gemm_blocks_follow_the_ops_chunks():
    kt, bench = _load("kernel_times"), _load("collective_matmul")
    rs_shapes, ag_shapes = [(4096, 64), (64, 8)], [(1024, 64), (64, 8)]

    def blocks(op, impl, shapes):
        return kt.gemm_blocks(op, *bench._op_fn(op, impl), shapes, 2)

    assert blocks("matmul_reduce_scatter", "cuda_chunks3", rs_shapes) == 6
    assert blocks("matmul_reduce_scatter", "cuda", rs_shapes) == 4
    assert blocks("all_gather_matmul", "cuda", ag_shapes) == 2
    assert blocks("matmul_all_reduce", "cuda", ag_shapes) is None
    assert blocks("matmul_reduce_scatter", "cuda_xla_waits", rs_shapes) == 4
    assert blocks("matmul_reduce_scatter", "xla", rs_shapes) is None
    assert blocks("matmul_reduce_scatter", "cuda_add_after", rs_shapes) is None


def test_all_reduce_benchmark_checks_and_times_the_transfer_row():
    """The "transfer" row is checked against the input two ranks back, then timed."""
    bench = _load("all_reduce")
    rows, n = bench.run([4096, 16384], ["xla", "transfer"], ["loop"], reps=1, devices=4)
    assert n == 4
    assert sorted((r["size_bytes"], r["impl"]) for r in rows) == [
        (4096, "transfer"), (4096, "xla"), (16384, "transfer"), (16384, "xla")]
    assert all(r["us"] > 0 for r in rows)
    assert "transfer µs" in bench.table(rows, n, "loop")


def test_all_reduce_benchmark_rejects_a_wrong_transfer(monkeypatch):
    bench = _load("all_reduce")
    from jax import lax

    def one_step(x, n):  # the data one rank back, not two
        return lax.ppermute(x[:x.shape[0] * (n - 1) // n], "tp",
                            [(i, (i + 1) % n) for i in range(n)])
    monkeypatch.setattr(bench, "_transfer", one_step)
    with pytest.raises(SystemExit, match="the input two ranks back"):
        bench.run([4096], ["transfer"], ["loop"], reps=1, devices=4)


@pytest.mark.slow  # a benchmark run
def test_train_step_benchmark_records_host_dispatch(tmp_path, capsys):
    """A tiny model on the CPUs: every row has a dispatch time within its step time."""
    bench = _load("train_step")
    out = tmp_path / "t.json"
    assert bench.main(["--json", str(out), "--models", "transformer", "--impls", "xla",
                       "--size", "tiny", "--seq-len", "64", "--warmup", "1", "--steps", "20",
                       "--reps", "3", "--dtype", "float32"]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["protocol"] == "jax_flashoverlap/benchmarking.py (module docstring)"
    assert result["meta"]["settings"]["size"] == "tiny" and result["meta"]["date"]
    (row,) = result["rows"]
    assert row["dispatch_ms"] > 0 and row["step_ms_from_idle"] > 0
    assert row["first_call_ms"] > 0
    assert math.isfinite(row["step_ms"]) and row["step_ms_min"] <= row["step_ms_max"]
    printed = capsys.readouterr().out
    assert "host dispatch (ms)" in printed and "first call (ms)" in printed


def test_train_step_measures_each_mamba_variant_against_the_first(monkeypatch, capsys):
    """--mamba-variants default residuals=all: two Mamba-2 rows (the Transformer
    runs once), each named by its kernels and flags, the second's speed-up
    against the first's step."""
    bench = _load("train_step")
    step_ms = {("transformer", "default"): 100.0, ("mamba", "default"): 300.0,
               ("mamba", "residuals=all"): 240.0}

    def fake_measure(model, impl, variant, args):
        return {"model": model, "params": 1e9, "impl": impl, "dtype": "bfloat16",
                "attention": "cudnn" if model == "transformer" else None,
                "ssd": "pallas" if model == "mamba" else None,
                "conv": args.conv if model == "mamba" else None, "variant": variant,
                "step_ms": step_ms[model, variant], "step_ms_min": 1.0, "step_ms_max": 1.0,
                "step_ms_from_idle": 1.0, "dispatch_ms": 1.0, "first_call_ms": 1.0,
                "tokens_per_s": 1.0, "mfu": None, "loss_first": 5.0}
    monkeypatch.setattr(bench, "_measure", fake_measure)
    assert bench.main(["--models", "transformer", "mamba", "--impls", "xla",
                       "--mamba-variants", "default", "residuals=all"]) == 0
    table = capsys.readouterr().out.split("MFU vs")[-1]
    assert "| transformer | 1,000.0M | xla | cudnn |" in table
    assert "| mamba | 1,000.0M | xla | ssd pallas, conv auto | 300.0" in table
    assert "| mamba | 1,000.0M | xla | ssd pallas, conv auto, residuals=all | 240.0" in table
    assert table.rstrip().endswith("| 1.250x |")


@pytest.mark.slow  # a benchmark run
def test_train_step_passes_a_variants_flags_to_the_trainer(tmp_path, monkeypatch):
    """A variant's flags reach the trainer's config (a tiny Mamba-2 on the CPUs).
    Two-step runs on busy CPUs can time T(4) < T(2): the timing is another
    test's, so the step time here is fixed."""
    bench = _load("train_step")
    monkeypatch.setattr(bench, "step_times", lambda runs, k: ([0.01], 0.01, 0.001))
    out = tmp_path / "t.json"
    assert bench.main(["--json", str(out), "--models", "mamba", "--impls", "xla",
                       "--size", "tiny", "--seq-len", "64", "--warmup", "1", "--steps", "2",
                       "--reps", "1", "--dtype", "float32", "--mamba-variants", "default",
                       "residuals=all,norm-backward=recompute,no-fuse-skip,ssd-tiles=16x16,"
                       "ssd-warps=8,ssd-stages=2"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["residuals"], r["norm_backward"], r["fuse_skip"]) for r in rows] == [
        ("named", "auto", True), ("all", "recompute", False)]
    assert [r["ssd_tiling"] for r in rows] == [
        dict(block=None, block_cols=None, num_warps=None, num_stages=None),
        dict(block=16, block_cols=16, num_warps=8, num_stages=2)]
    assert rows[0]["loss_first"] == pytest.approx(rows[1]["loss_first"], rel=1e-5)


def test_train_step_times_are_the_difference_of_two_run_lengths():
    """A run pays 30 ms once (an empty queue) and 10 ms per step: the difference
    finds the 10, T(k) / k does not."""
    bench = _load("train_step")
    k = 5
    runs = [((0.030 + k * 0.010, 0.02), (0.030 + 2 * k * 0.010, 0.06)),
            ((0.032 + k * 0.011, 0.02), (0.032 + 2 * k * 0.011, 0.08))]
    per_step, from_idle, dispatch = bench.step_times(runs, k)
    assert per_step == pytest.approx([0.010, 0.011])
    assert from_idle == pytest.approx((0.080 + 0.087) / 2 / k)
    assert dispatch == pytest.approx((0.006 + 0.008) / 2)


@pytest.mark.slow  # a benchmark run
def test_decode_benchmark_checks_times_and_records_provenance(tmp_path, capsys):
    """Tiny models on the CPUs: each row is checked against the forward pass,
    timed by the difference of two loop lengths, and the JSON says where it
    came from."""
    bench = _load("decode")
    out = tmp_path / "d.json"
    assert bench.main(["--json", str(out), "--size", "tiny", "--mesh",
                       "1x2", "--impls", "xla", "decomposed", "--decode-matmuls", "xla",
                       "--decode-mixers", "xla", "--batches", "2",
                       "--contexts", "32", "--steps", "2", "6", "--reps", "2"]) == 0
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["protocol"].startswith("jax_flashoverlap/benchmarking.py")
    assert meta["date"] and meta["settings"]["steps"] == [2, 6] and "commit" in meta
    rows = result["rows"]
    assert [(r["model"], r["impl"]) for r in rows] == [
        ("transformer", "xla"), ("transformer", "decomposed"), ("mamba", "xla"),
        ("mamba", "decomposed")]
    for r in rows:
        assert r["check_error"] < 1e-4  # float32 on CPUs
        assert r["weight_bytes"] > 0 and r["cache_bytes"] > 0 and r["hbm_floor_ms"] > 0
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
    assert {r["decode_attention"] for r in rows} == {"model"}
    assert [r["decode_mixer"] for r in rows] == [None, None, "xla", "xla"]
    out = capsys.readouterr().out
    assert "| transformer | decomposed | xla | model | – | 2 | 32 |" in out
    assert "| mamba | decomposed | xla | model | xla | 2 | 32 |" in out


@pytest.mark.slow  # a benchmark run
def test_decode_benchmark_measures_a_resolved_step_once(tmp_path, capsys):
    """--decode-blocks auto layers where "auto" runs the layers (the CPUs):
    one row, and the second choice says which row it would repeat."""
    bench = _load("decode")
    out = tmp_path / "d.json"
    assert bench.main(["--json", str(out), "--size", "tiny", "--mesh", "1x1", "--models",
                       "transformer", "--impls", "xla", "--decode-blocks", "auto", "layers",
                       "--batches", "1", "--contexts", "16", "--steps", "1", "2",
                       "--reps", "1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["decode_blocks"] for r in rows] == ["layers"]
    assert "(decode_blocks 'layers' ran 'layers'), not measured again" in capsys.readouterr().out


def test_decode_benchmark_sets_and_restores_the_one_row_padding():
    bench = _load("decode")
    module = bench._decode_matmul_module
    default = module.ONE_ROW_PAD_BELOW
    with bench.one_row_pad_set(1 << 40):
        assert module.ONE_ROW_PAD_BELOW == 1 << 40
    with bench.one_row_pad_set(None):
        assert module.ONE_ROW_PAD_BELOW == default
    assert module.ONE_ROW_PAD_BELOW == default
    assert bench._matmul_label({"decode_matmul": "xla", "one_row_pad_below": 1000}) == \
        "xla, padded below 1,000"
    assert bench._matmul_label({"decode_matmul": "cuda"}) == "cuda"


@pytest.mark.slow  # a benchmark run
def test_decode_benchmark_sweeps_xla_options_in_one_process(tmp_path, capsys):
    """--xla-option-sets: one row per set, each compiled with its options
    (on the CPUs, an option of the CPU compiler), labelled in the table."""
    bench = _load("decode")
    out = tmp_path / "d.json"
    assert bench.main(["--json", str(out), "--size", "tiny", "--mesh", "1x1", "--models",
                       "transformer", "--impls", "xla", "--batches", "1", "--contexts", "16",
                       "--steps", "1", "2", "--reps", "1", "--xla-option-sets", "default",
                       "xla_cpu_enable_fast_math=true"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["xla_option_set"] for r in rows] == [{}, {"xla_cpu_enable_fast_math": True}]
    assert "| transformer | xla, xla_cpu_enable_fast_math=True | xla |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--xla-option-sets", "no_value"])


@pytest.mark.slow  # a benchmark run
def test_decode_benchmark_keeps_bfloat16_parameters_on_request(tmp_path):
    """--param-dtype bfloat16: the rows say so, pass the check against the
    float32 forward pass, and read the weights of a float32-kept model."""
    bench = _load("decode")
    rows = {}
    for stored in ("float32", "bfloat16"):
        out = tmp_path / f"{stored}.json"
        assert bench.main(["--json", str(out), "--size", "tiny", "--mesh", "1x1", "--models",
                           "transformer", "mamba", "--impls", "xla", "--batches", "1",
                           "--contexts", "16", "--steps", "1", "2", "--reps", "1",
                           "--dtype", "bfloat16", "--param-dtype", stored]) == 0
        rows[stored] = json.loads(out.read_text())["rows"]
    for wide, narrow in zip(rows["float32"], rows["bfloat16"], strict=True):
        assert (wide["param_dtype"], narrow["param_dtype"]) == ("float32", "bfloat16")
        assert narrow["weight_bytes"] == wide["weight_bytes"]


def test_decode_benchmark_sets_and_restores_the_attention_kernel_settings():
    bench = _load("decode")
    kernel = bench.models.decode_attention_pallas
    default = kernel.MIN_SPLIT_POSITIONS
    with bench.split_positions_set(64):
        assert kernel.MIN_SPLIT_POSITIONS == 64
    with bench.split_positions_set(None):
        assert kernel.MIN_SPLIT_POSITIONS == default
    assert kernel.MIN_SPLIT_POSITIONS == default
    assert bench._attention_label({"decode_attention": "pallas", "split_positions": 64}) == \
        "pallas, splits of 64+"
    assert bench._attention_label({"decode_attention": "model"}) == "model"
    packed = kernel.PACKED_INPUTS
    with bench.packed_inputs_set(not packed):
        assert kernel.PACKED_INPUTS is (not packed)
    assert kernel.PACKED_INPUTS is packed
    assert bench._attention_label({"decode_attention": "pallas", "split_positions": 64,
                                   "packed_inputs": True}) == "pallas, splits of 64+, packed"


@pytest.mark.slow  # a benchmark run
def test_decode_benchmark_traces_each_case_afresh(monkeypatch):
    """Two cases of one model and shape: the second traces the decode step
    again, so that what a case sets while tracing (the all-reduce algorithm
    forced, the split positions) is not the first case's."""
    bench = _load("decode")
    traced = []
    decode_step = bench.models.Transformer.decode_step

    def counting(self, *args):
        traced.append(1)
        return decode_step(self, *args)
    monkeypatch.setattr(bench.models.Transformer, "decode_step", counting)
    mesh = bench.train.make_mesh((1, 1), bench.models.ShardingConfig())
    model = bench.build_model("transformer", "tiny", "xla", mesh, None, "auto")
    args = argparse.Namespace(steps=(1, 2), xla_options={}, reps=1, profile=None, size="tiny",
                              hbm_tb_s=bench.HBM_TB_S)
    case = bench.Case("transformer", "xla", "xla", "model", "layers", None, None, None, None, (),
                      1, 16)
    counts = []
    for _ in range(2):
        traced.clear()
        with jax.set_mesh(mesh):
            bench.measure(model, None, case, args, np.random.default_rng(0))
        counts.append(len(traced))
    assert counts[0] > 0 and counts[1] == counts[0], counts


def test_decode_benchmark_rejects_a_wrong_decode(monkeypatch):
    """A decode loop whose logits are not the forward pass's fails the check."""
    bench = _load("decode")
    generate = bench.models.Generator.__call__

    def perturbed(self, prompt, rng=None):
        tokens, logits = generate(self, prompt, rng)
        return tokens, None if logits is None else logits * 1.01
    monkeypatch.setattr(bench.models.Generator, "__call__", perturbed)
    with pytest.raises(AssertionError, match="decode logits differ from the float32 forward pass"):
        bench.main(["--size", "tiny", "--mesh", "1x1", "--models", "mamba", "--impls", "xla",
                    "--batches", "1", "--contexts", "16", "--steps", "1", "2", "--reps", "1"])


@pytest.mark.parametrize("tied", [False, True])
def test_decode_floor_counts_weights_and_the_cache(tied):
    """One GPU's bytes per step: the decoding weights (bf16 matrices, f32
    vectors, the embedding table left out unless it is the LM head, which
    has its size) and the keys and values read."""
    import jax
    from flax import nnx
    from support import cpu_mesh

    from jax_flashoverlap import models

    bench = _load("decode")
    config = models.TransformerConfig.preset("tiny", dtype="bfloat16", tie_embeddings=tied)
    mesh = cpu_mesh(tp=2)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: models.Transformer(config, rngs=nnx.Rngs(0)))()
        generator = models.Generator(model, batch=1, prompt_len=16, max_new_tokens=9)
        weights, cache = bench.floor_bytes(generator, (4, 8))
    d, f, h, kv, layers = (config.embed_dim, config.mlp_dim, config.head_dim,
                           config.num_kv_heads, config.num_layers)
    q = config.num_heads
    matrices = layers * (d * (q + 2 * kv) * h + q * h * d + 3 * d * f) // 2 + d * 256
    vectors = (2 * layers + 1) * d
    assert weights == 2 * matrices + 4 * vectors
    # Step i attends prompt_len + i + 1 positions; the timed steps are 4 .. 7.
    assert cache == int(2 * layers * (kv // 2) * h * 2 * (16 + 1 + (4 + 5 + 6 + 7) / 4))


@pytest.mark.parametrize("contexts", [["8"], ["32", "33"]])
def test_decode_benchmark_refuses_contexts_it_cannot_check(contexts, capsys):
    """The check generates from context - 8 tokens and runs the forward pass
    over the context, which the tensor axis splits: refused before any run."""
    bench = _load("decode")
    with pytest.raises(SystemExit):
        bench.main(["--mesh", "1x2", "--contexts", *contexts])
    assert "--contexts: each must exceed 8 and divide by the tensor axis (2)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("kind, tb_s", [("NVIDIA H200", 4.8), ("NVIDIA H100 80GB HBM3", 3.35),
                                         ("NVIDIA H100 PCIe", 2.0), ("NVIDIA H100 NVL", 3.9),
                                         ("NVIDIA A100-SXM4-80GB", 2.039),
                                         ("NVIDIA GeForce RTX 4090", None)])
def test_hbm_bandwidth_by_device_kind(kind, tb_s):
    assert benchmarking.hbm_tb_s(kind) == tb_s


class _Device:
    platform = "gpu"

    def __init__(self, kind):
        self.device_kind = kind


def test_decode_floor_takes_the_gpus_own_bandwidth(monkeypatch, capsys):
    """The floor divides by the GPU's datasheet bandwidth, or by
    --hbm-tb-s; a GPU without a known figure is an error naming the flag."""
    bench = _load("decode")
    parser = argparse.ArgumentParser()
    assert bench.floor_bandwidth(2.5, parser) == (2.5, "--hbm-tb-s")
    tb_s, source = bench.floor_bandwidth(None, parser)  # the CPUs
    assert tb_s == 4.8 and "nominal on cpu" in source
    monkeypatch.setattr(bench.jax, "devices", lambda: [_Device("NVIDIA H100 80GB HBM3")])
    assert bench.floor_bandwidth(None, parser) == (3.35, "the NVIDIA H100 80GB HBM3 datasheet")
    monkeypatch.setattr(bench.jax, "devices", lambda: [_Device("NVIDIA L4")])
    with pytest.raises(SystemExit):
        bench.floor_bandwidth(None, parser)
    assert "'NVIDIA L4': pass --hbm-tb-s" in capsys.readouterr().err


@pytest.mark.slow  # two processes through the launcher
def test_generate_command_runs_in_two_processes(tmp_path):
    """The launcher's 2 CPU processes, the tensor axis across them."""
    out = tmp_path / "g.json"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.cli.launch", "--cpu", "-n", "2", "--timeout",
         "240", "-m", "jax_flashoverlap.cli.generate", "--mesh", "1x2", "--prompt", "Hello",
         "--max-new-tokens", "4", "--json", str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["mesh"] == "1x2" and result["new_tokens"] == 4 and len(result["texts"]) == 1
    assert "[rank 0] time to first token" in proc.stdout


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce"])
def test_collective_matmul_rows_are_checked_against_an_independent_reference(op, monkeypatch):
    """Every row, "xla" included, is compared with plain einsums of the global
    operands; an impl that computes something else stops the run."""
    bench = _load("collective_matmul")
    rows = bench.run([op], [(8, 16, 8)], ["xla", "decomposed"], reps=1, devices=4)
    assert {r["impl"] for r in rows} == {"xla", "decomposed", "gemm", "comm"}

    def wrong(op_, impl):
        fn, overrides = real(op_, impl)
        return (lambda x, w: 2 * fn(x, w)), overrides

    real = bench._op_fn
    monkeypatch.setattr(bench, "_op_fn", wrong)
    with pytest.raises(SystemExit, match=f"{op} xla 8x16x8: rel err"):
        bench.run([op], [(8, 16, 8)], ["xla"], reps=1, devices=4)


def test_collective_matmul_interleaved_rows_pair_each_impl_with_xla(monkeypatch):
    """--interleaved times the plain impls in one rotating call; each row's
    vs_xla is the median of its per-repetition ratio to xla (xla's own is 1),
    the GEMM alone and the collective alone are timed apart."""
    bench = _load("collective_matmul")
    import jax_flashoverlap.benchmarking as benchmarking
    calls = []
    real = benchmarking.time_interleaved

    def spy(ops, *args, **kwargs):
        calls.append(sorted(ops))
        return real(ops, *args, **kwargs)

    monkeypatch.setattr(benchmarking, "time_interleaved", spy)
    rows = bench.run(["matmul_reduce_scatter"], [(8, 16, 8)],
                     ["xla", "decomposed", "auto"], reps=3, devices=2,
                     interleaved=True)
    assert calls == [["auto", "decomposed", "xla"], ["op"], ["op"]]  # then gemm, comm
    by = {r["impl"]: r for r in rows}
    assert by["xla"]["vs_xla"] == 1.0
    assert by["decomposed"]["vs_xla"] > 0
    assert "vs_xla" not in by["gemm"] and "vs_xla" not in by["comm"]
    assert "| auto/xla interleaved |" in bench.table(rows)


def test_train_step_speedups_need_the_same_first_loss_as_xla():
    bench = _load("train_step")
    xla = {"model": "transformer", "impl": "xla", "loss_first": 5.5, "dtype": "bfloat16"}
    bench._check_against_xla(dict(xla, impl="cuda", loss_first=5.55), [xla])  # 0.9%: rounding
    with pytest.raises(SystemExit, match="impl=cuda: first-step loss 5.7 differs from xla's"):
        bench._check_against_xla(dict(xla, impl="cuda", loss_first=5.7), [xla])


def _probe_result(path, options, step_us):
    rows = [{"options": o, "chunk_bytes": 32768, "ring_slots": 0, "per_step_us": us}
            for o, us in zip(options, step_us)]
    path.write_text(json.dumps({"meta": {"commit": "a77344b", "settings": {
        "options": list(options), "json": str(path)}}, "rows": rows}))


def test_decode_ab_summary_keeps_every_build_and_compares_with_the_first(tmp_path, capsys):
    summary = _load("decode_ab_summary", SCRIPTS)
    for name, built in (("main", "a77344b; sm_90"), ("cap", "a77344b with cap.patch; sm_90")):
        (tmp_path / f"pkg_{name}").mkdir()
        (tmp_path / f"pkg_{name}" / "AB_BUILD.txt").write_text(built + "\n")
    for r, (main_us, cap_us) in enumerate(((700.0, (714.0, 770.0)), (710.0, (720.0, 781.0))), 1):
        _probe_result(tmp_path / f"main_{r}.json", [93], [main_us])
        _probe_result(tmp_path / f"cap_{r}.json", [93, 4189], list(cap_us))

    summary.main([str(tmp_path), "2", str(tmp_path), "main", "cap"])

    result = json.loads((tmp_path / "decode_ab.json").read_text())
    assert [(row["build"], row["round"], row["options"]) for row in result["rows"]] == [
        ("main", 1, 93), ("cap", 1, 93), ("cap", 1, 4189),
        ("main", 2, 93), ("cap", 2, 93), ("cap", 2, 4189)]
    assert [row["order"] for row in result["rows"]] == [1, 2, 3, 4, 5, 6]
    meta = result["meta"]
    assert meta["builds"] == {"main": "a77344b; sm_90", "cap": "a77344b with cap.patch; sm_90"}
    assert meta["settings_by_build"]["cap"]["options"] == [93, 4189]
    assert meta["settings_by_build"]["main"]["options"] == [93]
    assert all("json" not in s for s in meta["settings_by_build"].values())
    lines = capsys.readouterr().out.splitlines()
    # Same settings: against main's row; the patch's own options: against
    # main's one row of that round.
    assert "| 1 | 93, 32768, 0 | 700.0 (1.000) | 714.0 (1.020) |" in lines
    assert "| 1 | 4189, 32768, 0 | - | 770.0 (1.100) |" in lines
    assert "| 2 | 4189, 32768, 0 | - | 781.0 (1.100) |" in lines
    # Rows in numeric order of their settings within a round (93 before 4189).
    assert lines.index("| 1 | 93, 32768, 0 | 700.0 (1.000) | 714.0 (1.020) |") < lines.index(
        "| 1 | 4189, 32768, 0 | - | 770.0 (1.100) |")


def test_decode_ab_summary_notes_the_processes_that_wrote_no_rows(tmp_path):
    summary = _load("decode_ab_summary", SCRIPTS)
    for name in ("main", "cap"):
        (tmp_path / f"pkg_{name}").mkdir()
        (tmp_path / f"pkg_{name}" / "AB_BUILD.txt").write_text(f"a77344b {name}; sm_90\n")
    _probe_result(tmp_path / "main_1.json", [93], [700.0])
    _probe_result(tmp_path / "cap_1.json", [93], [714.0])
    _probe_result(tmp_path / "main_2.json", [93], [710.0])

    result = summary.collect(str(tmp_path), 2, str(tmp_path), ["main", "cap"])

    assert [(row["build"], row["round"]) for row in result["rows"]] == [
        ("main", 1), ("cap", 1), ("main", 2)]
    assert result["meta"]["note"].endswith("; no rows from cap in round 2")


def test_decode_ab_run_names_the_missing_build(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPTS / "decode_ab.sh"), "run", "no_such_build"],
                          env=dict(os.environ, OUT=str(tmp_path)),  # not /tmp/jfo_out
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "build/pkg_no_such_build is missing: bash scripts/decode_ab.sh build" in proc.stderr


@pytest.mark.slow  # a benchmark run
def test_decode_benchmark_takes_a_checkpoints_shape(tmp_path, capsys):
    """--config DIR: the checkpoint's shape (its vocabulary, heads) on random
    weights, its rows named after it."""
    bench = _load("decode")
    out = tmp_path / "d.json"
    config = Path(__file__).with_name("data") / "llama" / "gqa_untied"
    assert bench.main(["--json", str(out), "--config", str(config), "--mesh", "1x2",
                       "--impls", "xla", "--batches", "2", "--contexts", "32",
                       "--steps", "2", "6", "--reps", "2"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["size"]) for r in rows] == [("transformer", str(config))]
    assert rows[0]["check_error"] < 1e-4


def test_the_mamba_probe_times_a_layer_from_its_median_cta_start():
    """A CTA that starts a layer early (no item in the layer before's last
    stages) moves no point; a CTA that never passes a point is not in it."""
    probe = _load("mamba_decode_probe", SCRIPTS)
    events = ("layer_start", "normed", "done_ns")
    # [layer_start, normed, done_ns, thread 0 issuing, thread 32 waiting] a CTA
    layer = np.array([[1000, 9000, 100, 1000, 2000], [5000, 8000, 200, 1000, 2000],
                      [5000, 0, 300, 1000, 2000], [7000, 10000, 400, 1000, 2000]], np.int64)
    later = layer.copy()
    later[:, :2] += np.where(layer[:, :2] > 0, 40000, 0)  # the same layer 40 us on
    timeline = probe.timeline_of(np.stack([layer, later]), events)
    assert timeline == {"done_us": 0.25, "issue_us": 1.0, "warp1_copy_wait_us": 2.0,
                        "layer_start": (2.0, 0.0), "normed": (5.0, 4.0), "layer_us": 40.0}
