"""Groups across the processes of a node (jax_flashoverlap/node_transport.py).

On CPU: the set-up's exchange through jax.distributed between real
processes, with a fake extension (its bounds and messages), the launcher's
shared-GPU layout, and "auto" across processes. On one GPU: the four ops
with impl="cuda" at 2, 4 and 8 ranks, each rank a process sharing the GPU,
injected faults at 2 and 4 ranks (tests/node_ranks_child.py), and NVSHMEM's
all-reduce at 2 and 4 PEs (tests/nvshmem_child.py).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jax_flashoverlap import dispatch, tuning
from jax_flashoverlap.cli import launch

HERE = Path(__file__).resolve().parent


def _launch(tmp_path, n, *args, extra=(), timeout=120, env=None):
    """Runs the launcher; returns (the process, {rank: {key: value}} of its
    ``key=value`` lines). The children import the installed package (with
    its extension) and tests/support.py."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
            "PYTHONPATH": str(HERE)}
    proc = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.cli.launch", "-n", str(n), *extra,
         "--timeout", str(timeout), *args],
        env=base | (env or {}), cwd=tmp_path, capture_output=True, text=True,
        timeout=timeout + 30)
    lines = {}
    for rank in range(n):
        prefix = f"[rank {rank}] "
        lines[rank] = dict(line[len(prefix):].split("=", 1) for line in proc.stdout.splitlines()
                           if line.startswith(prefix) and "=" in line)
    return proc, lines


def _cpu_child(tmp_path, mode):
    return _launch(tmp_path, 2, str(HERE / "node_transport_child.py"), mode, extra=("--cpu",))


def test_every_process_maps_the_others_workspace(tmp_path):
    proc, out = _cpu_child(tmp_path, "exchange")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    labels = ["process 0, CUDA device 0", "process 1, CUDA device 0"]
    for me in range(2):
        layout = json.loads(out[me]["layout"])
        assert layout == {"ids": [0, 1], "node_size": 2, "labels": labels, "spans": True,
                          "local_only": "", "again": True}
        other = 1 - me
        assert json.loads(out[me]["calls"]) == [
            ["configure", 2, [[0, me]], labels],
            ["export", me],
            ["import", other, f"handle of {other}", 1 << 30],
        ]


def test_processes_of_several_gpus_keep_their_groups_to_themselves(tmp_path):
    """Mapping another process's memory into a second GPU of this one is not
    supported: each process keeps the one-process transport (CUDA ordinals),
    and an op over an axis across them says why."""
    proc, out = _cpu_child(tmp_path, "several")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for me in range(2):
        layout = json.loads(out[me]["layout"])
        assert layout["ids"] == [0, 1] and layout["spans"] is False
        assert layout["local_only"] == ("groups across processes need one GPU per process "
                                        "(process 0 has 2, process 1 has 2)")
        assert json.loads(out[me]["calls"]) == []


def test_a_process_that_never_arrives_is_named_within_the_bound(tmp_path):
    proc, out = _cpu_child(tmp_path, "missing")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out[1]["skipped"] == "1"
    assert out[0]["error"].startswith(
        "RuntimeError: node_transport.setup: process 1 did not post its devices within 2 s")
    assert json.loads(out[0]["calls"]) == []  # nothing configured or exported


def test_different_workspaces_are_refused_on_every_process(tmp_path):
    proc, out = _cpu_child(tmp_path, "workspace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for me in range(2):
        assert out[me]["error"] == (
            "ValueError: node_transport.setup: the processes of this node have different "
            "workspaces (process 0: 1024 MiB, process 1: 1025 MiB); set the same "
            "JAX_FLASHOVERLAP_WORKSPACE_MB in every process")
        assert json.loads(out[me]["calls"]) == []


def test_share_gpu_places_ranks_round_robin_with_a_memory_slice():
    env = launch._child_env({}, rank=5, nproc=8, node_size=8, port=1234, gpu="1",
                            pythonpath="", per_gpu=4, mps_dir="/tmp/mps")
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.200"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/mps/pipe"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    alone = launch._child_env({}, rank=0, nproc=2, node_size=2, port=1, gpu="0",
                              pythonpath="")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in alone
    assert "CUDA_MPS_PIPE_DIRECTORY" not in alone


def test_mps_needs_share_gpu(capsys):
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", "--mps", "prog.py"])
    assert "--mps needs --share-gpu and a visible GPU" in capsys.readouterr().err


def test_auto_is_not_decided_by_a_one_process_measurement():
    entry = tuning.Entry("NVIDIA H200", 2, 2, "bfloat16", "all_reduce", 4096, 4096, (4096,),
                         {"xla": 20.0, "cuda": 5.0}, "test")
    table = tuning.Table([entry])
    shapes = [(1, 2048)]
    found, _ = table.lookup("all_reduce", shapes, "bfloat16", 2, "NVIDIA H200", 2, 2)
    assert found == entry
    found, why = table.lookup("all_reduce", shapes, "bfloat16", 2, "NVIDIA H200", 2, 2,
                              processes=2)
    assert found is None
    assert why == "no tuning table for NVIDIA H200 x2 with the axis across 2 processes"


def test_resolve_passes_the_processes_on(monkeypatch):
    entry = tuning.Entry("NVIDIA H200", 2, 2, "bfloat16", "all_reduce", 4096, 4096, (4096,),
                         {"xla": 20.0, "cuda": 5.0}, "test", processes=2)
    monkeypatch.setattr(tuning, "load", lambda: tuning.Table([entry]))
    decision = dispatch.resolve("all_reduce", [(1, 2048)], "bfloat16", 2, platform="cpu",
                                device_kind="NVIDIA H200", devices=2, processes=2)
    assert decision.impl == "xla"  # "cuda" is not a CPU platform's
    assert "measured on NVIDIA H200 x2 in 2 processes" in decision.reason
    one_process = dispatch.resolve("all_reduce", [(1, 2048)], "bfloat16", 2, platform="cpu",
                                   device_kind="NVIDIA H200", devices=2)
    assert (one_process.impl, one_process.reason) == ("xla", "no tuning table for NVIDIA H200 x2")


def _shared_gpu():
    """(whether CUDA MPS runs the ranks side by side, the launcher's flags,
    the children's environment): the ranks as processes sharing the GPU,
    under MPS where the machine has it (without it every wait lasts a time
    slice: the bounds are wider)."""
    mps = shutil.which("nvidia-cuda-mps-control") is not None
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("JAX_FLASHOVERLAP_", "CUDA_", "NCCL_", "NVSHMEM_", "LD_LIBRARY_PATH"))}
    return mps, ["--share-gpu"] + (["--mps"] if mps else []), env


def _gpu_child(tmp_path, n, mode, *args, timeout=540):
    mps, extra, env = _shared_gpu()
    out_dir = Path(os.environ.get("OUT", tmp_path))
    path = out_dir / f"node_ranks_{mode}_{n}.json"
    # A fault's peers wait out the whole bound: short under MPS, where a
    # healthy wait takes microseconds, so that hundreds of faults fit a run.
    wait_ms = (200 if mps else 5000) if mode in ("faults", "mismatch", "killed") else 20000
    env["JAX_FLASHOVERLAP_TIMEOUT_MS"] = str(wait_ms)
    if mode == "mismatch":
        # XLA shares the autotuning of a program's GEMMs between the processes
        # that compile it, and waits for the others: processes that compile
        # different programs wait on each other until the store's deadline.
        env["XLA_FLAGS"] = "--xla_gpu_shard_autotuning=false"
    # JFO_RANKS_SEED: other draws (data, victims, mismatched ranks) than
    # the default seed's, so that repeated runs add new cases.
    seed = ("--seed", os.environ["JFO_RANKS_SEED"]) if os.environ.get("JFO_RANKS_SEED") else ()
    proc, _ = _launch(tmp_path, n, str(HERE / "node_ranks_child.py"), mode, *args, *seed,
                      extra=extra, timeout=timeout, env=env)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "RESULT " in line]
    path.write_text(json.dumps({"timeout_ms": wait_ms, "mps": mps, "ranks": results}, indent=1))
    return proc, results


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_ops_at_n_ranks_sharing_one_gpu(tmp_path, n):
    proc, results = _gpu_child(tmp_path, n, "ops")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(results) == n
    for r in results:
        # 4 ops x 3 dtypes x 2 shapes x 2 calls, each shard against float64.
        assert r["counts"]["checked"] == 48


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_injected_faults_across_processes_end_in_errors_or_nan(tmp_path, n):
    rounds = int(os.environ.get("JFO_FAULT_ROUNDS", "2"))
    proc, results = _gpu_child(tmp_path, n, "faults", "--rounds", str(rounds),
                               "--compile-cache", str(tmp_path / "xla_cache"),
                               timeout=120 + 15 * rounds)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(results) == n
    for r in results:
        assert not any(k.endswith("_wrong") for k in r["counts"]), r["counts"]
    injected = {k: sum(r["counts"].get(f"{k}_injected", 0) for r in results)
                for k in ("error", "skip", "stall")}
    assert injected == {k: 4 * rounds for k in injected}  # 4 ops, one victim a round


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_mismatched_calls_across_processes_end_in_errors_or_nan(tmp_path, n):
    """One rank calls each op on other shapes, or in another dtype, than its
    peers: the call fingerprints differ, so every rank gets an error or NaN,
    and the error names both calls."""
    rounds = int(os.environ.get("JFO_MISMATCH_ROUNDS", "2"))
    proc, results = _gpu_child(tmp_path, n, "mismatch", "--rounds", str(rounds),
                               "--compile-cache", str(tmp_path / "xla_cache"),
                               timeout=120 + 20 * rounds)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(results) == n
    for r in results:
        counts = r["counts"]
        for kind in ("shape", "dtype"):
            assert counts.get(f"{kind}_error", 0) + counts.get(f"{kind}_nan", 0) == 4 * rounds, \
                counts
            assert counts.get(f"{kind}_named", 0) > 0, counts


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_killed_mid_call_ends_the_others_calls_and_the_job(tmp_path, n):
    """The last rank dies (SIGKILL) with a call dispatched: the others' calls
    end in NaN or an error within the bound, and the launcher ends the job
    with that rank's status, naming it."""
    start = time.monotonic()
    proc, out = _gpu_child(tmp_path, n, "killed", timeout=180)
    assert proc.returncode == 128 + 9, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"rank {n - 1} was killed by signal SIGKILL" in proc.stderr + proc.stdout
    outcomes = [line.rsplit("=", 1)[1] for line in proc.stdout.splitlines()
                if "killed outcome=" in line]
    assert len(outcomes) == n - 1 and set(outcomes) <= {"error", "nan"}, outcomes
    assert time.monotonic() - start < 120  # stopped, not waited out


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_nvshmem_all_reduce_with_its_pes_sharing_one_gpu(tmp_path, n):
    """NVSHMEM's hierarchical all-reduce with node size 1 (each PE its own
    node: the recursive doubling between nodes) at n PEs on one GPU, against
    float64, then a call of another size on one PE (tests/nvshmem_child.py
    --shared-gpu --mismatch)."""
    from jax_flashoverlap import nvshmem

    if not nvshmem.is_built():
        pytest.skip("built without JFO_ENABLE_NVSHMEM=ON")
    _, extra, env = _shared_gpu()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # room for the NVSHMEM heaps
    proc, _ = _launch(tmp_path, n, str(HERE / "nvshmem_child.py"), "--shared-gpu", "--mismatch",
                      "256", extra=[*extra, "--node-size", "1"], timeout=300, env=env)
    # The child exits 0 only once every all-reduce matched its reference, and
    # a last one of another size on one PE raised on every PE, naming both calls.
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "NVSHMEM_ALL_REDUCE_OK" in proc.stdout
    outcomes = [line.rsplit(": ", 1)[1] for line in proc.stdout.splitlines()
                if "mismatch pe=" in line]
    assert len(outcomes) == n and "named" in outcomes, outcomes


def test_mps_that_cannot_start_is_an_error_naming_it(monkeypatch):
    def no_daemon(cmd, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(launch, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(launch.subprocess, "run", no_daemon)
    with pytest.raises(SystemExit, match="launch: --mps: could not start "
                                         "nvidia-cuda-mps-control .*; run without --mps"):
        launch.main(["-n", "2", "--share-gpu", "--mps", "prog.py"])
