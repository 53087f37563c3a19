"""Tuning tables, dispatch.resolve/explain, and jax-flashoverlap-tune on CPU."""

import functools
import json
import logging

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import cpu_mesh, put, random

import jax_flashoverlap as jfo
from jax_flashoverlap import cuda_policy, dispatch, tuning
from jax_flashoverlap.cli import tune


def _entry(op="all_gather_matmul", rows=1024, k=4096, n_out=4096, times=None, **kw):
    fields = dict(device_kind="NVIDIA H200", devices=2, axis_size=2, dtype="bfloat16")
    fields.update(kw)
    shape = (rows, k, n_out)
    return tuning.Entry(op=op, rows=rows, weight=k * n_out, shape=shape,
                        times_us=times or {"xla": 2.0, "cuda": 1.0}, source="test", **fields)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty tuning cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tuning.reload()
    yield tmp_path / "jax_flashoverlap" / "tuning.json"
    tuning.reload()


def _lookup(table, rows, k=4096, n_out=4096, dtype="bfloat16", op="all_gather_matmul", n=2):
    return table.lookup(op, [(rows, k), (k, n_out)], dtype, n, "NVIDIA H200", 2, 2)


def test_lookup_buckets_by_rows_then_nearest_weight():
    table = tuning.Table([_entry(rows=256, times={"xla": 1, "cuda": 2}),
                          _entry(rows=1024, k=4096, n_out=4096),
                          _entry(rows=1024, k=8192, n_out=14336, times={"xla": 1, "cuda": 3})])
    assert _lookup(table, 256)[0].rows == 256
    assert _lookup(table, 511)[0].rows == 256                     # same power-of-two bucket
    assert _lookup(table, 1500)[0].weight == 4096 * 4096          # nearest weight
    assert _lookup(table, 1500, k=8192, n_out=8192)[0].weight == 8192 * 14336
    assert _lookup(table, 1 << 20)[0].rows == 1024                # above all: the largest
    entry, why = _lookup(table, 128)
    assert entry is None and "smaller than every tuned" in why and "256" in why
    assert _lookup(table, 1024, dtype="float16")[0] is not None   # bf16's entries
    assert "not tuned" in _lookup(table, 1024, dtype="float32")[1]
    assert "not tuned" in _lookup(table, 1024, n=4)[1]
    entry, why = table.lookup("all_gather_matmul", [(1024, 8), (8, 8)], "bfloat16", 2,
                              "NVIDIA B200", 8, 2)
    assert entry is None and why == "no tuning table for NVIDIA B200 x8"


def test_table_round_trips_and_later_entries_win(tmp_path):
    first = tuning.Table([_entry(times={"xla": 1.0, "cuda": 2.0})])
    second = tuning.Table([_entry(times={"xla": 2.0, "cuda": 1.0})])
    merged = first.merged(second)
    assert len(merged.entries) == 1 and merged.entries[0].fastest(["xla", "cuda"]) == "cuda"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(merged.to_json()))
    assert tuning.read(path).entries == merged.entries
    path.write_text(json.dumps({"version": 0, "entries": []}))
    with pytest.raises(ValueError, match="version 0.*rerun jax-flashoverlap-tune"):
        tuning.read(path)


def test_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path() == tmp_path / "jax_flashoverlap" / "tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(tuning.cache_path()).endswith(".cache/jax_flashoverlap/tuning.json")


def test_an_untuned_machine_runs_xla_and_says_so_once(cache, caplog):
    dispatch._say_untuned_once.cache_clear()
    shapes = [(64, 32), (32, 32)]
    with caplog.at_level(logging.WARNING, logger="jax_flashoverlap"):
        for _ in range(3):
            got = dispatch.resolve("all_gather_matmul", shapes, "float32", 8, platform="cpu")
            assert got.impl == "xla" and got.reason == "no tuning table for cpu x8"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "run `jax-flashoverlap-tune --axis-size 8 --dtype float32` once" in lines[0]


def test_a_table_without_this_axis_size_says_which_to_tune(cache, caplog, tmp_path):
    """Tuned at 8 ranks, a model's axis of 2 still runs xla, and the note
    names the axis size to tune, once."""
    dispatch._say_untuned_once.cache_clear()
    out = tmp_path / "table.json"
    tune.main(["--ops", "all_gather_matmul", "--reps", "1", "--budget-s", "1e-6",
               "--output", str(out)])
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(out.read_text())
    tuning.reload()
    shapes = [(64, 32), (32, 32)]
    with caplog.at_level(logging.WARNING, logger="jax_flashoverlap"):
        for _ in range(2):
            got = dispatch.resolve("all_gather_matmul", shapes, "float32", 2, platform="cpu")
            assert got.impl == "xla" and "not tuned on cpu x8 for axis size 2" in got.reason
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "--axis-size 2 --dtype float32" in lines[0], lines


def test_explain_names_the_measurement(cache, capsys, monkeypatch):
    monkeypatch.setattr(jfo._extension, "cuda_ops_available", lambda target=None: True)
    monkeypatch.setattr(cuda_policy, "process_cuda_devices", lambda: 2)
    got = dispatch.explain("all_gather_matmul", [1024, 4096], [4096, 4096], "bfloat16", 2,
                           platform="cuda", device_kind="NVIDIA H200", devices=2)
    printed = capsys.readouterr().out
    assert got.impl == "cuda"
    assert "auto -> 'cuda'" in printed and "1024x4096x4096" in printed and "µs" in printed
    assert "nearest" not in printed  # that shape itself was measured
    got = dispatch.explain("all_reduce", [8, 2048], None, "bfloat16", 2, platform="cuda",
                           device_kind="NVIDIA H200", devices=2)
    assert got.reason.startswith("another shape's (same or next lower row bucket, nearest "
                                 "weight): measured on NVIDIA H200 x2"), got.reason
    with pytest.raises(ValueError, match="takes w_shape"):
        dispatch.explain("all_gather_matmul", [1024, 4096])
    assert dispatch.explain("all_reduce", [4, 1024], axis_size=1).reason.startswith("one rank")
    for args, kwargs, match in [
            (([1024, 4096], [2048, 4096]), {}, r"w_shape must be \[k, n_out\] with k = "
                                               r"x_shape\[-1\] = 4096, got \[2048, 4096\]"),
            (([1024, 4096], [4096, 4096], "int8"), {}, "take float32, bfloat16 or float16, "
                                                       "got int8"),
            (([1024, 4096], [4096, 4096]), dict(axis_size=0), "axis_size must be an int >= 1"),
            (([], [4096, 4096]), {}, "x_shape must have at least one dim")]:
        with pytest.raises(ValueError, match=match):
            dispatch.explain("all_gather_matmul", *args, **kwargs)


def test_explain_says_untuned_once_not_twice(cache, capsys, caplog):
    """On a machine with no table, explain prints the decision, with why,
    and logs nothing on top of it."""
    dispatch._say_untuned_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="jax_flashoverlap"):
        got = dispatch.explain("all_gather_matmul", [64, 32], [32, 32], "float32", 3,
                               platform="cpu")
    assert got.impl == "xla" and "no tuning table for cpu x8" in capsys.readouterr().out
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def _compiled_collectives(op, mesh, args, in_specs, out_spec, impl):
    fn = functools.partial(getattr(jfo, op), axis_name="tensor", impl=impl)
    hlo = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)).lower(
        *args).compile().as_text()
    return {c for c in ("all-gather", "collective-permute", "all-reduce", "reduce-scatter")
            if c in hlo}


def test_auto_follows_the_cache_on_cpu(cache, rng):
    """A cached entry that says "decomposed" makes "auto" compile the
    decomposed schedule; without it "auto" is XLA's collective."""
    mesh = cpu_mesh(8)
    x, w = random(rng, (8 * 32, 64), "float32"), random(rng, (64, 8 * 16), "float32")
    args = (put(mesh, x, P("tensor")), put(mesh, w, P(None, "tensor")))
    specs = ((P("tensor"), P(None, "tensor")), P(None, "tensor"))
    xla = _compiled_collectives("all_gather_matmul", mesh, args, *specs, "xla")
    decomposed = _compiled_collectives("all_gather_matmul", mesh, args, *specs, "decomposed")
    assert xla != decomposed
    assert _compiled_collectives("all_gather_matmul", mesh, args, *specs, "auto") == xla
    entry = _entry(rows=32, k=64, n_out=16, device_kind="cpu", devices=8, axis_size=8,
                   dtype="float32", times={"xla": 2.0, "decomposed": 1.0})
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(tuning.Table([entry]).to_json()))
    tuning.reload()
    jax.clear_caches()  # "auto" is decided at lowering: recompile
    assert _compiled_collectives("all_gather_matmul", mesh, args, *specs, "auto") == decomposed


@pytest.mark.slow  # the whole command; test_tune_budget_output_and_verify runs a shape of it
def test_tune_command_end_to_end_on_cpu(cache, capsys):
    """jax-flashoverlap-tune measures xla against decomposed, checks them,
    writes the cache, and "auto" then resolves to each shape's fastest."""
    tune.main(["--ops", "matmul_all_reduce", "all_reduce", "--reps", "1"])
    out = capsys.readouterr().out
    assert "wrote 6 entries" in out and str(cache) in out
    table = tuning.read(cache)
    assert {e.op for e in table.entries} == {"matmul_all_reduce", "all_reduce"}
    for e in table.entries:
        assert set(e.times_us) == {"xla", "decomposed"} and e.device_kind == "cpu"
        shapes = tune._per_rank_shapes(e.op, e.shape, 8, np.float32)
        got = dispatch.resolve(e.op, shapes, "float32", 8, platform="cpu")
        assert got.impl == min(e.times_us, key=e.times_us.get) and "tune" in got.reason


def test_tune_model_shapes():
    cases = tune.model_grid("transformer", "1b", 2, 4096, 1, 2)
    assert ("all_gather_matmul", (2048, 2048, 8192)) in cases       # gate_up: 2f/tp columns
    assert ("matmul_reduce_scatter", (2048, 4096, 2048)) in cases   # down: f/tp rows
    assert ("matmul_all_reduce", (1, 4096, 2048)) in cases          # the decode step's
    assert ("all_reduce", (4096,)) in cases


@pytest.mark.parametrize("argv,match", [
    (["--axis-size", "1"], "at least 2"),
    (["--no-grid"], "without --model"),
    (["--axis-size", "4", "--mesh", "1x2"], "disagree: the tensor axis tuned is the mesh's"),
    (["--mesh", "8x1"], "the tensor size must be at least 2"),
    (["--mesh", "two"], "expected DATAxTENSOR"),
    (["--size", "tiny"], "--size applies with --model"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--model", "transformer", "--size", "huge"], "invalid choice: 'huge'")])
def test_tune_flags_name_the_fix(argv, match, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(argv)
    assert match in capsys.readouterr().err


def test_tune_budget_output_and_verify(tmp_path, capsys):
    """--budget-s stops after the first shape, --output names the file it
    writes, --verify then times "auto" against the fastest impl there."""
    out = tmp_path / "table.json"
    tune.main(["--ops", "all_reduce", "--reps", "1", "--budget-s", "1e-6", "--output", str(out),
               "--verify"])
    printed = capsys.readouterr().out
    assert "stopping after 1 of" in printed and f"wrote 1 entries to {out}" in printed
    assert f'(impl="auto" reads {tuning.cache_path()} only: merge this file there' in printed
    assert len(tuning.read(out).entries) == 1
    assert "verify all_reduce" in printed and "verify: auto is at most" in printed


def test_tune_measures_at_the_mesh_tensor_size(tmp_path, capsys):
    """--mesh 1x2 on 8 devices tunes an axis of 2, the size a model on that
    mesh looks up, not all 8 devices."""
    out = tmp_path / "table.json"
    tune.main(["--ops", "all_reduce", "--reps", "1", "--budget-s", "1e-6", "--mesh", "1x2",
               "--output", str(out)])
    assert "axis size 2," in capsys.readouterr().out
    assert [e.axis_size for e in tuning.read(out).entries] == [2]


def test_verify_times_auto_as_the_program_it_compiles_to(monkeypatch):
    """Where auto's optimized HLO is an impl's, verify times that impl in its
    place (the ratio is exactly 1 when it is also the fastest); where it is
    no impl's, auto itself is timed."""
    import io

    from jax_flashoverlap.cli.devices import ensure_cpu_devices

    ensure_cpu_devices(8)
    mesh = jax.make_mesh((8,), ("tensor",))
    entry = tuning.Entry("cpu", 8, 8, "float32", "all_reduce", 1, 4096, (4096,),
                         {"xla": 1.0, "decomposed": 2.0}, "test")
    rng = np.random.default_rng(0)
    timed = []
    real = tune.benchmarking.time_interleaved

    def spy(ops, *args, **kwargs):
        timed.append(sorted(ops))
        return real(ops, *args, **kwargs)

    monkeypatch.setattr(tune.benchmarking, "time_interleaved", spy)
    printed = io.StringIO()
    worst = tune._verify([entry], mesh, np.dtype(np.float32), rng, 3, printed)
    assert timed == [["decomposed", "xla"]]
    # On CPU decomposed's all-reduce is many times xla's (a ring of 8 steps).
    assert "auto runs xla's program" in printed.getvalue() and "fastest xla" in printed.getvalue()
    assert worst == 1.0

    programs = iter(range(100))
    monkeypatch.setattr(tune, "_program", lambda *args: next(programs))
    tune._verify([entry], mesh, np.dtype(np.float32), rng, 3, printed)
    assert timed[-1] == ["auto", "decomposed", "xla"]
