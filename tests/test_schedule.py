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


@pytest.mark.parametrize("bad", [dict(n=0), dict(topology="mesh"), dict(chunks=0)])
def test_bad_arguments(bad):
    args = dict(n=4, topology="ring", chunks=1) | bad
    with pytest.raises(ValueError):
        schedule.all_gather_schedule(**args)


def test_order_is_int32_for_the_kernels():
    assert schedule.reduce_scatter_schedule(4, "direct").order().dtype == np.int32
