"""impl="auto": the measured rule, and "xla" wherever nothing was measured."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashoverlap import _extension, dispatch


@pytest.fixture
def cuda_built(monkeypatch):
    monkeypatch.setattr(_extension, "cuda_ops_available", lambda target=None: True)


H200 = {"platform": "cuda", "device_kind": "NVIDIA H200", "devices": 2}


@pytest.mark.parametrize("op,shapes,dtype,n,want", [
    # The shipped table (tables/nvidia_h200_x2.json, from the committed results).
    ("all_gather_matmul", [(1024, 4096), (4096, 4096)], "bfloat16", 2, "cuda"),
    ("all_gather_matmul", [(256, 8192), (8192, 8192)], "bfloat16", 2, "cuda"),
    ("all_gather_matmul", [(128, 8192), (8192, 8192)], "bfloat16", 2, "xla"),  # measured
    ("all_gather_matmul", [(64, 8192), (8192, 8192)], "bfloat16", 2, "xla"),  # below all
    ("all_gather_matmul", [(16384, 4096), (4096, 8192)], "bfloat16", 2, "cuda"),  # above all
    ("all_gather_matmul", [(4096, 8192), (8192, 4096)], "float16", 2, "cuda"),  # bf16's
    ("all_gather_matmul", [(4096, 8192), (8192, 4096)], "float32", 2, "xla"),  # untuned
    ("all_gather_matmul", [(4096, 8192), (8192, 4096)], "bfloat16", 4, "xla"),  # untuned
    ("matmul_all_reduce", [(128, 8192), (8192, 8192)], "bfloat16", 2, "cuda"),
    ("matmul_all_reduce", [(256, 8192), (8192, 8192)], "bfloat16", 2, "xla"),
    ("matmul_all_reduce", [(2048, 8192), (8192, 7168)], "bfloat16", 2, "cuda"),
    ("matmul_reduce_scatter", [(256, 8192), (8192, 8192)], "bfloat16", 2, "xla"),
    ("matmul_reduce_scatter", [(2048, 4096), (4096, 4096)], "bfloat16", 2, "cuda"),
    ("all_reduce", [(1, 2048)], "bfloat16", 2, "cuda"),
    ("all_reduce", [(1, 512)], "bfloat16", 2, "xla"),  # 1 KiB: below the smallest
    ("all_reduce", [(1024, 1 << 20)], "bfloat16", 2, "xla"),  # 2 GiB: over the region
])
def test_shipped_table(cuda_built, op, shapes, dtype, n, want, monkeypatch):
    monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB", raising=False)
    monkeypatch.setattr(dispatch, "process_cuda_devices", lambda: 2)
    assert dispatch.resolve(op, shapes, dtype, n, **H200).impl == want


def test_every_shipped_entry_resolves_to_its_fastest(cuda_built, monkeypatch):
    from jax_flashoverlap import tuning

    monkeypatch.setattr(dispatch, "process_cuda_devices", lambda: 2)
    entries = [e for e in tuning.load().entries if e.device_kind == "NVIDIA H200"]
    assert len(entries) >= 20
    for e in entries:
        itemsize = np.dtype(e.dtype).itemsize
        shapes = ([(1, e.shape[0] // itemsize)] if e.op == "all_reduce" else
                  [(e.shape[0] * (2 if e.op == "matmul_reduce_scatter" else 1), e.shape[1]),
                   e.shape[1:]])
        assert tuning.rows_per_rank(e.op, shapes, 2, itemsize) == e.rows
        got = dispatch.resolve(e.op, shapes, e.dtype, 2, **H200)
        assert got.impl == min(e.times_us, key=e.times_us.get), (e, got)
        assert e.source in got.reason


@pytest.mark.parametrize("chunks,want", [(None, "cuda"), (2, "cuda"), (1, "xla"), (3, "xla")])
def test_auto_reduce_scatter_only_with_the_measured_chunks(cuda_built, chunks, want):
    shapes = [(4096, 8192), (8192, 4096)]
    got = dispatch.resolve("matmul_reduce_scatter", shapes, "bfloat16", 2, chunks=chunks,
                           **H200)
    assert got.impl == want
    if want == "xla":
        assert f"chunks={chunks} differs" in got.reason


def test_prefer_xla_leaves_the_named_ops_to_xla_inside_the_context(cuda_built):
    def impl(op, shapes):
        return dispatch.resolve(op, shapes, "bfloat16", 2, **H200).impl

    rs = ("matmul_reduce_scatter", [(8192, 2048), (2048, 2048)])
    ag = ("all_gather_matmul", [(4096, 2048), (2048, 5152)])
    assert impl(*rs) == impl(*ag) == "cuda"
    with dispatch.prefer_xla(["matmul_reduce_scatter"]):
        assert impl(*rs) == "xla"
        assert impl(*ag) == "cuda"
        with dispatch.prefer_xla(["all_gather_matmul"]):  # nested: both
            assert impl(*rs) == impl(*ag) == "xla"
        assert impl(*ag) == "cuda"
    assert impl(*rs) == "cuda"


def test_prefer_xla_names_the_ops_it_knows():
    with pytest.raises(ValueError, match=r"unknown ops \['matmul_reducescatter'\].*"
                                         r"matmul_reduce_scatter"):
        with dispatch.prefer_xla(["matmul_reducescatter"]):
            pass


def test_never_cuda_when_not_built(monkeypatch):
    monkeypatch.setattr(_extension, "cuda_ops_available", lambda target=None: False)
    shapes = [(8192, 8192), (8192, 14336)]
    got = dispatch.resolve("all_gather_matmul", shapes, "bfloat16", 2, **H200)
    assert got.impl == "xla" and "lacks this op" in got.reason


def test_cuda_never_off_gpu(cuda_built):
    shapes = [(8192, 8192), (8192, 14336)]
    got = dispatch.resolve("all_gather_matmul", shapes, "bfloat16", 2, platform="cpu",
                           device_kind="NVIDIA H200", devices=2)
    assert got.impl == "xla"


def _kernel_accepts(nbytes, workspace_mb, devices):
    """Whether ffi/src/all_reduce.cu takes a bf16 message of nbytes per rank:
    the layout of peer.cu / peer_region.cu and the grid of AllReduceImpl, redone."""
    data = (max(workspace_mb, 64) << 20) - (32 << 20) - (128 << 10)
    region = data // 4 // 256 * 256
    line = 128 * 256
    senders = max(devices - 1, 1)
    # The Lamport slots come first (their size: test_lamport_limit_shrinks_...).
    lamport = senders * 2 * dispatch.lamport_max_bytes(devices)
    slot = (region - lamport) // (2 * senders) // line * line
    elements = nbytes // 2
    blocks = min(max(math.ceil(nbytes / (16 << 10)), 1), 128)
    chunk = math.ceil(math.ceil(elements / blocks) / 8) * 8
    return chunk * 2 <= slot // 128


def test_all_reduce_region_bound_is_a_lower_bound_of_the_kernels_limit():
    for workspace_mb in (64, 65, 80, 100, 128, 144, 145, 200, 512, 1024, 4096):
        for devices in range(2, 9):
            bound = dispatch.all_reduce_region_bytes(workspace_mb, devices)
            for nbytes in (2, 16 << 10, 64 << 10, 1 << 20, bound // 2, bound):
                if 0 < nbytes <= bound:
                    assert _kernel_accepts(nbytes // 2 * 2, workspace_mb, devices), (
                        workspace_mb, devices, nbytes, bound)
    assert dispatch.all_reduce_region_bytes(1024, 2) > 100 << 20  # not needlessly small
    assert dispatch.all_reduce_region_bytes(128, 8) == 0  # stripes under 16 KiB


def test_workspace_setting_is_read_like_the_extension_reads_it(monkeypatch):
    monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB", raising=False)
    default = dispatch.all_reduce_region_bytes(local_devices=2)
    assert default == dispatch.all_reduce_region_bytes(1024, 2)
    monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "2048")
    assert dispatch.all_reduce_region_bytes(local_devices=2) == dispatch.all_reduce_region_bytes(
        2048, 2)
    for bad in ("2048MB", "10", "-1", str(1 << 44)):  # no silent 64 MiB, no wrap-around
        monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", bad)
        with pytest.raises(ValueError, match="JAX_FLASHOVERLAP_WORKSPACE_MB.*64 to 1048576"):
            dispatch.all_reduce_region_bytes(local_devices=2)


def test_matmul_all_reduce_kernel_by_result_size(monkeypatch):
    monkeypatch.setattr(dispatch, "all_reduce_region_bytes", lambda: 120 << 20)
    limit = dispatch.MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES
    assert dispatch.matmul_all_reduce_kernel(2 << 10) == "gemm_then_all_reduce"
    assert dispatch.matmul_all_reduce_kernel(limit) == "gemm_then_all_reduce"
    assert dispatch.matmul_all_reduce_kernel(limit + 1) == "fused"
    # A region smaller than the limit (many local GPUs) caps the composed path.
    monkeypatch.setattr(dispatch, "all_reduce_region_bytes", lambda: 1 << 20)
    assert dispatch.matmul_all_reduce_kernel(2 << 20) == "fused"


@pytest.mark.parametrize("nbytes,dtype,impl,capacity,want", [
    (4 << 20, "bfloat16", "auto", 1 << 30, "nvshmem"),
    ((4 << 20) + 2, "bfloat16", "auto", 1 << 30, "xla"),  # not measured
    (4096, "float32", "auto", 1 << 30, "xla"),
    (4096, "float16", "auto", None, "xla"),  # NVSHMEM not started
    (4096, "bfloat16", "auto", 2048, "xla"),  # over its buffers
    (4096, "float32", "cuda", 1 << 30, "nvshmem"),
])
def test_all_reduce_across_processes(nbytes, dtype, impl, capacity, want):
    assert dispatch.all_reduce_across_processes(nbytes, jnp.dtype(dtype), impl, capacity) == want


@pytest.mark.parametrize("processes,node_size", [(4, 1), (2, 2), (8, 4)])
def test_auto_keeps_psum_where_nvshmem_was_not_measured(processes, node_size):
    bf16 = jnp.dtype("bfloat16")
    assert dispatch.all_reduce_across_processes(4096, bf16, "auto", 1 << 30, processes,
                                                node_size) == "xla"
    assert dispatch.all_reduce_across_processes(4096, bf16, "cuda", 1 << 30, processes,
                                                node_size) == "nvshmem"


def test_all_reduce_across_processes_with_cuda_names_the_fix():
    with pytest.raises(ValueError, match=r"nvshmem\.initialize\(\) first"):
        dispatch.all_reduce_across_processes(4096, np.dtype("float32"), "cuda", None)
    with pytest.raises(ValueError, match=r"larger heap_mb"):
        dispatch.all_reduce_across_processes(4096, np.dtype("float32"), "cuda", 1024)


@pytest.mark.parametrize("op,shapes,n,want", [
    ("matmul_reduce_scatter", [(2048, 64), (64, 32)], 2, 2),  # 1024 rows per rank
    ("matmul_reduce_scatter", [(2046, 64), (64, 32)], 2, 1),
    ("matmul_reduce_scatter", [(4096, 64), (64, 32)], 4, 1),  # not measured on 4
    ("all_gather_matmul", [(8192, 64), (64, 32)], 2, 2),
    ("all_gather_matmul", [(4096, 64), (64, 32)], 2, 1),
])
def test_collective_matmul_chunks(op, shapes, n, want):
    assert dispatch.collective_matmul_chunks(op, shapes, n) == want


def test_process_cuda_devices_asks_the_driver_on_gpus(monkeypatch):
    """The extension sizes its slots by cudaGetDeviceCount, which can exceed
    JAX's local devices; off GPUs (or without a driver) JAX's count stands."""
    count_devices = dispatch.process_cuda_devices.__wrapped__  # uncached
    assert count_devices() == jax.local_device_count()  # CPU backend

    class FakeDriver:
        def cuInit(self, flags):
            return 0

        def cuDeviceGetCount(self, ref):
            ref._obj.value = 8
            return 0

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch.ctypes, "CDLL", lambda name: FakeDriver())
    assert count_devices() == 8

    def no_driver(name):
        raise OSError(name)

    monkeypatch.setattr(dispatch.ctypes, "CDLL", no_driver)
    assert count_devices() == jax.local_device_count()


def test_smallest_workspace_lays_out_for_any_device_count():
    """peer.cu / peer_region.cu, redone: at the 64 MiB floor the Lamport slots
    leave room in the all-reduce region, and the control area holds the
    counters, for up to 45 CUDA devices per process."""
    region = ((64 << 20) - (32 << 20) - (128 << 10)) // 4 // 256 * 256
    control_words = ((128 << 10) - (36 << 10)) // 4
    for devices in range(1, 46):
        senders = max(devices - 1, 1)
        assert senders * 2 * dispatch.lamport_max_bytes(devices) < region, devices
        assert 4 * 128 * devices + 1 <= control_words, devices


def test_transport_capacity_is_the_extensions_layout():
    # GetOrCreateDevice (ffi/src/transport/peer.cu), redone for 1 GiB and 2 GPUs.
    data = (1024 << 20) - (32 << 20) - (128 << 10)
    rest = data - data // 4 // 256 * 256
    staging = rest // 3 // 256 * 256
    slot = (rest - staging) // 2 // 256 * 256
    assert dispatch.transport_capacity(1024, 2) == (slot, staging)
    assert dispatch.transport_capacity(4096, 2)[0] > 4 * slot - (1 << 20)
    assert dispatch.transport_capacity(1024, 8)[0] < slot


def test_auto_keeps_shapes_the_transport_cannot_hold_in_xla(cuda_built, monkeypatch):
    monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB", raising=False)
    monkeypatch.setattr(dispatch, "process_cuda_devices", lambda: 2)
    shapes = [(65536, 8192), (8192, 8192)]  # 1 GiB of x per rank: over a 248 MiB slot
    got = dispatch.resolve("all_gather_matmul", shapes, "bfloat16", 2, **H200)
    assert got.impl == "xla" and "JAX_FLASHOVERLAP_WORKSPACE_MB" in got.reason
    monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "8192")
    assert dispatch.resolve("all_gather_matmul", shapes, "bfloat16", 2, **H200).impl == "cuda"
