"""Registers, spills and shared memory of the Pallas SSD kernels per tiling,
compiled for an H200 on a machine without a GPU.

    pip install triton          # any recent release; it needs no GPU to compile
    python scripts/ssd_kernel_resources.py [--tiles 64x64 64x32] [--warps 4 8] [--stages 2 3]

Each tiling of ``models.ssd_pallas.chunk_output`` (forward and backward, at
Mamba-2 1.4B's heads: chunk 256, 8 heads of 64 a group, state 128, bf16) is
lowered by Pallas to Triton IR, as XLA would get it, then compiled for sm_90
by the pip Triton and read back with its cuobjdump. That Triton is not the
one inside XLA, so the numbers show tendencies (which tilings spill, how
many programs fit an SM), not what XLA will build. ``programs/SM`` is the
smaller of 65536 registers and 227 KiB of shared memory over a program's use.
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, lowering

from jax_flashoverlap import models

REGISTERS_PER_SM, SHARED_PER_SM = 65536, 227 * 1024


def triton_ir(block: int, cols: int) -> dict[str, str]:
    """{kernel name: its Triton IR} of the chunk output's forward and backward."""
    captured = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    s, chunk, groups, heads, p, n = 512, 256, 2, 8, 64, 128
    shapes = [((1, groups, s // chunk, chunk, chunk), jnp.bfloat16),
              ((s, 1, groups, heads, p), jnp.bfloat16), ((s, 1, groups, heads), jnp.float32),
              ((s, 1, groups, heads), jnp.float32), ((s, 1, groups, n), jnp.bfloat16),
              ((1, groups, heads, s // chunk, p, n), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]

    def grads(*t):
        def loss(*u):
            return jnp.sum(models.ssd_pallas.chunk_output(
                *u, chunk_size=chunk, block=block, block_cols=cols, skip=t[2]))
        return jax.grad(loss, argnums=tuple(range(6)))(*t)
    try:
        jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = lower
    return {re.search(r"tt.func public @(\w+)", ir).group(1): ir for ir in captured}


def resources(ir: str, warps: int, stages: int, workdir: Path) -> dict:
    """Compiled for sm_90: registers, spill stack, shared memory, wgmma count."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = workdir / "kernel.ttir"
    source.write_text(ir)
    kernel = triton.compile(str(source), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    return {"registers": registers, "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "shared": shared, "wgmma": sass.count("GMMA"),
            "programs_per_sm": min(REGISTERS_PER_SM // (registers * 32 * warps),
                                   SHARED_PER_SM // max(shared, 1))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", nargs="+", default=["64x64", "64x32", "128x64", "128x32"],
                        metavar="ROWSxCOLS")
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("needs the triton package (pip install triton; no GPU needed)", file=sys.stderr)
        return 2
    print(f"pip triton {triton.__version__}, sm_90; jax {jax.__version__}")
    print("| tiles | warps | stages | kernel | registers | spill stack (B) | shared (B) "
          "| wgmma | programs/SM |\n|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for tile in args.tiles:
            block, cols = (int(side) for side in tile.split("x"))
            irs = triton_ir(block, cols)
            for warps, stages in itertools.product(args.warps, args.stages):
                for name, ir in irs.items():
                    r = resources(ir, warps, stages, Path(tmp))
                    print(f"| {tile} | {warps} | {stages} | {name} | {r['registers']} | "
                          f"{r['stack']} | {r['shared']} | {r['wgmma']} | "
                          f"{r['programs_per_sm']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
