"""impl="auto": the measured rule, and "xla" wherever nothing was measured."""


import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashoverlap import _extension, cuda_policy, dispatch


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
    # The 1B models' decode all-reduces (embed 2048) at batch 1 and 8: NVRAR.
    ("all_reduce", [(1, 2048)], "bfloat16", 2, "cuda"),
    ("all_reduce", [(8, 2048)], "bfloat16", 2, "cuda"),
    ("all_reduce", [(1, 512)], "bfloat16", 2, "xla"),  # 1 KiB: below the smallest
    ("all_reduce", [(1024, 1 << 20)], "bfloat16", 2, "xla"),  # 2 GiB: over the region
])
def test_shipped_table(cuda_built, op, shapes, dtype, n, want, monkeypatch):
    monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB", raising=False)
    monkeypatch.setattr(cuda_policy, "process_cuda_devices", lambda: 2)
    assert dispatch.resolve(op, shapes, dtype, n, **H200).impl == want


def test_every_shipped_entry_resolves_to_its_fastest(cuda_built, monkeypatch):
    from jax_flashoverlap import tuning

    monkeypatch.setattr(cuda_policy, "process_cuda_devices", lambda: 2)
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


def test_auto_keeps_shapes_the_transport_cannot_hold_in_xla(cuda_built, monkeypatch):
    monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB", raising=False)
    monkeypatch.setattr(cuda_policy, "process_cuda_devices", lambda: 2)
    shapes = [(65536, 8192), (8192, 8192)]  # 1 GiB of x per rank: over a 248 MiB slot
    got = dispatch.resolve("all_gather_matmul", shapes, "bfloat16", 2, **H200)
    assert got.impl == "xla" and "JAX_FLASHOVERLAP_WORKSPACE_MB" in got.reason
    monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "8192")
    assert dispatch.resolve("all_gather_matmul", shapes, "bfloat16", 2, **H200).impl == "cuda"


@pytest.mark.parametrize("op, w_shape, message", [
    ("matmul", (8, 8), r"explain: op must be one of \('all_gather_matmul'"),
    ("all_reduce", (8, 8), "explain: all_reduce takes no w_shape"),
    ("all_gather_matmul", None, r"explain: all_gather_matmul takes w_shape \[k, n_out\]"),
])
def test_explain_names_what_it_takes(op, w_shape, message):
    with pytest.raises(ValueError, match=message):
        dispatch.explain(op, (8, 8), w_shape)
