"""CUDA module loading is made eager before JAX starts, and lazy loading warns."""

import os
import subprocess
import sys
import warnings

import pytest

from jax_flashoverlap import _module_loading


def _mode_after(code: str, **env: str) -> str:
    child_env = {k: v for k, v in os.environ.items() if k != _module_loading.ENV}
    child_env.update(env, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code + "\nimport os\n"
                          "print(os.environ.get('CUDA_MODULE_LOADING', 'unset'))"],
                         env=child_env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()[-1]


def test_import_before_jax_starts_makes_loading_eager():
    assert _mode_after("import jax_flashoverlap") == "EAGER"


def test_a_value_the_user_set_is_kept():
    assert _mode_after("import jax_flashoverlap", CUDA_MODULE_LOADING="LAZY") == "LAZY"


def test_after_jax_started_the_variable_is_not_touched():
    # CUDA read the environment at start-up; setting it now would misreport.
    assert _mode_after("import jax; jax.devices(); import jax_flashoverlap") == "unset"


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(_module_loading, "_warned", False)
    return monkeypatch


def _driver(monkeypatch, mode):
    monkeypatch.setattr(_module_loading, "driver_mode", lambda: mode)


def _assert_silent(op):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _module_loading.warn_if_lazy(op)


def test_the_driver_mode_is_one_of_three():
    # "unknown" on hosts without a CUDA driver, such as CI.
    assert _module_loading.driver_mode() in ("lazy", "eager", "unknown")


def test_lazy_loading_warns_once_with_the_fix(fresh_warning):
    _driver(fresh_warning, "unknown")
    fresh_warning.setenv(_module_loading.ENV, "LAZY")
    with pytest.warns(RuntimeWarning, match="CUDA_MODULE_LOADING=EAGER"):
        _module_loading.warn_if_lazy("all_gather_matmul")
    _assert_silent("all_gather_matmul")


def test_eager_in_the_environment_does_not_warn_where_the_driver_is_unknown(fresh_warning):
    _driver(fresh_warning, "unknown")
    fresh_warning.setenv(_module_loading.ENV, "EAGER")
    _assert_silent("all_reduce")


def test_the_driver_decides_over_the_environment(fresh_warning):
    # CUDA started lazily before the import set the variable (e.g. by torch).
    _driver(fresh_warning, "lazy")
    fresh_warning.setenv(_module_loading.ENV, "EAGER")
    with pytest.warns(RuntimeWarning, match="loads kernels lazily"):
        _module_loading.warn_if_lazy("matmul_reduce_scatter")
    fresh_warning.setattr(_module_loading, "_warned", False)
    _driver(fresh_warning, "eager")
    fresh_warning.setenv(_module_loading.ENV, "LAZY")
    _assert_silent("matmul_reduce_scatter")
