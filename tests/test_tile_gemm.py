"""The tile-signalled GEMM (``jfo_tile_gemm``, built with CUTLASS): its
product against float64 out of poisoned memory, and every row block's
counter, on a Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_close, f64, poison_allocator, random

import jax_flashoverlap as jfo

TILE_ROWS, TILE_COLS = 256, 128  # ffi/src/tile_gemm.h


def _tile_gemm(x, w):
    """(x @ w [M, N] bf16, counters [ceil(M / 256)] uint32) from zeroed counters."""
    m, n = x.shape[0], w.shape[1]
    call = jax.ffi.ffi_call("jfo_tile_gemm",
                            (jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                             jax.ShapeDtypeStruct((-(-m // TILE_ROWS),), jnp.uint32)))
    return call(x, w)


def test_built_only_with_the_pinned_cutlass():
    info = jfo.build_info()
    assert info["cutlass"] in ("", "4.2.0.0"), info["cutlass"]
    assert ("jfo_tile_gemm" in info["ffi_targets"]) == bool(info["cutlass"])


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(256, 64, 128), (1001, 520, 392), (2048, 4096, 4096),
                                     (4104, 1024, 776)])
def test_product_and_counters(m, k, n, rng):
    """Shapes whose last row block and column tile are partial, too."""
    if not jfo.build_info()["cutlass"]:
        pytest.skip("built without CUTLASS (pip install nvidia-cutlass==4.2.0.0, then "
                    "pip install --no-build-isolation .)")
    if jax.devices("gpu")[0].compute_capability != "9.0":
        pytest.skip("the tile GEMM runs on sm_90 GPUs")
    x, w = random(rng, (m, k), "bfloat16"), random(rng, (k, n), "bfloat16")
    poison_allocator(m * n * 2)
    y, counters = jax.jit(_tile_gemm)(x, w)
    assert_close(y, f64(x) @ f64(w), "bfloat16")
    np.testing.assert_array_equal(np.asarray(counters), -(-n // TILE_COLS))


@pytest.mark.gpu
def test_shapes_it_cannot_take_are_errors():
    if not jfo.build_info()["cutlass"] or jax.devices("gpu")[0].compute_capability != "9.0":
        pytest.skip("built without CUTLASS, or not an sm_90 GPU")
    x = jnp.zeros((256, 60), jnp.bfloat16)
    with pytest.raises(Exception, match="K and N positive multiples of 8"):
        jax.block_until_ready(jax.jit(_tile_gemm)(x, jnp.zeros((60, 128), jnp.bfloat16)))
