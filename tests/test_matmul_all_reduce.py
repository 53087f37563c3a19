import pytest
from support import (
    check_against_reference,
    check_gradients,
)

OP = "matmul_all_reduce"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
def test_matches_float64_reference(impl, n, dtype, rng):
    check_against_reference(OP, n, dtype, rng, impl=impl)


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_chunk_counts(chunks, rng):
    check_against_reference(OP, 4, "float32", rng, impl="decomposed", chunks=chunks)


def test_on_data_and_tensor_mesh(rng):
    check_against_reference(OP, 2, "float32", rng, dp=4, impl="decomposed")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("impl", ["decomposed", "xla"])
def test_gradients(impl, n, rng):
    check_gradients(OP, n, impl, rng)
