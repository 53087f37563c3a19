"""The timing protocol: differences of loop lengths, checked arguments."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support import cpu_mesh, put, random

from jax_flashoverlap.benchmarking import (
    Timing,
    comparable_hlo,
    first_devices_mesh,
    loop_step_us,
    time_interleaved,
    time_per_op,
)


def test_times_a_dependent_loop(rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (2 * 64, 64), "float32"), P("tensor"))
    t = time_per_op(lambda a: jnp.tanh(a @ a.T), [x], mesh=mesh, in_specs=(P("tensor"),),
                    k1=1, k2=4, reps=3, warmup=1)
    assert isinstance(t, Timing) and t.reps == 3
    assert t.min_s <= t.median_s <= t.max_s
    assert t.median_us == pytest.approx(t.median_s * 1e6)


@pytest.mark.parametrize("k1,k2", [(0, 4), (4, 4), (5, 2)])
def test_rejects_bad_loop_lengths(k1, k2, rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (4, 4), "float32"), P("tensor"))
    with pytest.raises(ValueError, match=f"need 0 < k1 < k2, got k1={k1}, k2={k2}"):
        time_per_op(lambda a: a, [x], mesh=mesh, in_specs=(P("tensor"),), k1=k1, k2=k2)


def test_unrolled_loop_with_compiler_options(rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (2 * 32, 32), "float32"), P("tensor"))
    t = time_per_op(lambda a: jnp.tanh(a @ a.T), [x], mesh=mesh, in_specs=(P("tensor"),),
                    k1=2, k2=10, reps=3, warmup=1, unroll=4,
                    compiler_options={"xla_cpu_enable_fast_math": False})
    assert t.min_s <= t.median_s <= t.max_s and t.reps == 3


def test_rejects_unroll_below_one(rng):
    mesh = cpu_mesh(tp=2)
    x = put(mesh, random(rng, (4, 4), "float32"), P("tensor"))
    with pytest.raises(ValueError, match="unroll must be >= 1, got 0"):
        time_per_op(lambda a: a, [x], mesh=mesh, in_specs=(P("tensor"),), unroll=0)


def _sleeping_op(seconds):
    """An op of known cost: a host callback that sleeps ``seconds``, then
    returns its operand (so the loop carries a real dependency)."""
    import time

    import jax
    import numpy as np

    def sleep(a):
        time.sleep(seconds)
        return np.asarray(a)

    return lambda a: jax.pure_callback(sleep, jax.ShapeDtypeStruct(a.shape, a.dtype), a)


def _check_known_costs(timer):
    """time_per_op's estimate of a 10 ms op is 10 ms (within what one host
    call adds), and four times the work takes four times as long."""
    mesh = cpu_mesh(tp=1)
    x = put(mesh, jnp.ones((8,), jnp.float32), P())

    def per_op(seconds):
        return timer(_sleeping_op(seconds), [x], mesh=mesh, in_specs=(P(),), k1=2, k2=6,
                     reps=3, warmup=1).median_s

    short, long = per_op(0.010), per_op(0.040)
    assert 0.0095 <= short <= 0.014, short
    assert 3.3 <= long / short <= 4.3, (short, long)


def test_a_known_cost_is_measured_as_such():
    _check_known_costs(time_per_op)


def test_a_loops_fixed_cost_cancels_and_its_arguments_are_fresh():
    """loop_step_us of a loop that sleeps 20 ms once and 5 ms a step is 5
    ms a step, and every run gets arguments made for it alone."""
    import time

    made, used = [], []

    def loop(k):
        def run(token):
            used.append(token)
            time.sleep(0.020 + 0.005 * k)
        return run

    def fresh_args():
        made.append(object())
        return (made[-1],)

    steps = loop_step_us(loop, fresh_args, steps=(2, 6), reps=3)
    assert len(steps) == 3 and steps == sorted(steps)
    assert 4500 <= steps[1] <= 7000, steps
    assert used == made and len(set(map(id, used))) == len(used) == 2 + 2 * 3


def test_a_timer_that_skips_the_op_fails_the_check(monkeypatch):
    """The mutant: loops that never call the op. The check above must catch it."""
    from jax_flashoverlap import benchmarking

    real = benchmarking.looped
    monkeypatch.setattr(benchmarking, "looped",
                        lambda op, *a, **k: real(lambda *xs: xs[0], *a, **k))
    with pytest.raises(AssertionError):
        _check_known_costs(benchmarking.time_per_op)


def test_interleaved_estimates_of_known_costs():
    """Each op gets one estimate a repetition; a 10 ms op measures 10 ms and
    one four times as long, four times it, repetition by repetition."""
    import statistics

    mesh = cpu_mesh(tp=1)
    x = put(mesh, jnp.ones((8,), jnp.float32), P())
    t = time_interleaved({"short": _sleeping_op(0.010), "long": _sleeping_op(0.040)}, [x],
                         mesh=mesh, in_specs=(P(),), k1=2, k2=6, reps=3, warmup=1)
    assert sorted(t) == ["long", "short"] and all(len(v) == 3 for v in t.values())
    assert 0.0095 <= statistics.median(t["short"]) <= 0.014, t
    assert 3.3 <= statistics.median(a / b for a, b in zip(t["long"], t["short"])) <= 4.3, t
    with pytest.raises(ValueError, match="need 0 < k1 < k2, got k1=3, k2=3"):
        time_interleaved({"short": _sleeping_op(0.010)}, [x], mesh=mesh, in_specs=(P(),),
                         k1=3, k2=3)


def test_first_devices_mesh_takes_what_there_is():
    import jax

    count = len(jax.devices())
    assert first_devices_mesh(2).devices.tolist() == jax.devices()[:2]
    with pytest.raises(ValueError, match=rf"--devices {count + 1}: only {count} devices here"):
        first_devices_mesh(count + 1)


def test_an_executable_from_the_persistent_cache_compares_equal_to_a_fresh_one(tmp_path, rng):
    """JAX's persistent compilation cache gives back an executable whose HLO
    text has no source-location tables: comparable_hlo must not see them."""
    from jax.experimental.compilation_cache import compilation_cache

    x = jnp.asarray(random(rng, (64, 32), "float32"))
    saved = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_enable_compilation_cache")}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
        program = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))
        fresh = program.lower(x).compile()
        assert any(tmp_path.iterdir()), "nothing was written to the cache"
        jax.clear_caches()
        cached = program.lower(x).compile()
        assert comparable_hlo(cached) == comparable_hlo(fresh)
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def test_hlo_without_source_location_tables_compares_equal(rng):
    """An executable read back from the cache in another process may print
    no source-location tables at all (nor the blank lines around them)."""
    import re
    import types

    x = jnp.asarray(random(rng, (16, 8), "float32"))
    text = jax.jit(lambda x: jnp.tanh(x @ x.T)).lower(x).compile().as_text()
    assert "\nStackFrames\n" in text
    bare = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*\n*", "",
                  text, flags=re.M)
    assert "StackFrames" not in bare and bare != text
    as_compiled = lambda t: types.SimpleNamespace(as_text=lambda: t)  # noqa: E731
    assert comparable_hlo(as_compiled(bare)) == comparable_hlo(as_compiled(text))
