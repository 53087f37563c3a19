"""Bazel's //:extension_test: the package imports the extension Bazel built.

Not a pytest module (pytest runs the installed package; this runs from
Bazel's runfiles). It checks that ``jax_flashoverlap._ffi`` comes from the
runfiles, not from an installed copy, and that it reports and registers
every op of the CUDA build, as the pip build's tests/test_extension.py does;
and that the models (models/ in the checkout) import as
``jax_flashoverlap.models``, as from the wheel.
"""

import pathlib
import sys

import jax_flashoverlap
from jax_flashoverlap import _ffi, models

EXPECTED_TARGETS = {"jfo_all_gather_matmul", "jfo_all_reduce", "jfo_all_reduce_copy_engine",
                    "jfo_matmul_all_reduce", "jfo_matmul_reduce_scatter", "jfo_scale",
                    "jfo_decode_matmul", "jfo_transformer_decode",
                    "jfo_mamba_decode"}


def main() -> int:
    module = pathlib.Path(_ffi.__file__)
    if "site-packages" in module.parts or ".runfiles" not in str(module):
        print(f"FAIL: jax_flashoverlap._ffi came from {module}, not Bazel's runfiles")
        return 1
    info = jax_flashoverlap.build_info()
    print("build_info:", info)
    failures = []
    if not (info["extension"] and info["cuda"] and info["cublaslt"]):
        failures.append("the extension, CUDA and cuBLASLt should all be built")
    if not {"80-real", "90-real", "100"} <= set(info["architectures"]):
        failures.append(f"architectures {info['architectures']}")
    if not info["cuda_version"] or info["cuda_version"] == "unknown":
        failures.append(f"cuda_version {info['cuda_version']!r}")
    if set(info["ffi_targets"]) != EXPECTED_TARGETS:
        failures.append(f"ffi_targets {sorted(info['ffi_targets'])} != {sorted(EXPECTED_TARGETS)}")
    if ".runfiles" not in str(pathlib.Path(models.__file__)):
        failures.append(f"jax_flashoverlap.models came from {models.__file__}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
