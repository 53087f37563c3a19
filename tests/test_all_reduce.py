import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import (
    case,
    check_against_reference,
    check_gradients,
    cpu_mesh,
    put,
)

import jax_flashoverlap as jfo
from jax_flashoverlap import _extension, _primitives, cuda_policy

OP = "all_reduce"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
def test_matches_float64_reference(impl, n, dtype, rng):
    check_against_reference(OP, n, dtype, rng, impl=impl)


def test_decomposed_is_identical_on_every_rank(rng):
    """Every rank must end with the same bits (the sum is formed once, then copied)."""
    n = 8
    args, *_ = case(OP, n, rng, "bfloat16")
    mesh = cpu_mesh(n)
    f = jax.jit(jax.shard_map(lambda x: jfo.all_reduce(x[0], "tensor", impl="decomposed")[None],
                              mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"),
                              check_vma=False))
    per_rank = np.asarray(f(put(mesh, args[0], P("tensor"))).astype("float32"))
    assert all(np.array_equal(per_rank[0], per_rank[r]) for r in range(n))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("impl", ["decomposed", "xla"])
def test_gradients(impl, n, rng):
    check_gradients(OP, n, impl, rng)


@pytest.mark.parametrize("impl", ["xla", "decomposed", "auto"])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "lamport"])
def test_algorithm_is_ignored_off_cuda(impl, algorithm, rng):
    check_against_reference(OP, 2, "float32", rng, impl=impl, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["oneshot", "ring", "", 1])
def test_unknown_algorithm_is_rejected(algorithm):
    mesh = cpu_mesh(2)
    f = jax.shard_map(lambda x: jfo.all_reduce(x, "tensor", algorithm=algorithm), mesh=mesh,
                      in_specs=P("tensor"), out_specs=P())
    with pytest.raises(ValueError,
                       match=r"algorithm must be None.*'one_shot', 'two_shot', 'lamport'.*got"):
        f(np.ones((2, 4), np.float32))


def test_algorithm_by_message_size_and_ranks():
    lamport, limit = cuda_policy.LAMPORT_AUTO_MAX_BYTES, cuda_policy.ONE_SHOT_MAX_BYTES
    assert lamport <= cuda_policy.lamport_max_bytes(2) <= cuda_policy.LAMPORT_MAX_BYTES
    bf16, f32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
    assert cuda_policy.all_reduce_algorithm(1, 2, bf16, local_devices=2) == "lamport"
    assert cuda_policy.all_reduce_algorithm(lamport, 2, np.float16, local_devices=2) == "lamport"
    assert cuda_policy.all_reduce_algorithm(lamport + 2, 2, bf16, local_devices=2) == "one_shot"
    # A 2-GPU group in a process with 8 GPUs has smaller Lamport slots.
    eight = cuda_policy.lamport_max_bytes(8)
    assert cuda_policy.all_reduce_algorithm(eight, 2, bf16, local_devices=8) == "lamport"
    assert cuda_policy.all_reduce_algorithm(eight + 2, 2, bf16, local_devices=8) == "one_shot"
    # Lamport was measured on 2 GPUs in bf16 only.
    assert cuda_policy.all_reduce_algorithm(2, 4, bf16) == "one_shot"
    assert cuda_policy.all_reduce_algorithm(4, 2, f32) == "one_shot"
    assert cuda_policy.all_reduce_algorithm(limit, 4, bf16) == "one_shot"
    assert cuda_policy.all_reduce_algorithm(limit + 2, 2, bf16) == "two_shot"
    assert cuda_policy.all_reduce_algorithm(256 << 20, 2, f32) == "two_shot"


def test_cuda_attribute_names_the_kernel():
    attrs = _primitives.OPS[OP].cuda_attrs
    assert attrs(2, {"algorithm": "one_shot"}) == {"algorithm": 0}
    assert attrs(2, {"algorithm": "two_shot"}) == {"algorithm": 1}
    assert attrs(2, {"algorithm": "lamport"}) == {"algorithm": 2}


def test_lamport_size_limit_applies_to_the_cuda_kernel_only(rng):
    """impl="xla" ignores the algorithm, so a message over the Lamport limit runs."""
    mesh = cpu_mesh(2)
    x = rng.standard_normal((2, cuda_policy.lamport_max_bytes() // 4 + 8)).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda v: jfo.all_reduce(v[0], "tensor", impl="xla",
                                                       algorithm="lamport"),
                              mesh=mesh, in_specs=P("tensor"), out_specs=P()))
    np.testing.assert_allclose(np.asarray(f(x)), x.sum(0), rtol=1e-6)


@pytest.mark.skipif(not _extension.cuda_ops_available(),
                    reason="extension built without its CUDA ops")
@pytest.mark.parametrize("algorithm, dtype, elements, expected", [
    (None, "float32", 16, "one_shot"), (None, "float32", 1 << 20, "one_shot"),
    (None, "float32", 4 << 20, "two_shot"), (None, "bfloat16", 16, "lamport"),
    ("two_shot", "float32", 16, "two_shot"), ("one_shot", "float32", 1 << 20, "one_shot"),
    ("lamport", "float32", 16, "lamport")])
def test_algorithm_is_resolved_when_lowered_for_cuda(algorithm, dtype, elements, expected):
    """None is picked from the per-rank message size where the impl is (at
    lowering, on 2 ranks: Lamport for small 16-bit messages); an explicit
    choice is kept."""
    text = _lowered_for_cuda(elements, algorithm, dtype)
    index = cuda_policy.ALL_REDUCE_KERNELS.index(expected)
    assert f"algorithm = {index} : i32" in text


def _lowered_for_cuda(elements, algorithm, dtype="bfloat16"):
    mesh = cpu_mesh(2)
    f = jax.jit(jax.shard_map(
        lambda x: jfo.all_reduce(x[0], "tensor", impl="cuda", algorithm=algorithm),
        mesh=mesh, in_specs=P("tensor"), out_specs=P(), check_vma=False))
    arg = jax.ShapeDtypeStruct((2, elements), jnp.dtype(dtype),
                               sharding=jax.sharding.NamedSharding(mesh, P("tensor")))
    return f.trace(arg).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(not _extension.cuda_ops_available(),
                    reason="extension built without its CUDA ops")
def test_copy_engine_algorithm_lowers_to_its_own_handler():
    """The copy-engine two-shot is a handler of its own (events and side
    streams, so not in the kernels' command-buffer-compatible one), with the
    policy's chunks; None never picks it."""
    text = _lowered_for_cuda(1 << 20, "copy_engine")
    assert "custom_call @jfo_all_reduce_copy_engine" in text
    assert "custom_call @jfo_all_reduce(" not in text
    assert f"chunks = {cuda_policy.COPY_ENGINE_ALL_REDUCE_CHUNKS} : i32" in text
    for elements in (16, 1 << 20, 64 << 20):
        assert "copy_engine" not in _lowered_for_cuda(elements, None)


@pytest.mark.skipif(not _extension.cuda_ops_available(),
                    reason="extension built without its CUDA ops")
def test_copy_engine_message_beyond_a_receive_slot_is_an_error():
    slot, _ = cuda_policy.transport_capacity()
    elements = slot // 2 + 8
    with pytest.raises(ValueError, match=r"more than the transport's receive slot of "
                                         rf"{slot} bytes; raise JAX_FLASHOVERLAP_WORKSPACE_MB"):
        _lowered_for_cuda(elements, "copy_engine")
