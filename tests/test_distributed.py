"""jax.distributed set-up, node topology, broadcast_bytes: CPU processes via the launcher."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import slow_unless

import jax_flashoverlap
from jax_flashoverlap import distributed

ROOT = Path(jax_flashoverlap.__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("distributed_child.py")
LAUNCHER_VARS = tuple(distributed.ENV.values())


def test_two_processes_sum_and_broadcast(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "jax_flashoverlap.cli.launch", "--cpu", "-n", "2",
                           "--node-size", "1", "--timeout", "120", str(CHILD)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {}
    for rank in range(2):
        prefix = f"[rank {rank}] "
        out[rank] = dict(line[len(prefix):].split("=", 1) for line in proc.stdout.splitlines()
                         if line.startswith(prefix) and "=" in line)
        assert out[rank]["process"] == f"{rank}/2 local_devices=1"
        assert out[rank]["node"] == f"{rank}/2 in_node=0/1"  # each process its own node
        assert out[rank]["sum"] == "[3.0, 3.0, 3.0, 3.0]"  # 1 + 2
        assert out[rank]["empty"] == "b''"
        assert "disagree on root" in out[rank]["mismatch"]
        assert out[rank]["mismatch"] == ("broadcast_bytes: the processes disagree on root: "
                                         "process 0 has 0, process 1 has 1; every process "
                                         "must use the same values")
        own = "broadcast_bytes: root process 0 must pass bytes, got int"
        assert out[rank]["root_error"] == (f"TypeError: {own}" if rank == 0 else
                                           f"ValueError: broadcast_bytes: process 0 sent "
                                           f"nothing: {own}")
        assert out[rank]["after"] == "b'ok'"
        assert out[rank]["disagree"] == (
            "differ: the processes disagree on heap_mb: process 0 has 1024, process 1 has "
            "1025; every process must use the same values")
    assert out[0]["alone"].startswith("check_same('alone'): process 1 did not arrive within 2 s")
    # The coordinator listens on loopback only (127.0.0.1 as /proc/net/tcp
    # lists it, or as ::ffff:127.0.0.1 in tcp6), never on every interface.
    assert out[0]["listening"] in ("0100007F", "0000000000000000FFFF00000100007F")
    for root in range(2):
        sent = out[root][f"sent{root}"]
        assert len(sent) == 256  # 128 random bytes, hex
        assert out[0][f"got{root}"] == out[1][f"got{root}"] == sent
    assert out[0]["sent0"] != out[1]["sent1"]


def test_initialize_without_launcher_names_it(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not distributed.is_launched()
    with pytest.raises(RuntimeError,
                       match=r"JAX_FLASHOVERLAP_COORDINATOR_ADDRESS.*jax_flashoverlap\.cli\.launch"):
        distributed.initialize()


@pytest.mark.parametrize("n, size, pid, expected", [
    (4, "2", 3, (2, 2, 1, 1)),   # (node_size, num_nodes, node_rank, rank_in_node)
    (4, "1", 2, (1, 4, 2, 0)),
    (4, None, 3, (4, 1, 0, 3)),  # default: all processes one node
])
def test_node_topology(monkeypatch, n, size, pid, expected):
    monkeypatch.setenv("JAX_FLASHOVERLAP_NUM_PROCESSES", str(n))
    monkeypatch.setenv("JAX_FLASHOVERLAP_PROCESS_ID", str(pid))
    if size is None:
        monkeypatch.delenv("JAX_FLASHOVERLAP_NODE_SIZE", raising=False)
    else:
        monkeypatch.setenv("JAX_FLASHOVERLAP_NODE_SIZE", size)
    assert (distributed.node_size(), distributed.num_nodes(), distributed.node_rank(),
            distributed.rank_in_node()) == expected


@pytest.mark.parametrize("size, message", [
    ("3", "JAX_FLASHOVERLAP_NODE_SIZE=3 must be >= 1 and divide the number of processes \\(4\\)"),
    ("0", "JAX_FLASHOVERLAP_NODE_SIZE=0 must be >= 1"),
    ("two", "JAX_FLASHOVERLAP_NODE_SIZE='two' is not an integer"),
])
def test_node_size_validation(monkeypatch, size, message):
    monkeypatch.setenv("JAX_FLASHOVERLAP_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_FLASHOVERLAP_NODE_SIZE", size)
    with pytest.raises(ValueError, match=message):
        distributed.node_size()


def test_a_launcher_variable_by_its_old_name_is_an_error(monkeypatch):
    """A job script that still sets JFO_NODE_SIZE is told the new name, not
    silently treated as one node."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JFO_NODE_SIZE", "2")
    with pytest.raises(RuntimeError, match="JFO_NODE_SIZE is set, but the variable is now named "
                                           "JAX_FLASHOVERLAP_NODE_SIZE: rename it"):
        distributed.node_size()
    # A job started by an older launcher, or a script that sets the old names.
    monkeypatch.setenv("JFO_PROCESS_ID", "0")
    with pytest.raises(RuntimeError, match="JFO_PROCESS_ID is set, but the variable is now named "
                                           "JAX_FLASHOVERLAP_PROCESS_ID"):
        distributed.is_launched()


def test_broadcast_bytes_one_process(rng):
    # The test process is a single-process job: the bytes come straight back.
    data = rng.bytes(128)
    assert distributed.broadcast_bytes(data) == data
    assert distributed.broadcast_bytes(bytearray(data)) == data
    with pytest.raises(ValueError, match="root=1 is not a process index"):
        distributed.broadcast_bytes(data, root=1)
    with pytest.raises(TypeError, match="must pass bytes, got NoneType"):
        distributed.broadcast_bytes(None)
    with pytest.raises(ValueError, match="129 bytes exceed max_bytes=128"):
        distributed.broadcast_bytes(data + b"!", max_bytes=128)


def test_agreeing_needs_jax_distributed():
    """Outside a launched job the key-value store is missing: an error
    naming the launcher, not an attribute error."""
    with pytest.raises(RuntimeError,
                       match=r"check_same\('x'\): jax.distributed is not initialised; start"):
        distributed.check_same("x", {"a": 1})


def test_initialize_outside_the_launcher_says_how_to_launch(monkeypatch):
    for key in distributed.ENV.values():
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError) as e:
        distributed.initialize()
    message = str(e.value)
    assert message.startswith("jax_flashoverlap.distributed.initialize: "), message
    for key in ("coordinator", "process_id", "num_processes"):
        assert distributed.ENV[key] in message, (key, message)
    assert "python -m jax_flashoverlap.cli.launch -n N" in message


def _watched(seconds: float, timeout_s: float) -> subprocess.CompletedProcess:
    """A child that spends ``seconds`` in a call without the GIL (a sleep)
    inside exit_if_stuck(timeout_s), then prints "finished"."""
    code = ("import time; from jax_flashoverlap import distributed\n"
            f"with distributed.exit_if_stuck('the test call', {timeout_s}):\n"
            f"    time.sleep({seconds})\n"
            "print('finished')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_a_stuck_native_call_ends_the_process_with_a_message():
    child = _watched(seconds=60, timeout_s=0.5)
    assert child.returncode == distributed.STUCK_EXIT_STATUS, child.stderr
    assert "the test call did not finish within 0.5 s in process 0" in child.stderr
    assert "finished" not in child.stdout


def test_a_call_that_finishes_in_time_is_left_alone():
    child = _watched(seconds=0.1, timeout_s=30)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "finished"


def test_exit_if_stuck_needs_a_positive_bound():
    with pytest.raises(ValueError, match="timeout_s=0 must be positive"):
        with distributed.exit_if_stuck("x", 0):
            pass


FAILING = Path(__file__).with_name("failing_rank_child.py")


# By default a rank that raises while the other waits in Python; exiting,
# being killed and waiting in a native call are slow (the default's
# test_a_stuck_native_call_ends_the_process_with_a_message ends a native wait).
@pytest.mark.parametrize("how, wait, status, said", slow_unless([
    ("raise", "sleep", 1, "rank 1 exited with code 1"),
], [
    ("raise", "sleep", 1, "rank 1 exited with code 1"),
    ("exit", "sleep", 3, "rank 1 exited with code 3"),
    ("kill", "sleep", 137, "rank 1 was killed by signal SIGKILL"),
    ("raise", "native", 1, "rank 1 exited with code 1"),
]))
def test_a_failing_rank_ends_the_job_within_10_s(tmp_path, how, wait, status, said):
    """With real jax.distributed children: the failing rank exits at once
    (not after the 300 s shutdown barrier), the launcher exits with its
    status and names it, and a rank waiting in Python runs its finally
    blocks on SIGTERM."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "jax_flashoverlap.cli.launch", "--cpu", "-n", "2",
                           "--timeout", "120", str(FAILING), how, wait],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    ended = time.time()
    failed_at = float(next(line.split("failing at ")[1] for line in proc.stdout.splitlines()
                           if "failing at " in line))
    assert proc.returncode == status, proc.stdout + proc.stderr
    first = next(line for line in proc.stderr.splitlines() if line.startswith("[launch]"))
    assert first == f"[launch] {said}; stopping the other ranks"
    assert ended - failed_at < 10, (ended - failed_at, proc.stderr[-3000:])
    if how == "raise":
        assert "[rank 1] RuntimeError: rank 1 gives up" in proc.stderr
    if wait == "sleep":
        assert "[rank 0] cleaned up" in proc.stdout
        assert f"rank 0 exited with code {distributed.TERMINATED_STATUS}" in proc.stderr
