"""cuda_policy: the CUDA paths' measured settings and the transport's room."""

import math

import jax
import pytest

from jax_flashoverlap import cuda_policy


def _kernel_accepts(nbytes, workspace_mb, devices):
    """Whether ffi/src/all_reduce.cu takes a bf16 message of nbytes per rank:
    the layout of peer.cu / peer_region.cu and the grid of AllReduceImpl, redone."""
    data = (max(workspace_mb, 64) << 20) - (32 << 20) - (128 << 10)
    region = data // 4 // 256 * 256
    line = 128 * 256
    senders = max(devices - 1, 1)
    # The Lamport slots come first (their size: test_lamport_limit_shrinks_...).
    lamport = senders * 2 * cuda_policy.lamport_max_bytes(devices)
    slot = (region - lamport) // (2 * senders) // line * line
    elements = nbytes // 2
    blocks = min(max(math.ceil(nbytes / (16 << 10)), 1), 128)
    chunk = math.ceil(math.ceil(elements / blocks) / 8) * 8
    return chunk * 2 <= slot // 128


def test_all_reduce_region_bound_is_a_lower_bound_of_the_kernels_limit():
    for workspace_mb in (64, 65, 80, 100, 128, 144, 145, 200, 512, 1024, 4096):
        for devices in range(2, 9):
            bound = cuda_policy.all_reduce_region_bytes(workspace_mb, devices)
            for nbytes in (2, 16 << 10, 64 << 10, 1 << 20, bound // 2, bound):
                if 0 < nbytes <= bound:
                    assert _kernel_accepts(nbytes // 2 * 2, workspace_mb, devices), (
                        workspace_mb, devices, nbytes, bound)
    assert cuda_policy.all_reduce_region_bytes(1024, 2) > 100 << 20  # not needlessly small
    assert cuda_policy.all_reduce_region_bytes(128, 8) == 0  # stripes under 16 KiB


def test_workspace_setting_is_read_like_the_extension_reads_it(monkeypatch):
    monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB", raising=False)
    default = cuda_policy.all_reduce_region_bytes(local_devices=2)
    assert default == cuda_policy.all_reduce_region_bytes(1024, 2)
    monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "2048")
    assert (cuda_policy.all_reduce_region_bytes(local_devices=2)
            == cuda_policy.all_reduce_region_bytes(2048, 2))
    for bad in ("2048MB", "10", "-1", str(1 << 44)):  # no silent 64 MiB, no wrap-around
        monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", bad)
        with pytest.raises(ValueError, match="JAX_FLASHOVERLAP_WORKSPACE_MB.*64 to 1048576"):
            cuda_policy.all_reduce_region_bytes(local_devices=2)


def test_matmul_all_reduce_kernel_by_result_size(monkeypatch):
    monkeypatch.setattr(cuda_policy, "all_reduce_region_bytes", lambda: 120 << 20)
    limit = cuda_policy.MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES
    assert cuda_policy.matmul_all_reduce_kernel(2 << 10) == "gemm_then_all_reduce"
    assert cuda_policy.matmul_all_reduce_kernel(limit) == "gemm_then_all_reduce"
    assert cuda_policy.matmul_all_reduce_kernel(limit + 1) == "fused"
    # A region smaller than the limit (many local GPUs) caps the composed path.
    monkeypatch.setattr(cuda_policy, "all_reduce_region_bytes", lambda: 1 << 20)
    assert cuda_policy.matmul_all_reduce_kernel(2 << 20) == "fused"


@pytest.mark.parametrize("op,shapes,n,want", [
    ("matmul_reduce_scatter", [(2048, 64), (64, 32)], 2, 2),  # 1024 rows per rank
    ("matmul_reduce_scatter", [(2046, 64), (64, 32)], 2, 1),
    ("matmul_reduce_scatter", [(4096, 64), (64, 32)], 4, 1),  # not measured on 4
    ("all_gather_matmul", [(8192, 64), (64, 32)], 2, 2),
    ("all_gather_matmul", [(4096, 64), (64, 32)], 2, 1),
])
def test_collective_matmul_chunks(op, shapes, n, want):
    assert cuda_policy.collective_matmul_chunks(op, shapes, n) == want


def test_process_cuda_devices_asks_the_driver_on_gpus(monkeypatch):
    """The extension sizes its slots by cudaGetDeviceCount, which can exceed
    JAX's local devices; off GPUs (or without a driver) JAX's count stands."""
    count_devices = cuda_policy._driver_device_count.__wrapped__  # uncached
    assert count_devices() == jax.local_device_count()  # CPU backend

    class FakeDriver:
        def cuInit(self, flags):
            return 0

        def cuDeviceGetCount(self, ref):
            ref._obj.value = 8
            return 0

    monkeypatch.setattr(cuda_policy.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cuda_policy.ctypes, "CDLL", lambda name: FakeDriver())
    assert count_devices() == 8

    def no_driver(name):
        raise OSError(name)

    monkeypatch.setattr(cuda_policy.ctypes, "CDLL", no_driver)
    assert count_devices() == jax.local_device_count()


def test_smallest_workspace_lays_out_for_any_device_count():
    """peer.cu / peer_region.cu, redone: at the 64 MiB floor the Lamport slots
    leave room in the all-reduce region, and the control area holds the
    counters, for up to 45 CUDA devices per process."""
    region = ((64 << 20) - (32 << 20) - (128 << 10)) // 4 // 256 * 256
    control_words = ((128 << 10) - (36 << 10)) // 4
    for devices in range(1, 46):
        senders = max(devices - 1, 1)
        assert senders * 2 * cuda_policy.lamport_max_bytes(devices) < region, devices
        assert 4 * 128 * devices + 1 <= control_words, devices


def test_transport_capacity_is_the_extensions_layout():
    # GetOrCreateDevice (ffi/src/transport/peer.cu), redone for 1 GiB and 2 GPUs.
    data = (1024 << 20) - (32 << 20) - (128 << 10)
    rest = data - data // 4 // 256 * 256
    staging = rest // 3 // 256 * 256
    slot = (rest - staging) // 2 // 256 * 256
    assert cuda_policy.transport_capacity(1024, 2) == (slot, staging)
    assert cuda_policy.transport_capacity(4096, 2)[0] > 4 * slot - (1 << 20)
    assert cuda_policy.transport_capacity(1024, 8)[0] < slot
