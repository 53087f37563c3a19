"""jax_flashoverlap.group_call: an FFI call lowered with its tensor group's
CUDA ordinals (lowered for CUDA here on CPU devices; nothing runs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import cpu_mesh

from jax_flashoverlap.group_call import group_ffi_call


def _program(mesh, invariant: bool):
    """A shard_map over (data, tensor) calling a made-up CUDA target."""
    def per_device(x):
        axes = jax.typeof(x).manual_axis_type
        if invariant:
            axes = axes.update(varying=axes.varying - {"tensor"})
        result = jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=axes)
        (y,) = group_ffi_call("made_up_target", (result,), x, axis_name="tensor",
                              input_output_aliases={0: 0}, scale=np.float32(0.5),
                              rows=np.asarray([3, 1, 2], np.int32))
        return y

    out_specs = P("data") if invariant else P("data", "tensor")
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data", "tensor"),
                                 out_specs=out_specs))


@pytest.mark.parametrize("tp, dp", [(2, 1), (4, 2)])
def test_the_cuda_lowering_carries_each_groups_ordinals(tp, dp):
    mesh = cpu_mesh(tp, dp)
    x = jnp.zeros((4 * dp, 8 * tp), jnp.float32)
    text = _program(mesh, invariant=False).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "custom_call @made_up_target" in line)
    groups = ", ".join(str(d.local_hardware_id) for row in np.asarray(mesh.devices)
                       for d in row)
    for attribute in (f"group_ordinals = dense<[{groups}]>", f"n = {tp} : i32",
                      "scale = 5.000000e-01 : f32", "rows = dense<[3, 1, 2]>",
                      "output_operand_aliases"):
        assert attribute in call, (attribute, call)


def test_a_result_typed_the_same_on_every_rank_leaves_the_axis():
    """Declared invariant over the tensor axis, the result needs no psum to
    leave shard_map replicated over it; as its operands vary, it is an error."""
    mesh = cpu_mesh(2, 2)
    x = jnp.zeros((8, 16), jnp.float32)
    _program(mesh, invariant=True).trace(x)
    with pytest.raises(ValueError, match="out_specs which require replication"):
        jax.jit(jax.shard_map(
            lambda x: group_ffi_call("made_up_target", (jax.ShapeDtypeStruct(x.shape, x.dtype),),
                                     x, axis_name="tensor")[0],
            mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data"))).trace(x)


def test_array_attributes_keep_their_shape():
    mesh = cpu_mesh(2)

    def per_device(x):
        return group_ffi_call("made_up_target", (jax.ShapeDtypeStruct(x.shape, x.dtype),), x,
                              axis_name="tensor", scalar=np.asarray(5, np.int32),
                              table=np.arange(6, dtype=np.int32).reshape(2, 3))[0]

    text = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(None, "tensor"),
                                 out_specs=P(None, "tensor"))).trace(
        jnp.zeros((4, 16), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "scalar = dense<5> : tensor<i32>" in text, text
    assert "table = dense<[[0, 1, 2], [3, 4, 5]]> : tensor<2x3xi32>" in text, text


def test_it_lowers_as_ffi_call_does_on_every_platform():
    """A CUDA-only target then fails where it is compiled, not lowered:
    inside platform_dependent a program lowers for CUDA and CPU together."""
    mesh = cpu_mesh(2)
    x = jnp.zeros((4, 16), jnp.float32)
    for platforms in (("cpu",), ("cuda", "cpu")):
        text = _program(mesh, invariant=False).trace(x).lower(
            lowering_platforms=platforms).as_text()
        assert "custom_call @made_up_target" in text

