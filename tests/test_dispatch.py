"""impl="auto": the measured rule, and "xla" wherever nothing was measured."""

import numpy as np
import pytest

from jax_flashoverlap import _extension, dispatch


@pytest.fixture
def cuda_built(monkeypatch):
    monkeypatch.setattr(_extension, "cuda_ops_available", lambda target=None: True)


@pytest.mark.parametrize("op,shapes,dtype,n,want", [
    ("all_gather_matmul", [(1024, 4096), (4096, 4096)], np.dtype("bfloat16"), 2, "cuda"),
    ("all_gather_matmul", [(128, 8192), (8192, 8192)], np.dtype("bfloat16"), 2, "xla"),
    ("all_gather_matmul", [(4096, 8192), (8192, 4096)], np.dtype("float32"), 2, "xla"),
    ("all_gather_matmul", [(4096, 8192), (8192, 4096)], np.dtype("bfloat16"), 4, "xla"),
    ("matmul_all_reduce", [(4096, 8192), (8192, 4096)], np.dtype("float16"), 2, "cuda"),
    ("matmul_all_reduce", [(2048, 8192), (8192, 7168)], np.dtype("bfloat16"), 2, "xla"),
    ("matmul_reduce_scatter", [(8192, 8192), (8192, 4096)], np.dtype("bfloat16"), 2, "xla"),
    ("all_reduce", [(1, 1 << 20)], np.dtype("bfloat16"), 2, "cuda"),
    ("all_reduce", [(1, 3)], np.dtype("float16"), 2, "cuda"),
    ("all_reduce", [(1, 1 << 20)], np.dtype("float32"), 2, "xla"),
    ("all_reduce", [(1, 1 << 20)], np.dtype("bfloat16"), 4, "xla"),
    ("all_reduce", [(1024, 1 << 20)], np.dtype("bfloat16"), 2, "xla"),  # 2 GiB: over the region
])
def test_rule(cuda_built, op, shapes, dtype, n, want):
    assert dispatch.choose_impl(op, "jfo_" + op, shapes, dtype, n) == want


def test_never_cuda_when_not_built(monkeypatch):
    monkeypatch.setattr(_extension, "cuda_ops_available", lambda target=None: False)
    shapes = [(8192, 8192), (8192, 14336)]
    assert dispatch.choose_impl("all_gather_matmul", "t", shapes, np.dtype("bfloat16"), 2) == "xla"


def test_auto_is_xla_off_gpu(cuda_built):
    shapes = [(8192, 8192), (8192, 14336)]
    got = dispatch.resolved_impl("all_gather_matmul", "t", shapes, np.dtype("bfloat16"), 2,
                                 platform="cpu")
    assert got == "xla"


def test_all_reduce_region_bound_follows_the_workspace():
    assert dispatch.all_reduce_region_bytes(1024, 2) == 120 << 20
    assert dispatch.all_reduce_region_bytes(1024, 8) == (120 << 20) // 7
    assert dispatch.all_reduce_region_bytes(4096, 2) == 504 << 20
    assert dispatch.all_reduce_region_bytes(64, 2) == 0


def test_matmul_all_reduce_kernel_by_result_size(monkeypatch):
    monkeypatch.setattr(dispatch, "all_reduce_region_bytes", lambda: 120 << 20)
    limit = dispatch.MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES
    assert dispatch.matmul_all_reduce_kernel(2 << 10) == "gemm_then_all_reduce"
    assert dispatch.matmul_all_reduce_kernel(limit) == "gemm_then_all_reduce"
    assert dispatch.matmul_all_reduce_kernel(limit + 1) == "fused"
    # A region smaller than the limit (many local GPUs) caps the composed path.
    monkeypatch.setattr(dispatch, "all_reduce_region_bytes", lambda: 1 << 20)
    assert dispatch.matmul_all_reduce_kernel(2 << 20) == "fused"
