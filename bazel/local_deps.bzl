"""Repositories for what the build takes from this machine, with native Bazel only.

The extension compiles against headers that come with the Python
environment (XLA's FFI from jaxlib, nanobind, the Python headers, cuBLASLt
from the nvidia-cublas wheel) and against the CUDA toolkit. These rules ask
the interpreter named by JFO_PYTHON (default: python3 on PATH) where they
are, and link them into external repositories, the way
CMake's `find_package` calls do in ffi/CMakeLists.txt. The CUDA toolkit is
CUDA_HOME (or CUDA_PATH, else /usr/local/cuda).
"""

_FIND_PYTHON_HEADERS = """
import importlib.util, os, sysconfig
import jax, nanobind
nvidia = importlib.util.find_spec("nvidia")
cublas = [os.path.join(p, "cu13", "include") for p in
          (nvidia.submodule_search_locations if nvidia else [])]
cublas = [p for p in cublas if os.path.exists(os.path.join(p, "cublasLt.h"))]
print(jax.ffi.include_dir())
print(sysconfig.get_paths()["include"])
print(os.path.dirname(nanobind.include_dir()))
print(cublas[0] if cublas else "")
"""

_PYTHON_BUILD = """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

# py_test and py_binary run this interpreter (the one whose headers the
# extension compiles against, so that jax and its deps import).
py_runtime(
    name = "python3",
    interpreter_path = "%s",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

cc_library(
    name = "xla_ffi",
    hdrs = glob(["xla_include/xla/ffi/api/*.h"]),
    includes = ["xla_include"],
)

filegroup(
    name = "xla_ffi_headers",
    srcs = glob(["xla_include/xla/ffi/api/*.h"]),
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

# nanobind's sources compiled into the module (CMake's NB_STATIC).
cc_library(
    name = "nanobind",
    srcs = ["nanobind/src/nb_combined.cpp"],
    hdrs = glob([
        "nanobind/include/**/*.h",
        "nanobind/src/*.h",
        "nanobind/ext/robin_map/include/**/*.h",
    ]),
    copts = ["-fno-strict-aliasing", "-Os"],
    includes = ["nanobind/include", "nanobind/ext/robin_map/include"],
    # nb_combined.cpp includes the others.
    textual_hdrs = glob(["nanobind/src/*.cpp"], exclude = ["nanobind/src/nb_combined.cpp"]),
    deps = [":python_headers"],
    alwayslink = True,
)

cc_library(
    name = "cublaslt_headers",
    hdrs = glob(["cublas_include/*.h"]),
    includes = ["cublas_include"],
)

filegroup(
    name = "cublas_headers",
    srcs = glob(["cublas_include/*.h"]),
)
"""

def _python_env_impl(ctx):
    python = ctx.os.environ.get("JFO_PYTHON", "python3")
    if "/" not in python:
        found = ctx.which(python)
        if found == None:
            fail("JFO_PYTHON=%s is not on PATH" % python)
        python = str(found)
    result = ctx.execute([python, "-c", _FIND_PYTHON_HEADERS])
    if result.return_code != 0:
        fail("JFO_PYTHON=%s cannot report its headers (it needs jax and nanobind: " % python +
             "pip install jax nanobind nvidia-cublas):\n" + result.stderr)
    xla, python_include, nanobind, cublas = result.stdout.strip().split("\n")
    ctx.symlink(xla, "xla_include")
    ctx.symlink(python_include, "python_include")
    ctx.symlink(nanobind, "nanobind")
    if cublas:
        ctx.symlink(cublas, "cublas_include")
    else:
        ctx.file("cublas_include/README", "no cublasLt.h in this Python environment\n")
    ctx.file("BUILD.bazel", _PYTHON_BUILD % python)

python_env = repository_rule(
    implementation = _python_env_impl,
    environ = ["JFO_PYTHON", "PATH"],
    local = True,
)

_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

exports_files(["bin/nvcc"])

filegroup(
    name = "nvcc_files",
    srcs = glob(["bin/**", "nvvm/**", "include/**"]),
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl"]),
    includes = ["include"],
)

# The static runtime, as the CMake build links it: the module imports where
# there is no GPU driver.
cc_library(
    name = "cudart_static",
    srcs = ["lib64/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)
"""

def _cuda_toolkit_impl(ctx):
    # CUDA_HOME or CUDA_PATH, else /usr/local/cuda (an nvcc on PATH may be a
    # wrapper script elsewhere).
    home = ctx.os.environ.get("CUDA_HOME") or ctx.os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    root = ctx.path(home)
    nvcc = root.get_child("bin").get_child("nvcc")
    if not nvcc.exists:
        # //ffi:_ffi_cpu.so builds without a toolkit; //ffi:_ffi.so then
        # fails in its first nvcc step, saying why.
        ctx.file("bin/nvcc", "#!/bin/sh\necho 'no CUDA toolkit at %s: set CUDA_HOME' >&2\n" % home +
                 "exit 1\n", executable = True)
        ctx.file("lib64/libcudart_static.a", "")
        ctx.file("version.bzl", "CUDA_VERSION = 'none'\n")
        ctx.file("BUILD.bazel", _CUDA_BUILD)
        return
    for entry in ["bin", "include", "lib64", "nvvm"]:
        ctx.symlink(root.get_child(entry), entry)

    # "Cuda compilation tools, release 13.0, V13.0.88": the full version, as
    # CMake's CUDAToolkit_VERSION.
    version = ctx.execute([str(nvcc), "--version"]).stdout
    full = version.split(", V")[1].split("\n")[0].strip() if ", V" in version else "unknown"
    ctx.file("version.bzl", "CUDA_VERSION = %r\n" % full)
    ctx.file("BUILD.bazel", _CUDA_BUILD)

cuda_toolkit = repository_rule(
    implementation = _cuda_toolkit_impl,
    environ = ["CUDA_HOME", "CUDA_PATH"],
    local = True,
)
