import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_flashoverlap import schedule

ranks = st.integers(min_value=1, max_value=16)
topologies = st.sampled_from(schedule.TOPOLOGIES)
chunk_counts = st.integers(min_value=1, max_value=8)


@settings(max_examples=200, deadline=None)
@given(n=ranks, topology=topologies, chunks=chunk_counts)
def test_all_gather_invariants(n, topology, chunks):
    sched = schedule.all_gather_schedule(n, topology, chunks)
    sched.validate()  # also runs at construction; explicit here
    order = sched.order()
    assert order.shape == (n, n * sched.parts)
    for r in range(n):
        assert order[r, 0] == r, "the local shard must be computed first"
        for p in range(sched.parts):
            assert sorted(order[r, p::sched.parts]) == list(range(n))
    assert not sched.steps[-1].transfers


@settings(max_examples=200, deadline=None)
@given(n=ranks, topology=topologies, chunks=chunk_counts)
def test_reduce_scatter_invariants(n, topology, chunks):
    sched = schedule.reduce_scatter_schedule(n, topology, chunks)
    order = sched.order()
    for r in range(n):
        assert all(order[r, -sched.parts:] == r), "the own block must be computed last"
        for p in range(sched.parts):
            assert sorted(order[r, p::sched.parts]) == list(range(n))
    assert not sched.steps[-1].transfers


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=2, max_value=16), topology=topologies)
def test_direct_all_gather_moves_each_shard_once_per_peer(n, topology):
    sched = schedule.all_gather_schedule(n, topology)
    moved = [(tr.src, tr.dst, tr.block, tr.part) for s in sched.steps for tr in s.transfers]
    assert len(moved) == len(set(moved)) == n * (n - 1) * sched.parts


def _broken(sched, **changes):
    return dataclasses.replace(sched, **changes)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_validate_rejects_broken_schedules(n):
    ag = schedule.all_gather_schedule(n, "ring")
    # Own shard not first: swap the first two steps.
    with pytest.raises(ValueError):
        _broken(ag, steps=(ag.steps[1], ag.steps[0], *ag.steps[2:])).validate()
    # A block computed twice and another never.
    step0 = ag.steps[0]
    doubled = schedule.Step((step0.compute[0],) * n, step0.transfers)
    with pytest.raises(ValueError):
        _broken(ag, steps=(doubled, *ag.steps[1:])).validate()
    # A transfer in the last step is a tail.
    tail = schedule.Step(ag.steps[-1].compute, (schedule.Transfer(0, 1, 0),))
    with pytest.raises(ValueError):
        _broken(ag, steps=(*ag.steps[:-1], tail)).validate()
    rs = schedule.reduce_scatter_schedule(n, "direct")
    # Own block not last.
    with pytest.raises(ValueError):
        _broken(rs, steps=(rs.steps[-1], *rs.steps[:-1])).validate()
    # A partial sent to a rank that does not own it.
    wrong = schedule.Step(rs.steps[0].compute, tuple(
        dataclasses.replace(tr, dst=(tr.dst + 1) % n if n > 2 else tr.dst, block=tr.block)
        for tr in rs.steps[0].transfers))
    if n > 2:
        with pytest.raises(ValueError):
            _broken(rs, steps=(wrong, *rs.steps[1:])).validate()


def _steps(*steps):
    """Steps from (compute per rank as block ids, transfers as (src, dst, block))."""
    return tuple(schedule.Step(tuple(tuple(schedule.Work(b) for b in blocks)
                                     for blocks in compute),
                               tuple(schedule.Transfer(*t) for t in transfers))
                 for compute, transfers in steps)


def test_validate_names_each_broken_invariant():
    """Each schedule breaks one invariant; validate names that one."""
    ag = schedule.all_gather_schedule(3, "ring")
    rs = schedule.reduce_scatter_schedule(3, "ring")
    rs_direct = schedule.reduce_scatter_schedule(2, "direct")
    s0, s1, s2 = ag.steps
    r0, r1, r2 = rs.steps
    cases = [
        (_broken(ag, steps=(s1, s0, s2)), "rank 0 does not start with its own shard"),
        (_broken(ag, steps=(s0, schedule.Step(s2.compute, s1.transfers),
                            schedule.Step(s1.compute, ()))),
         r"step 1: rank 0 computes Work\(block=1, part=0\) before it arrived"),
        (_broken(ag, steps=(schedule.Step(s0.compute, s1.transfers),
                            schedule.Step(s1.compute, s0.transfers), s2)),
         r"step 0: rank 0 forwards Transfer\(src=0, dst=1, block=2, part=0\) it does not hold"),
        (_broken(ag, steps=(schedule.Step(s0.compute, (schedule.Transfer(0, 0, 0),)), s1, s2)),
         r"step 0: bad transfer Transfer\(src=0, dst=0"),
        (_broken(ag, steps=(s0, s1, schedule.Step(s2.compute, (schedule.Transfer(0, 1, 0),)))),
         "transfers in the last step leave a communication tail"),
        (_broken(ag, steps=(schedule.Step((s0.compute[0],) * 3, s0.transfers), s1, s2)),
         r"rank 1 computes \[\(0, 0\), \(0, 0\), \(2, 0\)\], expected each of"),
        (_broken(rs, steps=(schedule.Step(r0.compute, r1.transfers),
                            schedule.Step(r1.compute, r0.transfers), r2)),
         r"step 0: rank 0 sends Transfer\(src=0, dst=1, block=1, part=0\) before computing it"),
        (_broken(rs, steps=(r0, schedule.Step(r1.compute, r1.transfers[1:]), r2)),
         "block 1 part 0 ends at rank 0, not its owner"),
        # Rank 0 computes its own block first and never sends block 1 on.
        (_broken(rs_direct, steps=_steps((((0,), (0,)), ((1, 0, 0),)), (((1,), (1,)), ()))),
         "rank 0 does not end with its own block"),
        (_broken(schedule.reduce_scatter_schedule(3, "direct"), steps=_steps(
            (((1,), (2,), (0,)), ((0, 2, 1), (1, 2, 2), (2, 0, 0))),
            (((2,), (0,), (1,)), ((0, 2, 2), (1, 0, 0), (2, 1, 1))),
            (((0,), (1,), (2,)), ()))),
         r"step 0: direct transfer Transfer\(src=0, dst=2, block=1, part=0\) does not go to "
         r"the owner"),
    ]
    for broken, message in cases:
        with pytest.raises(ValueError, match=message):
            broken.validate()


@settings(max_examples=300, deadline=None)
@given(m=st.integers(min_value=1, max_value=20000), chunks=st.integers(min_value=1, max_value=16),
       ratio=st.floats(min_value=0.1, max_value=1.0))
def test_all_reduce_chunk_rows(m, chunks, ratio):
    rows = schedule.all_reduce_chunk_rows(m, chunks, ratio=ratio)
    assert sum(rows) == m
    assert all(r > 0 for r in rows)
    assert 1 <= len(rows) <= chunks
    tail = rows[1:]
    assert all(r % 8 == 0 for r in tail)
    assert all(a >= b for a, b in zip(tail, tail[1:])), "the tail must shrink"
    assert rows[-1] <= rows[0]


@pytest.mark.parametrize("bad, message", [
    (dict(n=0), "n must be a positive int, got 0"),
    (dict(topology="mesh"), r"topology must be one of \('ring', "),
    (dict(chunks=0), "chunks must be a positive int, got 0"),
])
def test_bad_arguments(bad, message):
    args = dict(n=4, topology="ring", chunks=1) | bad
    with pytest.raises(ValueError, match=message):
        schedule.all_gather_schedule(**args)


@pytest.mark.parametrize("args, message", [
    (dict(m=0, chunks=2), "need m >= 1 and chunks >= 1, got m=0, chunks=2"),
    (dict(m=64, chunks=0), "need m >= 1 and chunks >= 1, got m=64, chunks=0"),
    (dict(m=64, chunks=2, ratio=1.5), r"ratio must be in \(0, 1\], got 1.5"),
])
def test_bad_chunk_rows(args, message):
    with pytest.raises(ValueError, match=message):
        schedule.all_reduce_chunk_rows(**args)


def test_order_is_int32_for_the_kernels():
    assert schedule.reduce_scatter_schedule(4, "direct").order().dtype == np.int32
