"""The tile GEMMs (built with CUTLASS), on a Hopper GPU: the signalling one
(``jfo_tile_gemm``), its product against float64 out of poisoned memory and
every row block's counter; the gathering one (``jfo_gather_tile_gemm_check``),
which must read each block of rows only after its flag says it arrived."""

import functools

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


def _gather_check(x, w, *, block_rows, own_block, delay_us=2000, missing_block=-1,
                  calls_ahead=0, timeout_ms=5000):
    """x @ w [M, N] bf16 by the gathering GEMM, every block of ``block_rows``
    rows but the own one arriving from a second stream after ``delay_us``
    (``missing_block`` never; flags ``calls_ahead`` calls ahead)."""
    call = jax.ffi.ffi_call("jfo_gather_tile_gemm_check",
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.bfloat16))
    return call(x, w, block_rows=np.int64(block_rows), own_block=np.int64(own_block),
                delay_us=np.int64(delay_us), missing_block=np.int64(missing_block),
                calls_ahead=np.int64(calls_ahead), timeout_ms=np.int64(timeout_ms))


def _skip_without_tile_gemm():
    if not jfo.build_info()["cutlass"]:
        pytest.skip("built without CUTLASS (pip install nvidia-cutlass==4.2.0.0, then "
                    "pip install --no-build-isolation .)")
    if jax.devices("gpu")[0].compute_capability != "9.0":
        pytest.skip("the tile GEMMs run on sm_90 GPUs")


def test_built_only_with_the_pinned_cutlass():
    info = jfo.build_info()
    assert info["cutlass"] in ("", "4.2.0.0"), info["cutlass"]
    for target in ("jfo_tile_gemm", "jfo_gather_tile_gemm_check"):
        assert (target in info["ffi_targets"]) == bool(info["cutlass"]), target


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(256, 64, 128), (1001, 520, 392), (2048, 4096, 4096),
                                     (4104, 1024, 776)])
def test_product_and_counters(m, k, n, rng):
    """Shapes whose last row block and column tile are partial, too."""
    _skip_without_tile_gemm()
    x, w = random(rng, (m, k), "bfloat16"), random(rng, (k, n), "bfloat16")
    poison_allocator(m * n * 2)
    y, counters = jax.jit(_tile_gemm)(x, w)
    assert_close(y, f64(x) @ f64(w), "bfloat16")
    np.testing.assert_array_equal(np.asarray(counters), -(-n // TILE_COLS))


@pytest.mark.gpu
def test_shapes_it_cannot_take_are_errors():
    _skip_without_tile_gemm()
    x = jnp.zeros((256, 60), jnp.bfloat16)
    with pytest.raises(Exception, match="K and N positive multiples of 8"):
        jax.block_until_ready(jax.jit(_tile_gemm)(x, jnp.zeros((60, 128), jnp.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, block_rows, own_block", [
    (2048, 1024, 1024, 1024, 1),   # 2 ranks
    (4096, 2048, 3072, 1024, 2),   # 4 ranks, starting mid-way
    (1000, 520, 392, 256, 3),      # the last block and tiles partial
    (3000, 1024, 776, 750, 1),     # blocks that split tiles
])
def test_gathering_gemm_reads_rows_only_after_they_arrive(m, k, n, block_rows, own_block,
                                                          rng):
    """The other blocks arrive 2 ms after the start, long after a GEMM that
    did not wait would have read their NaN; its tiles are the signalling
    GEMM's, so the product is that GEMM's bit for bit."""
    _skip_without_tile_gemm()
    x, w = random(rng, (m, k), "bfloat16"), random(rng, (k, n), "bfloat16")
    poison_allocator(m * n * 2)
    gather = functools.partial(_gather_check, block_rows=block_rows, own_block=own_block)
    y = jax.jit(gather)(x, w)
    assert_close(y, f64(x) @ f64(w), "bfloat16")
    signalled, _ = jax.jit(_tile_gemm)(x, w)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                  np.asarray(signalled).view(np.uint16))


@pytest.mark.gpu
def test_gathering_gemm_takes_a_peer_one_call_ahead(rng):
    """A peer may lead by one call: its flag is past the expected value."""
    _skip_without_tile_gemm()
    x, w = random(rng, (1024, 256), "bfloat16"), random(rng, (256, 256), "bfloat16")
    y = jax.jit(functools.partial(_gather_check, block_rows=512, own_block=0,
                                  calls_ahead=1))(x, w)
    assert_close(y, f64(x) @ f64(w), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("fault, message", [
    ({"missing_block": 2}, r"rank 1 \(CUDA device \d+\) timed out after 200 ms waiting for "
                           r"rank 2 "),
    ({"calls_ahead": 2}, r"rank 1 \(CUDA device \d+\) found rank 2 \(CUDA device \d+\) at "
                         r"least two calls ahead"),
])
def test_gathering_gemm_ends_a_fault_in_an_error_naming_the_peer(fault, message, rng):
    """A block that never comes, or a peer two calls ahead, is the
    transport's error for all_gather_matmul, within the timeout."""
    _skip_without_tile_gemm()
    x, w = random(rng, (1024, 256), "bfloat16"), random(rng, (256, 256), "bfloat16")
    gather = functools.partial(_gather_check, block_rows=256, own_block=1, timeout_ms=200,
                               **fault)
    with pytest.raises(Exception, match="all_gather_matmul: " + message):
        jax.block_until_ready(jax.jit(gather)(x, w))
