"""Does NVSHMEM start in this build? Two processes, one GPU each.

    python scripts/nvshmem_probe.py [VARIANT ...]

Each variant starts two fresh processes that load the extension's NVSHMEM
module by path (so JAX is imported only where a variant asks for it),
share a unique id through a file (the ``+jax`` variants import JAX first,
and start its CUDA client), call ``init`` (with JAX_FLASHOVERLAP_NVSHMEM_DEBUG=1,
so the last step printed is where a crash happened), ``info`` and
``finalize``, and reports the exit codes. A variant is an entry of VARIANTS:
the environment it runs with. Prints one verdict line per variant last; exit
status 0 if every variant started.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "hostlib": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "hostlib"},
    "inline": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "inline"},
    "inline-eager": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "inline", "CUDA_MODULE_LOADING": "EAGER"},
    "hostlib-eager": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "hostlib", "CUDA_MODULE_LOADING": "EAGER"},
    # JAX in the process first: imported only, then with its CUDA client up.
    "hostlib+jax-import": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "hostlib", "JFO_PROBE_JAX": "import"},
    "hostlib+jax-import+nvdebug": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "hostlib",
                                   "JFO_PROBE_JAX": "import", "NVSHMEM_DEBUG": "INFO"},
    "hostlib+jax-devices": {"JAX_FLASHOVERLAP_NVSHMEM_INIT": "hostlib", "JFO_PROBE_JAX": "devices",
                            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                            "NVSHMEM_DEBUG": "INFO"},
}
HEAP_BYTES = 1 << 30
TIMEOUT_S = 60


def _module():
    """The compiled module, loaded without importing jax_flashoverlap (and so jax)."""
    spec = importlib.util.find_spec("jax_flashoverlap")
    if spec is None:
        sys.exit("jax_flashoverlap is not installed")
    paths = glob.glob(os.path.join(spec.submodule_search_locations[0], "_nvshmem_ffi*.so"))
    if not paths:
        sys.exit("this jax_flashoverlap was built without its NVSHMEM module "
                 "(-C cmake.define.JFO_ENABLE_NVSHMEM=ON)")
    name = "jax_flashoverlap._nvshmem_ffi"
    loader = importlib.machinery.ExtensionFileLoader(name, paths[0])
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location(name, paths[0], loader=loader))
    loader.exec_module(module)
    return module


def child(rank: int, uid_file: str) -> None:
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(HEAP_BYTES)  # before the unique id
    with_jax = os.environ.get("JFO_PROBE_JAX")
    if with_jax:
        import jax
        if with_jax == "devices":
            print(f"rank {rank}: jax {jax.__version__} {jax.devices()}", flush=True)
    mod = _module()
    if rank == 0:
        with open(uid_file + ".tmp", "wb") as f:
            f.write(mod.get_unique_id())
        os.rename(uid_file + ".tmp", uid_file)
    else:
        deadline = time.monotonic() + TIMEOUT_S
        while not os.path.exists(uid_file):
            if time.monotonic() > deadline:
                sys.exit(f"rank 1: no unique id from rank 0 after {TIMEOUT_S} s")
            time.sleep(0.05)
    with open(uid_file, "rb") as f:
        uid = f.read()
    mod.init(uid, rank, 2, HEAP_BYTES, rank,
             hostlib=os.environ.get("JAX_FLASHOVERLAP_NVSHMEM_INIT", "hostlib") == "hostlib",
             debug=os.environ.get("JAX_FLASHOVERLAP_NVSHMEM_DEBUG") == "1")
    print(f"rank {rank}: started {mod.info()}", flush=True)
    mod.finalize()
    print(f"rank {rank}: finalized", flush=True)


def probe(variant: str) -> list[int | None]:
    env = dict(os.environ, JAX_FLASHOVERLAP_NVSHMEM_DEBUG="1", PYTHONFAULTHANDLER="1",
               NVSHMEM_DISABLE_NVLS="1", **VARIANTS[variant])
    with tempfile.TemporaryDirectory() as tmp:
        uid_file = os.path.join(tmp, "uid")
        procs = [subprocess.Popen([sys.executable, "-P", __file__, "--child", str(r), uid_file],
                                  env=env) for r in range(2)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=TIMEOUT_S))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
    return codes


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]), sys.argv[3])
        return 0
    variants = sys.argv[1:] or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    verdicts = []
    for variant in variants:
        print(f"=== {variant}: {VARIANTS[variant]}", flush=True)
        codes = probe(variant)
        ok = codes == [0, 0]
        verdicts.append(ok)
        print(f"=== {variant}: {'started' if ok else 'FAILED'} (exit codes {codes}; "
              f"negative: killed by that signal, None: timed out)", flush=True)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
