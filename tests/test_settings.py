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


def test_a_command_says_a_bad_variable_in_one_line(tmp_path):
    """Under a command, the same error as its other input errors: status 2,
    one line, no traceback of the package's import."""
    env = dict(os.environ, JAX_FLASHOVERLAP_TIMEOUT_MS="soon")
    proc = subprocess.run([sys.executable, "-m", "jax_flashoverlap.cli.demo", "--reps", "1"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("jax-flashoverlap-demo: error: JAX_FLASHOVERLAP_TIMEOUT_MS='soon': "
                           "expected an integer number of milliseconds from 1 to 2147483647; "
                           "unset it for the default (10000)\n")


def test_a_misspelled_variable_is_named_with_the_closest_setting(monkeypatch):
    monkeypatch.setenv("JAX_FLASHOVERLAP_TIMEOUT", "5")
    monkeypatch.setenv("JAX_FLASHOVERLAP_QQQ", "1")
    with pytest.warns(UserWarning) as record:
        settings.check_all()
    messages = sorted(str(w.message) for w in record)
    assert messages[0].startswith("JAX_FLASHOVERLAP_QQQ is set, but "
                                  "jax_flashoverlap has no such setting; the settings are "
                                  "JAX_FLASHOVERLAP_GEMM_AUTOTUNE, ")
    assert messages[1] == ("JAX_FLASHOVERLAP_TIMEOUT is set, but jax_flashoverlap has no such "
                           "setting; did you mean JAX_FLASHOVERLAP_TIMEOUT_MS?")


def test_the_extension_gets_the_parsed_values(monkeypatch):
    """push_settings hands the extension what settings.py parsed; the
    extension itself reads no environment variable (tests/test_layering.py)."""
    from jax_flashoverlap import _extension

    if _extension._module() is None:
        pytest.skip("no compiled extension in this install")
    monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "2048")
    monkeypatch.setenv("JAX_FLASHOVERLAP_PEER_STORES", "0")
    monkeypatch.setenv("JAX_FLASHOVERLAP_GEMM_AUTOTUNE", "0")
    try:
        assert _extension.push_settings() == {"workspace_mb": 2048, "peer_stores": False,
                                              "gemm_autotune": False}
        monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "lots")
        with pytest.raises(ValueError, match="JAX_FLASHOVERLAP_WORKSPACE_MB='lots'"):
            _extension.push_settings()
        with pytest.raises(ValueError, match="configure: workspace_mb must be from 64 to "
                                             "1048576"):
            _extension._module().configure(workspace_mb=0, peer_stores=True,
                                           gemm_autotune=True)
    finally:
        for name in ("JAX_FLASHOVERLAP_WORKSPACE_MB", "JAX_FLASHOVERLAP_PEER_STORES",
                     "JAX_FLASHOVERLAP_GEMM_AUTOTUNE"):
            monkeypatch.delenv(name)
        assert _extension.push_settings() == {"workspace_mb": 1024, "peer_stores": True,
                                              "gemm_autotune": True}


def test_a_variable_the_tables_do_not_list_is_refused(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/cache")
    assert settings.raw("XDG_CACHE_HOME") == "/tmp/cache"
    for call in (lambda: settings.raw("HOME"), lambda: settings.export("HOME", "/")):
        with pytest.raises(KeyError, match="HOME is not in jax_flashoverlap.settings' tables: "
                                           "declare it there"):
            call()
    assert settings.snapshot(("XDG_CACHE",)) == {"XDG_CACHE_HOME": "/tmp/cache"}
