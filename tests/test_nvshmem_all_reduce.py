"""EXPERIMENTAL NVSHMEM hierarchical all-reduce (jax_flashoverlap.nvshmem).

CPU: the clear errors when the opt-in module was not built (naming the CMake
option) or when ``jax.distributed`` is missing. GPU (marker ``gpu``, and only
where the package was built with ``JFO_ENABLE_NVSHMEM=ON``): two processes
through the launcher, each GPU its own node (recursive doubling) and both in
one node (intra-node reduce-scatter/all-gather), against ``lax.psum``, and
``jax_flashoverlap.all_reduce``'s choice of it (tests/nvshmem_child.py).
"""

import subprocess
import sys
from pathlib import Path

import pytest
from support import child_env

from jax_flashoverlap import nvshmem

CHILD = Path(__file__).with_name("nvshmem_child.py")


def test_initialize_without_the_module_names_the_cmake_option(monkeypatch):
    monkeypatch.setattr(nvshmem, "_load", lambda: (None, "No module named 'x'"))
    with pytest.raises(RuntimeError, match=r"JFO_ENABLE_NVSHMEM=ON"):
        nvshmem.initialize()
    with pytest.raises(RuntimeError, match=r"JFO_ENABLE_NVSHMEM=ON"):
        nvshmem.all_reduce(None, "p")
    assert not nvshmem.is_built()
    assert not nvshmem.is_initialized()


def test_a_node_size_that_does_not_divide_the_processes_is_an_error():
    with pytest.raises(ValueError, match=r"node_size=3 must be in \[1, 8\] and divide the "
                                         r"process count 1"):
        nvshmem.ffi_all_reduce(None, node_size=3)


def test_initialize_without_jax_distributed_names_the_launcher(monkeypatch):
    class FakeModule:
        @staticmethod
        def info():
            return {"initialized": False}

    monkeypatch.setattr(nvshmem, "_load", lambda: (FakeModule, ""))
    with pytest.raises(RuntimeError, match=r"jax\.distributed.*jax_flashoverlap\.cli\.launch"):
        nvshmem.initialize()


@pytest.mark.gpu
@pytest.mark.gpus(2)
@pytest.mark.parametrize("node_size", [1, 2], ids=["each-gpu-its-own-node", "one-node"])
def test_two_processes_match_psum(tmp_path, node_size):
    if not nvshmem.is_built():
        pytest.skip("built without JFO_ENABLE_NVSHMEM=ON")
    # The pytest process may hold most of the GPUs' memory already: no
    # preallocation in the children, so that the NVSHMEM heap fits.
    env = child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(
        [sys.executable, "-m", "jax_flashoverlap.cli.launch", "-n", "2", "--node-size",
         str(node_size), "--timeout", "400", str(CHILD), "512"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=450)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-20000:]
    for rank in range(2):
        assert f"[rank {rank}] NVSHMEM_ALL_REDUCE_OK" in proc.stdout, out[-20000:]
