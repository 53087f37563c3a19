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


def test_off_cuda_it_is_an_error_naming_the_fix():
    mesh = cpu_mesh(2)
    with pytest.raises(ValueError, match="lowers only for CUDA GPUs.*platform_dependent"):
        _program(mesh, invariant=False).trace(jnp.zeros((4, 16), jnp.float32)).lower(
            lowering_platforms=("cpu",))
