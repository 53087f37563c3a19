"""The launcher, with plain-Python children (no jax, so each run takes well under a second)."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import jax_flashoverlap
from jax_flashoverlap.cli import launch

# Where the package under test lives: the launcher must find it from there.
ROOT = Path(jax_flashoverlap.__file__).resolve().parents[1]


def run_launch(args, tmp_path, *, env_extra=None, cwd=None, pythonpath=True, timeout=60):
    """Runs the launcher in a fresh interpreter; returns (CompletedProcess, seconds)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    env.update(env_extra or {})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jax_flashoverlap.cli.launch", *args],
                          env=env, cwd=cwd or tmp_path, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def script(tmp_path, body, name="child.py"):
    path = tmp_path / name
    path.write_text("import os, signal, sys, time\n"
                    "rank = int(os.environ['JAX_FLASHOVERLAP_PROCESS_ID'])\n"
                    + textwrap.dedent(body))
    return str(path)


def lines_of(text, rank):
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_environment_prefixes_and_arguments(tmp_path):
    names = (list(launch.ENV.values()) + list(launch.FORCED_ENV) + list(launch.LOOPBACK_ENV)
             + ["XLA_FLAGS", "JAX_PLATFORMS"])
    child = script(tmp_path, f"""
        for name in {names!r}:
            print(f"{{name}}={{os.environ.get(name)}}")
        print("argv=" + " ".join(sys.argv[1:]))
        print("on stderr", file=sys.stderr)
    """)
    proc, _ = run_launch(["--cpu", "-n", "2", "--node-size", "1", child, "-n", "5", "--x"],
                         tmp_path, env_extra={
                             "NCCL_NVLS_ENABLE": "1",  # must be forced back to 0
                             "NCCL_SOCKET_IFNAME": "eth7",  # a caller's interface is kept
                             "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --a=1"})
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        got = dict(line.split("=", 1) for line in lines_of(proc.stdout, rank))
        port = got["JAX_FLASHOVERLAP_COORDINATOR_ADDRESS"].split(":")[1]
        assert got["JAX_FLASHOVERLAP_COORDINATOR_ADDRESS"] == f"127.0.0.1:{port}"
        assert tuple(got[f"JAX_FLASHOVERLAP_{name}"] for name in (
            "PROCESS_ID", "NUM_PROCESSES", "LOCAL_RANK", "LOCAL_SIZE", "NODE_SIZE")) == (
                str(rank), "2", str(rank), "2", "1")
        assert got["JAX_FLASHOVERLAP_PLATFORM"] == "cpu" and got["JAX_PLATFORMS"] == "cpu"
        assert (got["NCCL_NVLS_ENABLE"], got["NVSHMEM_DISABLE_NVLS"],
                got["TORCH_SYMM_MEM_DISABLE_MULTICAST"]) == ("0", "1", "1")
        # Bootstrap sockets on loopback unless the caller named an interface.
        assert (got["NCCL_SOCKET_IFNAME"], got["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"]) == (
            "eth7", "lo")
        assert got["XLA_FLAGS"] == "--a=1"  # one CPU device per process
        assert got["argv"] == "-n 5 --x"  # the program's options stay the program's
        assert lines_of(proc.stderr, rank) == ["on stderr"]
    ports = {line.split(":")[-1] for line in proc.stdout.splitlines() if "COORD" in line}
    assert len(ports) == 1


def test_gpu_mode_gives_each_process_one_gpu(tmp_path):
    # No GPU needed: the children only print what they were given.
    child = script(tmp_path, """
        print(os.environ["CUDA_VISIBLE_DEVICES"], os.environ["JAX_FLASHOVERLAP_PLATFORM"])
    """)
    proc, _ = run_launch(["-n", "2", child], tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": "5,7"})
    assert proc.returncode == 0, proc.stderr
    assert lines_of(proc.stdout, 0) == ["5 gpu"] and lines_of(proc.stdout, 1) == ["7 gpu"]

    proc, _ = run_launch(["-n", "3", child], tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": "5,7"})
    assert proc.returncode == 2 and "only 2 GPUs visible" in proc.stderr


def test_module_mode_and_package_found_through_parent_path(tmp_path):
    # The parent finds the package only through its working directory (no
    # PYTHONPATH); the children must get that path from it.
    (tmp_path / "mod.py").write_text(textwrap.dedent("""
        import sys
        import jax_flashoverlap.cli.launch
        print("module", sys.argv[1:])
    """))
    child = script(tmp_path, "import jax_flashoverlap.cli.launch\nprint('found')\n")
    proc, _ = run_launch(["--cpu", "-n", "2", child], tmp_path, cwd=ROOT, pythonpath=False)
    assert proc.returncode == 0, proc.stderr
    assert lines_of(proc.stdout, 0) == lines_of(proc.stdout, 1) == ["found"]

    proc, _ = run_launch(["--cpu", "-n", "1", "-m", "mod", "-n", "7"], tmp_path,
                         env_extra={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert proc.returncode == 0, proc.stderr
    assert lines_of(proc.stdout, 0) == ["module ['-n', '7']"]


def test_failing_rank_stops_the_others(tmp_path):
    child = script(tmp_path, """
        if rank == 1:
            time.sleep(1.0)
            sys.exit(3)
        def on_term(signum, frame):
            print("got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        time.sleep(60)
        print("finished")
    """)
    proc, seconds = run_launch(["--cpu", "-n", "2", child], tmp_path)
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr
    assert lines_of(proc.stdout, 0) == ["got SIGTERM"]
    assert seconds < 10


def test_sigkill_after_grace_and_killed_rank(tmp_path):
    child = script(tmp_path, """
        if rank == 1:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """)
    proc, seconds = run_launch(["--cpu", "-n", "2", "--grace", "0.5", child], tmp_path)
    assert proc.returncode == 128 + 9
    assert "rank 1 was killed by signal SIGKILL" in proc.stderr
    assert "ignored SIGTERM" in proc.stderr
    assert "rank 0 was killed by signal SIGKILL" in proc.stderr
    assert seconds < 10


def test_timeout_kills_a_hung_run(tmp_path):
    child = script(tmp_path, "time.sleep(60)\n")
    proc, seconds = run_launch(["--cpu", "-n", "2", "--timeout", "1", child], tmp_path)
    assert proc.returncode == 124
    assert "timed out after 1 s" in proc.stderr
    assert "rank 0 was killed by signal SIGTERM" in proc.stderr
    assert seconds < 10


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "--node-size", "3", "x.py"], "--node-size 3 must be >= 1 and divide -n 2"),
    (["-n", "4", "--node-size", "0", "x.py"], "--node-size 0 must be >= 1 and divide -n 4"),
    (["-n", "0", "x.py"], "-n must be at least 1"),
    (["--nproc", "0", "x.py"], "-n must be at least 1"),
    (["-n", "2"], "missing the program"),
])
def test_bad_arguments(tmp_path, args, message):
    proc, _ = run_launch(["--cpu", *args], tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_visible_gpus(tmp_path, monkeypatch):
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: H200 (UUID: a)'\n"
                    "echo '  MIG 1g.18gb Device 0: (UUID: m)'\necho 'GPU 1: H200 (UUID: b)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launch.visible_gpus({}) == ["0", "1"]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert launch.visible_gpus({}) == []
