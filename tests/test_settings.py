"""Every environment variable the library reads rejects nonsense, naming itself."""

import os
import subprocess
import sys

import pytest

from jax_flashoverlap import settings

NONSENSE = {
    "JAX_FLASHOVERLAP_WORKSPACE_MB": ["", "lots", "2048MB", "63", "-1", str(1 << 44)],
    "JAX_FLASHOVERLAP_TIMEOUT_MS": ["", "soon", "0", "-3", "1.5", str(2**31)],
    "JAX_FLASHOVERLAP_GEMM_AUTOTUNE": ["", "yes", "2", "on"],
    "JAX_FLASHOVERLAP_PEER_STORES": ["", "no", "off", "01"],
    "JAX_FLASHOVERLAP_NVSHMEM_INIT": ["", "HOSTLIB", "lazy"],
    "JAX_FLASHOVERLAP_NVSHMEM_DEBUG": ["", "true", "2"],
}
GOOD = {"JAX_FLASHOVERLAP_WORKSPACE_MB": ("4096", 4096),
        "JAX_FLASHOVERLAP_TIMEOUT_MS": ("250", 250),
        "JAX_FLASHOVERLAP_GEMM_AUTOTUNE": ("0", False),
        "JAX_FLASHOVERLAP_PEER_STORES": ("1", True),
        "JAX_FLASHOVERLAP_NVSHMEM_INIT": ("inline", "inline"),
        "JAX_FLASHOVERLAP_NVSHMEM_DEBUG": ("1", True)}


def test_every_setting_is_covered():
    assert set(NONSENSE) == set(GOOD) == set(settings.SETTINGS)


@pytest.mark.parametrize("name", sorted(settings.SETTINGS))
def test_nonsense_is_rejected_naming_the_variable_and_range(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert settings.get(name) == settings.SETTINGS[name].default
    raw, value = GOOD[name]
    monkeypatch.setenv(name, raw)
    assert settings.get(name) == value
    for bad in NONSENSE[name]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError) as e:
            settings.check_all()
        assert str(e.value).startswith(f"{name}={bad!r}: expected "), str(e.value)
        assert settings.SETTINGS[name].accepts in str(e.value)
        assert str(e.value).endswith(f"unset it for the default "
                                     f"({settings.SETTINGS[name].default!r})"), str(e.value)


def test_import_fails_on_a_bad_variable(tmp_path):
    env = dict(os.environ, JAX_FLASHOVERLAP_TIMEOUT_MS="soon")
    proc = subprocess.run([sys.executable, "-c", "import jax_flashoverlap"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "JAX_FLASHOVERLAP_TIMEOUT_MS='soon': expected an integer number of milliseconds" in (
        proc.stderr)
