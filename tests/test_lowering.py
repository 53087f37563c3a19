"""What impl="cuda" and impl="auto" lower to for the CUDA platform.

Lowered here, on CPUs, with ``lowering_platforms=("cuda",)``: the custom
calls, their attributes and the mesh-derived groups are visible in the
StableHLO text without a GPU. Needs the extension built with its CUDA ops.
"""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashoverlap as jfo
from jax_flashoverlap import _extension, _groups, _primitives, cuda_policy, dispatch

pytestmark = pytest.mark.skipif(not _extension.cuda_ops_available(),
                                reason="extension built without its CUDA ops")


@pytest.fixture(autouse=True)
def two_h200s(monkeypatch):
    """"auto" decides as on 2 H200s in one process (the shipped table)."""
    monkeypatch.setattr(dispatch, "_machine", lambda platform: ("NVIDIA H200", 2))


def _cuda_text(fn, mesh, shapes, in_specs, out_specs, dtype=jnp.bfloat16):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                              check_vma=False))
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec))
            for s, spec in zip(shapes, in_specs)]
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text):
    return re.findall(r"custom_call @(\w+)", text)


def _mesh(shape=(2,), names=("tp",), order=None):
    devices = np.asarray(jax.devices()[:int(np.prod(shape))])
    if order is not None:
        devices = devices[order]
    return jax.sharding.Mesh(devices.reshape(shape), names)


def _matmul_all_reduce_text(rows, cols, impl, k=1024):
    fn = functools.partial(jfo.matmul_all_reduce, axis_name="tp", impl=impl)
    return _cuda_text(fn, _mesh(), [(rows, k), (k, cols)], (P(None, "tp"), P("tp", None)), P())


def test_small_matmul_all_reduce_is_dot_then_the_all_reduce_kernel():
    text = _matmul_all_reduce_text(128, 256, "cuda")
    assert _custom_calls(text) == ["jfo_all_reduce"]
    assert "stablehlo.dot_general" in text
    assert "algorithm = 2" in text  # the Lamport one-shot for 64 KiB on 2 GPUs


def test_the_fused_kernel_from_just_above_the_limit():
    rows = cuda_policy.MATMUL_ALL_REDUCE_COMPOSED_MAX_BYTES // (2 * 1024)
    assert _custom_calls(_matmul_all_reduce_text(rows, 1024, "cuda")) == ["jfo_all_reduce"]
    text = _matmul_all_reduce_text(rows + 1, 1024, "cuda")
    assert _custom_calls(text) == ["jfo_matmul_all_reduce"]


# MLIR prints equal entries as one ("splat").
@pytest.mark.parametrize("rows,chunk_rows", [
    (2048, "dense<[1536, 512]> : tensor<2xi32>"), (4096, "dense<[2560, 1536]> : tensor<2xi32>"),
    (1024, "dense<512> : tensor<2xi32>"),
    (1000, "dense<1000> : tensor<1xi32>")])  # too few rows for 2 aligned chunks
def test_fused_matmul_all_reduce_parts_fill_whole_tiles(rows, chunk_rows):
    # 2 chunks on 2 GPUs: every chunk but the first a multiple of 2 * 256 rows.
    text = _matmul_all_reduce_text(rows, 8192, "cuda")
    assert _custom_calls(text) == ["jfo_matmul_all_reduce"]
    assert f"chunk_rows = {chunk_rows}" in text


def test_auto_keeps_to_measured_kernels():
    # The shipped table: dot + the all-reduce kernel where that ran (at most 8
    # MiB of result, from 128 rows), the fused kernel where it ran (from 2048
    # rows); XLA below 128 rows and where the kernel would differ from the one
    # measured (1024 rows with 16 MiB of result: measured composed, would fuse).
    assert _custom_calls(_matmul_all_reduce_text(1024, 4096, "auto")) == ["jfo_all_reduce"]
    assert _custom_calls(_matmul_all_reduce_text(512, 256, "auto")) == ["jfo_all_reduce"]
    # 4096 rows were measured fused only; this 2 MiB result would run composed.
    assert _custom_calls(_matmul_all_reduce_text(4096, 256, "auto")) == []
    assert _custom_calls(_matmul_all_reduce_text(4096, 2048, "auto")) == ["jfo_matmul_all_reduce"]
    assert _custom_calls(_matmul_all_reduce_text(2048, 4096, "auto")) == ["jfo_matmul_all_reduce"]
    assert _custom_calls(_matmul_all_reduce_text(1024, 8192, "auto")) == []
    assert _custom_calls(_matmul_all_reduce_text(128, 256, "auto")) == ["jfo_all_reduce"]
    assert _custom_calls(_matmul_all_reduce_text(64, 256, "auto")) == []


@pytest.mark.parametrize("dtype,want", [(jnp.bfloat16, ["jfo_all_reduce"]), (jnp.float32, [])])
def test_auto_all_reduce_on_two_gpus(dtype, want):
    fn = functools.partial(jfo.all_reduce, axis_name="tp")
    text = _cuda_text(fn, _mesh(), [(2, 4096)], (P("tp"),), P("tp"), dtype)
    assert _custom_calls(text) == want


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(_primitives.TIMEOUT_ENV, "1234")
    assert "timeout_ms = 1234" in _matmul_all_reduce_text(128, 256, "cuda")


def test_lowering_hands_the_extension_the_settings(monkeypatch):
    """A CUDA op's lowering is what updates the extension's settings, so the
    environment at the op's first lowering applies to its first run."""
    monkeypatch.setenv("JAX_FLASHOVERLAP_WORKSPACE_MB", "4096")
    monkeypatch.setenv("JAX_FLASHOVERLAP_GEMM_AUTOTUNE", "0")
    try:
        _matmul_all_reduce_text(128, 256, "cuda")
        assert _extension._module().settings() == {"workspace_mb": 4096, "peer_stores": True,
                                                   "gemm_autotune": False}
    finally:
        monkeypatch.delenv("JAX_FLASHOVERLAP_WORKSPACE_MB")
        monkeypatch.delenv("JAX_FLASHOVERLAP_GEMM_AUTOTUNE")
        _extension.push_settings()


@pytest.mark.parametrize("shape,names,order,groups", [
    ((2,), ("tp",), [1, 0], [1, 0]),
    ((2, 2), ("data", "tp"), None, [0, 1, 2, 3]),
    ((2, 2), ("tp", "data"), None, [0, 2, 1, 3]),
])
def test_groups_are_mesh_positions_along_the_axis(shape, names, order, groups):
    mesh = _mesh(shape, names, order)
    fn = functools.partial(jfo.all_reduce, axis_name="tp", impl="cuda")
    spec = P(*names)
    text = _cuda_text(fn, mesh, [(*shape, 64)], (spec,), spec)
    ordinals = [d.local_hardware_id for d in np.asarray(jax.devices()[:len(groups)])]
    want = [ordinals[g] for g in groups]
    found = re.search(r"group_ordinals = dense<\[([\d, ]+)\]>", text)
    assert found and [int(v) for v in found.group(1).split(",")] == want


@pytest.fixture
def across_processes(monkeypatch):
    """The all-reduce axis treated as one device in each of several processes;
    returns a switch that starts (fakes) NVSHMEM with a given capacity."""
    from jax_flashoverlap import nvshmem

    monkeypatch.setattr(_groups, "axis_is_all_processes", lambda ctx, n: True)

    def start(capacity=1 << 30):
        monkeypatch.setattr(nvshmem, "is_initialized", lambda: True)
        monkeypatch.setattr(nvshmem, "max_message_bytes", lambda node_size=None: capacity)
    monkeypatch.setattr(nvshmem, "is_initialized", lambda: False)
    return start


def _all_reduce_text(impl, dtype, cols=4096):
    fn = functools.partial(jfo.all_reduce, axis_name="tp", impl=impl)
    return _cuda_text(fn, _mesh(), [(2, cols)], (P("tp"),), P("tp"), dtype)


def test_all_reduce_across_processes_runs_on_nvshmem(across_processes):
    across_processes()
    text = _all_reduce_text("auto", jnp.bfloat16)
    assert _custom_calls(text) == ["jfo_nvshmem_all_reduce"]
    assert "node_size = 1" in text and "timeout_ms = " in text
    # auto: measured for 16-bit messages up to 4 MiB; cuda: whatever fits.
    assert _custom_calls(_all_reduce_text("auto", jnp.float32)) == []
    assert _custom_calls(_all_reduce_text("auto", jnp.bfloat16, cols=(4 << 20) // 2 + 8)) == []
    assert _custom_calls(_all_reduce_text("cuda", jnp.float32)) == ["jfo_nvshmem_all_reduce"]


def test_all_reduce_across_processes_without_nvshmem(across_processes, monkeypatch):
    """Without NVSHMEM, the node transport: "cuda" runs the all-reduce kernel,
    "auto" psum unless a measurement across processes says otherwise."""
    monkeypatch.setattr(_groups, "group_processes", lambda ctx, axis_name, n: 2)
    assert _custom_calls(_all_reduce_text("auto", jnp.bfloat16)) == []  # psum
    assert _custom_calls(_all_reduce_text("cuda", jnp.bfloat16)) == ["jfo_all_reduce"]
    with pytest.raises(ValueError, match=r"call jax_flashoverlap\.nvshmem\.initialize\(\) first"):
        dispatch.all_reduce_across_processes(8192, jnp.bfloat16, "cuda", None)
    across_processes(capacity=1024)
    assert _custom_calls(_all_reduce_text("auto", jnp.bfloat16)) == []  # over the buffers
    with pytest.raises(ValueError, match=r"8192 bytes per process exceed the NVSHMEM buffers"):
        _all_reduce_text("cuda", jnp.bfloat16)


@pytest.mark.parametrize("processes_of_devices,process_count,want", [
    ((0, 1), 2, True),
    ((0, 0), 2, False),  # two devices of one process, none of the other
    ((0, 1), 4, False),  # the axis is not every process
    ((0, 1, 2, 3), 4, True),
])
def test_axis_of_all_processes(monkeypatch, processes_of_devices, process_count, want):
    from types import SimpleNamespace

    devices = np.asarray([SimpleNamespace(process_index=p) for p in processes_of_devices])
    mesh = SimpleNamespace(size=devices.size, devices=devices)
    monkeypatch.setattr(_primitives._jax_shim, "lowering_mesh", lambda ctx: mesh)
    monkeypatch.setattr(jax, "process_count", lambda: process_count)
    assert _groups.axis_is_all_processes(None, devices.size) is want


def test_a_cuda_op_lowered_under_lazy_loading_warns(monkeypatch):
    from jax_flashoverlap import _module_loading
    monkeypatch.setattr(_module_loading, "_warned", False)
    monkeypatch.setattr(_module_loading, "driver_mode", lambda: "lazy")
    with pytest.warns(RuntimeWarning, match="loads kernels lazily"):
        _matmul_all_reduce_text(128, 256, "cuda")


# Per collective matmul: the specs of its global (x, w) and of its result.
_MATMUL_SPECS = {
    "all_gather_matmul": ((P("tp"), P(None, "tp")), P(None, "tp")),
    "matmul_reduce_scatter": ((P(None, "tp"), P("tp", None)), P("tp")),
}


def _collective_matmul_text(op, rows=256, **kwargs):
    """``op`` with impl="cuda" lowered for CUDA on 2 devices, global x
    [rows, 128] and w [128, 64]."""
    fn = functools.partial(getattr(jfo, op), axis_name="tp", impl="cuda", **kwargs)
    in_specs, out_spec = _MATMUL_SPECS[op]
    return _cuda_text(fn, _mesh(), [(rows, 128), (128, 64)], in_specs, out_spec)


@pytest.mark.parametrize("fold, flag", [("gemm_input", 0), ("add_after", 1)])
def test_reduce_scatter_fold_is_an_attribute(monkeypatch, fold, flag):
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_FOLD", fold)
    text = _collective_matmul_text("matmul_reduce_scatter")
    assert _custom_calls(text) == ["jfo_matmul_reduce_scatter"]
    assert re.search(rf"add_after = {flag} : i32", text), text[-2000:]


def _with_cutlass(monkeypatch, version: str) -> None:
    """build_info() as the extension's, with ``cutlass`` = version."""
    built = _extension.build_info()
    monkeypatch.setattr(_extension, "build_info", lambda: {**built, "cutlass": version})


# Each op's GEMM setting, and its lowering (matmul_all_reduce's fused kernel).
_GEMM_SETTINGS = {
    "all_gather_matmul": ("ALL_GATHER_GEMM", lambda: _collective_matmul_text("all_gather_matmul")),
    "matmul_reduce_scatter": ("REDUCE_SCATTER_GEMM",
                              lambda: _collective_matmul_text("matmul_reduce_scatter")),
    "matmul_all_reduce": ("MATMUL_ALL_REDUCE_GEMM",
                          lambda: _matmul_all_reduce_text(2048, 8192, "cuda")),
}


@pytest.mark.parametrize("op", list(_GEMM_SETTINGS))
@pytest.mark.parametrize("gemm, flag", [("row_blocks", 0), ("tile_signalled", 1)])
def test_the_gemm_is_an_attribute(monkeypatch, op, gemm, flag):
    setting, lower = _GEMM_SETTINGS[op]
    monkeypatch.setattr(cuda_policy, setting, gemm)
    _with_cutlass(monkeypatch, "4.2.0.0")
    text = lower()
    assert _custom_calls(text) == ["jfo_" + op]
    assert re.search(rf"tile_signalled = {flag} : i32", text), text[-2000:]


def test_the_tile_signalled_gemm_needs_cutlass(monkeypatch):
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_GEMM", "tile_signalled")
    _with_cutlass(monkeypatch, "")
    with pytest.raises(ValueError, match=r"needs the extension built with CUTLASS: pip install "
                                         r"nvidia-cutlass==4.2.0.0.*'row_blocks'"):
        _collective_matmul_text("matmul_reduce_scatter")


def test_the_tile_signalled_gemm_takes_bf16_with_k_and_n_multiples_of_8(monkeypatch):
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_GEMM", "tile_signalled")
    _with_cutlass(monkeypatch, "4.2.0.0")
    fn = functools.partial(jfo.matmul_reduce_scatter, axis_name="tp", impl="cuda")
    in_specs, out_spec = _MATMUL_SPECS["matmul_reduce_scatter"]
    with pytest.raises(ValueError, match=r"takes bf16 x and w with K and N multiples of 8, got "
                                         r"x float32"):
        _cuda_text(fn, _mesh(), [(256, 128), (128, 64)], in_specs, out_spec, jnp.float32)
    with pytest.raises(ValueError, match=r"got x bfloat16 \(256, 64\) and w bfloat16 "
                                         r"\(64, 60\)"):
        _cuda_text(fn, _mesh(), [(256, 128), (128, 60)], in_specs, out_spec)


def test_the_tile_signalled_all_gather_runs_on_two_devices_only(monkeypatch):
    monkeypatch.setattr(cuda_policy, "ALL_GATHER_GEMM", "tile_signalled")
    _with_cutlass(monkeypatch, "4.2.0.0")
    fn = functools.partial(jfo.all_gather_matmul, axis_name="tp", impl="cuda")
    in_specs, out_spec = _MATMUL_SPECS["all_gather_matmul"]
    with pytest.raises(ValueError, match=r"\(cuda_policy.ALL_GATHER_GEMM\) runs on an axis of "
                                         r"2 devices, got 4; set cuda_policy.ALL_GATHER_GEMM = "
                                         r"'row_blocks'"):
        _cuda_text(fn, _mesh((4,)), [(256, 128), (128, 64)], in_specs, out_spec)


def test_the_tile_signalled_all_reduce_gemm_is_checked_only_where_the_fused_kernel_runs(
        monkeypatch):
    monkeypatch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_GEMM", "tile_signalled")
    _with_cutlass(monkeypatch, "")
    # A small result: XLA's dot and the all-reduce kernel, no tile GEMM.
    assert _custom_calls(_matmul_all_reduce_text(128, 256, "cuda")) == ["jfo_all_reduce"]
    with pytest.raises(ValueError, match=r"cuda_policy.MATMUL_ALL_REDUCE_GEMM\) needs the "
                                         r"extension built with CUTLASS.*MATMUL_ALL_REDUCE_GEMM "
                                         r"= 'row_blocks'"):
        _matmul_all_reduce_text(2048, 8192, "cuda")


def test_an_unknown_matmul_all_reduce_gemm_names_the_choices(monkeypatch):
    monkeypatch.setattr(cuda_policy, "MATMUL_ALL_REDUCE_GEMM", "tiles")
    with pytest.raises(ValueError, match=r"cuda_policy.MATMUL_ALL_REDUCE_GEMM must be one of "
                                         r"\('row_blocks', 'tile_signalled'\), got 'tiles'"):
        _matmul_all_reduce_text(2048, 8192, "cuda")


@pytest.mark.parametrize("op", list(_MATMUL_SPECS))
@pytest.mark.parametrize("where, flag", [("side", 0), ("xla", 1)])
def test_peer_wait_stream_is_an_attribute(monkeypatch, op, where, flag):
    monkeypatch.setattr(cuda_policy, "PEER_WAIT_STREAM", where)
    text = _collective_matmul_text(op)
    assert _custom_calls(text) == ["jfo_" + op]
    assert re.search(rf"waits_on_xla_stream = {flag} : i32", text), text[-2000:]


def test_an_unknown_peer_wait_stream_names_the_choices(monkeypatch):
    monkeypatch.setattr(cuda_policy, "PEER_WAIT_STREAM", "nearby")
    with pytest.raises(ValueError, match=r"PEER_WAIT_STREAM must be one of \('side', 'xla'\)"):
        _collective_matmul_text("all_gather_matmul")


def test_an_unknown_reduce_scatter_fold_names_the_choices(monkeypatch):
    monkeypatch.setattr(cuda_policy, "REDUCE_SCATTER_FOLD", "sideways")
    with pytest.raises(ValueError, match="gemm_input"):
        _collective_matmul_text("matmul_reduce_scatter")


def _lamport_text(elements):
    fn = functools.partial(jfo.all_reduce, axis_name="tp", impl="cuda", algorithm="lamport")
    return _cuda_text(fn, _mesh(), [(2 * elements,)], (P("tp"),), P(), dtype=jnp.float32)


def test_lamport_lowers_to_algorithm_2_up_to_its_limit():
    limit = cuda_policy.lamport_max_bytes()
    text = _lamport_text(limit // 4)
    assert _custom_calls(text) == ["jfo_all_reduce"]
    assert "algorithm = 2 : i32" in text
    with pytest.raises(ValueError,
                       match=rf"algorithm='lamport'\) takes up to {limit >> 10} KiB.*one_shot"):
        _lamport_text(limit // 4 + 1)


def test_lamport_limit_shrinks_with_more_local_gpus():
    """Mirrors LamportSlotBytes: one parity of every sender's slot in 3 MiB."""
    assert [cuda_policy.lamport_max_bytes(d) >> 10 for d in (1, 2, 4, 8, 16)] == [
        2048, 2048, 1024, 384, 192]


def _chunks_attribute(op, rows_per_rank, chunks):
    """The ``chunks`` attribute impl="cuda" ``op`` lowers to on 2 GPUs."""
    text = _collective_matmul_text(op, rows=2 * rows_per_rank, chunks=chunks)
    return int(re.search(r"chunks = (\d+) : i32", text).group(1))


@pytest.mark.parametrize("op", list(_MATMUL_SPECS))
def test_chunks_none_is_picked_by_shape_and_an_int_is_kept(op):
    rows = cuda_policy.TWO_CHUNKS_FROM_ROWS[op]
    assert _chunks_attribute(op, rows, None) == 2
    assert _chunks_attribute(op, rows - 8, None) == 1
    assert _chunks_attribute(op, rows, 3) == 3


def test_backward_ops_pick_chunks_by_their_own_shapes():
    """all_gather_matmul's backward is a matmul_reduce_scatter: its chunks
    follow that op's rule for the same rows per rank."""
    rows = cuda_policy.TWO_CHUNKS_FROM_ROWS["matmul_reduce_scatter"]
    assert rows < cuda_policy.TWO_CHUNKS_FROM_ROWS["all_gather_matmul"]

    def loss(x, w):
        return jfo.all_gather_matmul(x, w, "tp", impl="cuda").astype(jnp.float32).sum()

    mesh, (specs, _) = _mesh(), _MATMUL_SPECS["all_gather_matmul"]
    f = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=specs,
                              out_specs=specs))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
            for s, spec in zip([(2 * rows, 64), (64, 32)], specs)]
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["jfo_all_gather_matmul", "jfo_matmul_reduce_scatter"]
    assert re.findall(r"chunks = (\d+) : i32", text) == ["1", "2"]


def test_fused_matmul_all_reduce_refuses_more_events_than_a_call_has():
    """8 ranks: 22 events a chunk; 46 chunks would need 1028 of the 1024, an
    error at compile time instead of halfway through a call (which would
    leave the peers' counters out of step)."""
    mesh = _mesh((8,))
    rows = 1 << 19  # enough for 46 aligned chunks of shrinking size

    def text(chunks):
        fn = functools.partial(jfo.matmul_all_reduce, axis_name="tp", impl="cuda",
                               chunks=chunks)
        return _cuda_text(fn, mesh, [(rows, 8 * 16), (8 * 16, 64)], (P(None, "tp"), P("tp")),
                          P())

    assert "chunk_rows" in text(45)
    with pytest.raises(ValueError, match=r"46 chunks on 8 ranks need 1028 CUDA events per "
                                         r"call, more than 1024; use chunks <= 45"):
        text(46)


# What each handler binds (ffi/src/<op>.cu: `.Attr<T>("name")`), and the
# Python values that fit each type.
_FFI_TYPES = {"int32_t": lambda v: isinstance(v, np.int32),
              "I32Span": lambda v: isinstance(v, np.ndarray) and v.dtype == np.int32
              and v.ndim == 1,
              "float": lambda v: isinstance(v, np.float32)}
_SAMPLE_OPTIONS = {"all_gather_matmul": {"chunks": 2, "peer_wait_stream": "side",
                                         "gemm": "row_blocks"},
                   "matmul_reduce_scatter": {"chunks": 2, "peer_wait_stream": "side",
                                             "fold": "add_after", "gemm": "row_blocks"},
                   "matmul_all_reduce": {"chunk_rows": [16, 8], "gemm": "tile_signalled"},
                   "all_reduce": {"algorithm": "lamport"}}


def _handler_attrs(source: str) -> dict[str, str]:
    text = (pathlib.Path(__file__).resolve().parents[1] / "ffi" / "src" / source).read_text()
    return {name: kind for kind, name in re.findall(r'\.Attr<(\w+)>\("(\w+)"\)', text)}


@pytest.mark.parametrize("op", sorted(_primitives.OPS))
def test_python_sends_every_attribute_the_handler_binds(op):
    """The attribute names and types Python sends for impl="cuda" are the
    ones the op's C++ handler binds: a name matched by string alone
    would fail only on a GPU, at the call."""
    definition = _primitives.OPS[op]
    sent = {**_primitives.transport_attrs(np.arange(2), 2, 1000),
            **definition.cuda_attrs(2, dict(_SAMPLE_OPTIONS[op]))}
    bound = _handler_attrs(definition.ffi_target.removeprefix("jfo_") + ".cu")
    assert sorted(sent) == sorted(bound), (sorted(sent), sorted(bound))
    for name, kind in bound.items():
        assert _FFI_TYPES[kind](sent[name]), (name, kind, type(sent[name]))


def test_the_nvshmem_all_reduce_sends_what_its_handler_binds(monkeypatch):
    from jax_flashoverlap import nvshmem

    sent = {}
    monkeypatch.setattr(jax.ffi, "ffi_call",
                        lambda target, shape: lambda x, **attrs: sent.update(attrs) or x)
    nvshmem.ffi_all_reduce(jnp.ones(4), node_size=1, timeout_ms=100)
    bound = _handler_attrs("nvshmem/hierarchical_all_reduce.cu")
    assert sorted(sent) == sorted(bound) == ["node_size", "timeout_ms"]
    for name, kind in bound.items():
        assert _FFI_TYPES[kind](sent[name]), (name, kind, type(sent[name]))
