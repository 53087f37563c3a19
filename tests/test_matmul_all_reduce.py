import pytest
from support import assert_close, case, check_gradients, run_case

OP = "matmul_all_reduce"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
def test_matches_float64_reference(impl, n, dtype, rng):
    args, in_specs, out_specs, expected = case(OP, n, rng, dtype)
    assert_close(run_case(OP, n, args, in_specs, out_specs, impl=impl), expected, dtype)


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_chunk_counts(chunks, rng):
    args, in_specs, out_specs, expected = case(OP, 4, rng, "float32")
    y = run_case(OP, 4, args, in_specs, out_specs, impl="decomposed", chunks=chunks)
    assert_close(y, expected, "float32")


def test_on_data_and_tensor_mesh(rng):
    args, in_specs, out_specs, expected = case(OP, 2, rng, "float32")
    y = run_case(OP, 2, args, in_specs, out_specs, dp=4, impl="decomposed")
    assert_close(y, expected, "float32")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("impl", ["decomposed", "xla"])
def test_gradients(impl, n, rng):
    check_gradients(OP, n, impl, rng)
