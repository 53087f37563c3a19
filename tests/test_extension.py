"""The compiled extension: what it reports, and its smoke-test kernel on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashoverlap as jfo


def test_build_info_reports_the_build():
    info = jfo.build_info()
    assert set(info) >= {"extension", "cuda", "cuda_version", "architectures", "cublaslt",
                         "cutlass", "ffi_targets"}
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


def test_a_gpu_run_without_gpus_fails_loudly(tmp_path):
    """scripts/gpu_run.sh runs the GPU tests with JFO_REQUIRE_GPU=1: where
    they cannot run, pytest must fail, not report a run of skips."""
    import os
    import pathlib
    import subprocess
    import sys

    if jax.default_backend() == "gpu":
        pytest.skip("this machine has GPUs: the failure mode is that of a machine without")
    tests = pathlib.Path(__file__).parent
    env = dict(os.environ, JFO_REQUIRE_GPU="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", str(tests / "test_extension.py")],
                          cwd=tests.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "JFO_REQUIRE_GPU=1 but" in proc.stdout + proc.stderr


def test_python_mirrors_the_extensions_layout_limits():
    """dispatch and _cuda_limits redo the transport's layout arithmetic; the
    constants they start from are those the extension was compiled with."""
    from jax_flashoverlap import _cuda_limits, _extension, cuda_policy

    limits = _extension.limits()
    if not jfo.build_info()["cublaslt"]:
        assert limits == {}
        pytest.skip("built without the CUDA ops: nothing to compare")
    assert limits == {
        "lamport_max_bytes": cuda_policy.LAMPORT_MAX_BYTES,
        "lamport_parity_budget": cuda_policy._LAMPORT_PARITY_BUDGET,
        "all_reduce_min_block_bytes": cuda_policy._AR_BLOCK_BYTES,
        "gemm_workspace_bytes": cuda_policy._GEMM_WORKSPACE_BYTES,
        "control_bytes": cuda_policy._CONTROL_BYTES,
        "events_per_call": _cuda_limits.EVENTS_PER_CALL,
    }


def test_impl_cuda_without_what_it_needs_names_the_fix(monkeypatch):
    """require_cuda_ops' three refusals: no compiled module, a build without
    CUDA, a build without this op's handler."""
    from jax_flashoverlap import _extension

    monkeypatch.setattr(_extension, "_module", lambda: None)
    with pytest.raises(RuntimeError, match=r"all_reduce\(impl='cuda'\): jax_flashoverlap was "
                                           r"installed without its compiled extension.*Reinstall"):
        _extension.require_cuda_ops("all_reduce", "jfo_all_reduce")
    monkeypatch.setattr(_extension, "_module", lambda: object())
    monkeypatch.setattr(_extension, "_register", lambda: [])
    monkeypatch.setattr(_extension, "build_info", lambda: {"cuda": False})
    with pytest.raises(RuntimeError, match=r"all_reduce\(impl='cuda'\): the installed "
                                           r"jax_flashoverlap was built without CUDA"):
        _extension.require_cuda_ops("all_reduce", "jfo_all_reduce")
    monkeypatch.setattr(_extension, "_register", lambda: ["jfo_scale"])
    with pytest.raises(NotImplementedError, match=r"this build has no CUDA kernel for all_reduce "
                                                  r"\(FFI target 'jfo_all_reduce' is missing\)"):
        _extension.require_cuda_ops("all_reduce", "jfo_all_reduce")
