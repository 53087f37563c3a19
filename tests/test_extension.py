"""The compiled extension: what it reports, and its smoke-test kernel on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashoverlap as jfo


def test_build_info_reports_the_build():
    info = jfo.build_info()
    assert set(info) >= {"extension", "cuda", "cuda_version", "architectures", "cublaslt",
                         "ffi_targets"}
    if info["cuda"]:
        assert info["extension"] and info["cuda_version"] and info["architectures"]
        assert "jfo_scale" in info["ffi_targets"]
    else:
        assert info["ffi_targets"] == []


def test_check_device_errors_is_quiet_when_nothing_failed():
    jfo.check_device_errors()


@pytest.mark.gpu
def test_scale_kernel_runs_on_the_gpu():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1000,)), jnp.float32)
    call = jax.ffi.ffi_call("jfo_scale", jax.ShapeDtypeStruct(x.shape, x.dtype))
    y = jax.jit(lambda x: call(x, scale=np.float32(2.5)))(x)
    np.testing.assert_allclose(np.asarray(y), 2.5 * np.asarray(x), rtol=1e-6)


def test_default_build_covers_ampere_hopper_blackwell():
    info = jfo.build_info()
    if not info["cuda"]:
        pytest.skip("built without CUDA (no nvcc): no architectures to list")
    assert {"80-real", "90-real", "100"} <= set(info["architectures"]), info["architectures"]


@pytest.mark.gpu
def test_this_gpu_has_machine_code():
    """The GPU's compute capability is among the built ones (no PTX JIT)."""
    capability = jax.devices("gpu")[0].compute_capability.replace(".", "")
    built = {a.removesuffix("-real") for a in jfo.build_info()["architectures"]}
    assert capability in built, (capability, built)
