"""Test setup: 8 CPU devices, the ``gpu`` marker, quicker CPU compilation (JAX's
persistent compilation cache, LLVM unoptimized), a fresh random generator."""

import os

# Must precede the first jax import: gives the CPU backend 8 devices.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import zlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_flashoverlap as jfo  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


GPU_COUNT = _gpu_count()
if not GPU_COUNT:
    # LLVM at -O0 for the CPU backend: the tests' programs are small and run
    # once or twice, so compiling dominates; this compiles them about a
    # third faster (XLA's HLO passes run as before; only the machine code is
    # less optimized).
    jax.config.update("jax_disable_most_optimizations", True)
# Set by scripts/gpu_run.sh: on the GPU machine, a run in which the GPU tests
# could not run, or none passed, is a failure, not a quiet pass.
REQUIRE_GPU = os.environ.get("JFO_REQUIRE_GPU") == "1"
_gpu_tests_passed = 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A plain ``pytest`` (the whole suite, no ``-n``) on a machine without
    GPUs runs in two pytest-xdist workers where xdist is installed: most of
    a test is XLA compiling on one core. ``-n 0`` runs in one process; GPU
    runs keep one process, which owns the GPU."""
    if (GPU_COUNT or REQUIRE_GPU or not config.pluginmanager.hasplugin("xdist")
            or "PYTEST_XDIST_WORKER" in os.environ  # a worker starts none of its own
            or config.option.numprocesses is not None or (os.cpu_count() or 1) < 2
            or config.args_source != pytest.Config.ArgsSource.TESTPATHS
            or config.option.usepdb):
        return
    config.option.numprocesses = 2


def pytest_configure(config):
    """Without GPUs, JAX's persistent compilation cache in pytest's cache
    (.pytest_cache/d/jax_compilation_cache; --cache-clear empties it): a
    second run reads back what the first compiled, several times faster.
    Not with -p no:cacheprovider (scripts/gpu_run.sh), nor where
    JAX_COMPILATION_CACHE_DIR already names one. Child processes compile
    without it."""
    cache = getattr(config, "cache", None)
    if GPU_COUNT or cache is None or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache.mkdir("jax_compilation_cache")))
    # Every executable: on CPUs most compile in well under the 1 s default.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_collection_modifyitems(config, items):
    if REQUIRE_GPU and not (GPU_COUNT and jfo.build_info()["cuda"]):
        raise pytest.UsageError(
            "JFO_REQUIRE_GPU=1 but " + ("no CUDA GPU is visible" if not GPU_COUNT else
                                        "jax_flashoverlap was built without CUDA (is nvcc on "
                                        "the PATH?); see build_info()"))
    if GPU_COUNT and jfo.build_info()["cuda"]:
        for item in items:
            needs = item.get_closest_marker("gpus")
            if needs and GPU_COUNT < needs.args[0]:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {needs.args[0]} GPUs, this machine has {GPU_COUNT}"))
        return
    reason = ("no CUDA GPU" if not GPU_COUNT
              else "jax_flashoverlap built without CUDA (see build_info())")
    for item in items:
        if "gpu" in item.keywords or item.get_closest_marker("gpus"):
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    global _gpu_tests_passed
    if report.when == "call" and report.passed and "gpu" in report.keywords:
        _gpu_tests_passed += 1


def pytest_sessionfinish(session, exitstatus):
    if REQUIRE_GPU and exitstatus == 0 and _gpu_tests_passed == 0:
        print("\nJFO_REQUIRE_GPU=1 but no GPU test passed (all skipped or deselected)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def rng(request):
    # Different data in every test, reproducible from the test's id.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
