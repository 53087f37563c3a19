"""FlashOverlap schedules as plain data.

A schedule says, for every rank of an ``n``-rank group and every step, which
block of the output that rank computes and which transfers run while it does.
The pure-JAX implementation (:mod:`jax_flashoverlap.decomposed`) executes these
steps with ``ppermute``; the CUDA kernels receive the same plan as FFI
attributes (:meth:`CollectiveMatmulSchedule.order`), so both paths run one
ordering that is written, and checked, once.

The point of every ordering here is the FlashOverlap rule: the step that needs
no communication sits where the communication tail would otherwise be.

* AllGather→GEMM: a rank computes its own shard first (it needs nothing), then
  each shard as it arrives. The last transfer lands before the last compute
  step, so no transfer follows the last GEMM.
* GEMM→ReduceScatter: a rank computes the partial products other ranks own
  first and ships each as soon as it is done; its own block comes last, so
  after the last GEMM only an elementwise sum of received partials remains.
* GEMM→AllReduce: no order makes the last output need no communication, so
  the rows are cut into chunks of shrinking size (:func:`all_reduce_chunk_rows`)
  and only the small last chunk is exposed.

Topologies:

* ``"ring"``: each step moves one shard to the next rank (unidirectional).
* ``"bidirectional"``: every block is cut into two halves that travel in
  opposite directions round the ring, halving the bytes per link and step.
* ``"direct"``: every rank talks to every peer (all GPUs NVLink-connected);
  no forwarding, each shard moves exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import numpy as np

__all__ = [
    "Topology",
    "Work",
    "Transfer",
    "Step",
    "CollectiveMatmulSchedule",
    "all_gather_schedule",
    "reduce_scatter_schedule",
    "all_reduce_chunk_rows",
]

Topology = Literal["ring", "bidirectional", "direct"]
TOPOLOGIES: tuple[str, ...] = ("ring", "bidirectional", "direct")


@dataclasses.dataclass(frozen=True)
class Work:
    """One GEMM of one rank: output block ``block``, half ``part`` (0 or 1)."""

    block: int
    part: int = 0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """``src`` sends the data of (``block``, ``part``) to ``dst``.

    For all-gather the data is the input shard of ``block``; for
    reduce-scatter it is the (partially accumulated) partial product of the
    output block ``block``.
    """

    src: int
    dst: int
    block: int
    part: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    """What every rank does in one step.

    Attributes:
      compute: ``compute[r]`` is the tuple of :class:`Work` rank ``r`` does in
        this step (one entry, or two for the bidirectional topology).
      transfers: the transfers started in this step, after the step's
        compute of their source has been issued; their data is consumed in a
        later step.
    """

    compute: tuple[tuple[Work, ...], ...]
    transfers: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class CollectiveMatmulSchedule:
    """A complete plan for one collective matmul on ``n`` ranks.

    Attributes:
      kind: ``"all_gather"`` (AllGather→GEMM) or ``"reduce_scatter"``
        (GEMM→ReduceScatter).
      n: number of ranks.
      topology: one of :data:`TOPOLOGIES`.
      chunks: each :class:`Work` is executed as this many row chunks (each
        signalled separately), so a receiver can start on the first chunk of a
        block before the last one has landed. Does not change the step order.
      steps: the steps, in order.
    """

    kind: Literal["all_gather", "reduce_scatter"]
    n: int
    topology: Topology
    chunks: int
    steps: tuple[Step, ...]

    @property
    def parts(self) -> int:
        """Halves per block: 2 for the bidirectional topology, else 1."""
        return 2 if self.topology == "bidirectional" else 1

    def order(self) -> np.ndarray:
        """Per-rank compute order, the form the CUDA kernels take.

        Returns:
          int32 array ``[n, n * parts]``: row ``r`` lists the blocks rank ``r``
          computes, in order (for the bidirectional topology, part 0 and part 1
          of a step are listed in that order).
        """
        rows = [[w.block for step in self.steps for w in step.compute[r]]
                for r in range(self.n)]
        return np.asarray(rows, dtype=np.int32).reshape(self.n, -1)

    def validate(self) -> None:
        """Checks the invariants every FlashOverlap schedule must satisfy.

        * Every rank computes every (block, part) exactly once.
        * Transfers go between distinct, valid ranks.
        * All-gather: a rank computes a foreign block only after that block's
          data reached it in an earlier step; its first step is its own shard;
          no transfer is started in the last step (no tail).
        * Reduce-scatter: a rank's last step is its own block; each block's
          partials reach its owner, and a partial is forwarded only after the
          forwarding rank added its own contribution; no transfer is started in
          the last step (only the local sum remains).

        Raises:
          ValueError: naming the first invariant that fails.
        """
        n, parts = self.n, self.parts
        want = sorted((b, p) for b in range(n) for p in range(parts))
        for r in range(n):
            got = sorted((w.block, w.part) for s in self.steps for w in s.compute[r])
            if got != want:
                raise ValueError(f"rank {r} computes {got}, expected each of {want} once")
        for t, step in enumerate(self.steps):
            for tr in step.transfers:
                if not (0 <= tr.src < n and 0 <= tr.dst < n and tr.src != tr.dst):
                    raise ValueError(f"step {t}: bad transfer {tr}")
        if self.steps[-1].transfers:
            raise ValueError("transfers in the last step leave a communication tail")
        if self.kind == "all_gather":
            self._validate_all_gather()
        else:
            self._validate_reduce_scatter()

    def _validate_all_gather(self) -> None:
        have = [{(r, p) for p in range(self.parts)} for r in range(self.n)]
        for t, step in enumerate(self.steps):
            for r in range(self.n):
                if t == 0 and any(w.block != r for w in step.compute[r]):
                    raise ValueError(f"rank {r} does not start with its own shard")
                for w in step.compute[r]:
                    if (w.block, w.part) not in have[r]:
                        raise ValueError(f"step {t}: rank {r} computes {w} before it arrived")
            for tr in step.transfers:
                if (tr.block, tr.part) not in have[tr.src]:
                    raise ValueError(f"step {t}: rank {tr.src} forwards {tr} it does not hold")
            for tr in step.transfers:
                have[tr.dst].add((tr.block, tr.part))

    def _validate_reduce_scatter(self) -> None:
        contributed = {(b, p): set() for b in range(self.n) for p in range(self.parts)}
        holder: dict[tuple[int, int], int | None] = {k: None for k in contributed}
        for t, step in enumerate(self.steps):
            for r in range(self.n):
                if t == len(self.steps) - 1 and any(w.block != r for w in step.compute[r]):
                    raise ValueError(f"rank {r} does not end with its own block")
                for w in step.compute[r]:
                    contributed[(w.block, w.part)].add(r)
            for tr in step.transfers:
                key = (tr.block, tr.part)
                if tr.src not in contributed[key]:
                    raise ValueError(f"step {t}: rank {tr.src} sends {tr} before computing it")
                holder[key] = tr.dst
        # Every rank computes every block (validate's first check): each
        # block has all n contributions, and must end at its owner.
        for b, p in contributed:
            if self.n > 1 and holder[(b, p)] != b:
                raise ValueError(f"block {b} part {p} ends at rank {holder[(b, p)]}, not its owner")
        if self.topology == "direct":
            for t, step in enumerate(self.steps):
                for tr in step.transfers:
                    if tr.dst != tr.block:
                        raise ValueError(f"step {t}: direct transfer {tr} does not go to the owner")


def _check_args(n: int, topology: str, chunks: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")


@functools.cache
def all_gather_schedule(n: int, topology: Topology = "ring",
                        chunks: int = 1) -> CollectiveMatmulSchedule:
    """The AllGather→GEMM schedule: own shard first, then each arriving one.

    Ring: at step ``t`` rank ``r`` computes shard ``(r - t) % n``, which it got
    from ``r - 1`` in step ``t - 1``, and forwards it to ``r + 1``.
    Bidirectional: part 0 of shard ``(r - t) % n`` (travelling forward) and
    part 1 of shard ``(r + t) % n`` (travelling backward).
    Direct: every rank pushes its shard to all peers in step 0 and computes
    ``r, r - 1, r - 2, ...``; shard ``r`` is sent first to the peer that needs
    it soonest, ``r + 1``.
    """
    _check_args(n, topology, chunks)
    steps = []
    for t in range(n):
        last = t == n - 1
        if topology == "ring":
            compute = tuple((Work((r - t) % n),) for r in range(n))
            transfers = () if last else tuple(
                Transfer(r, (r + 1) % n, (r - t) % n) for r in range(n))
        elif topology == "bidirectional":
            compute = tuple((Work((r - t) % n, 0), Work((r + t) % n, 1)) for r in range(n))
            transfers = () if last else tuple(
                tr for r in range(n) for tr in (
                    Transfer(r, (r + 1) % n, (r - t) % n, 0),
                    Transfer(r, (r - 1) % n, (r + t) % n, 1)))
        else:
            compute = tuple((Work((r - t) % n),) for r in range(n))
            transfers = () if t > 0 or n == 1 else tuple(
                Transfer(r, (r + k) % n, r) for k in range(1, n) for r in range(n))
        steps.append(Step(compute, transfers))
    sched = CollectiveMatmulSchedule("all_gather", n, topology, chunks, tuple(steps))
    sched.validate()
    return sched


@functools.cache
def reduce_scatter_schedule(n: int, topology: Topology = "ring",
                            chunks: int = 1) -> CollectiveMatmulSchedule:
    """The GEMM→ReduceScatter schedule: other ranks' blocks first, own last.

    Ring: the accumulator of block ``b`` starts at ``b + 1`` and travels
    forward, each rank adding its partial, ending at ``b``; so rank ``r``
    computes block ``(r - 1 - t) % n`` at step ``t`` (its own at ``t = n-1``).
    Bidirectional: part 1 travels backward, rank ``r`` computing block
    ``(r + 1 + t) % n`` of it.
    Direct: rank ``r`` computes ``r + 1, r + 2, ..., r`` and sends each
    partial straight to its owner once computed; the owner sums them.
    """
    _check_args(n, topology, chunks)
    steps = []
    for t in range(n):
        last = t == n - 1
        if topology == "ring":
            compute = tuple((Work((r - 1 - t) % n),) for r in range(n))
            transfers = () if last else tuple(
                Transfer(r, (r + 1) % n, (r - 1 - t) % n) for r in range(n))
        elif topology == "bidirectional":
            compute = tuple((Work((r - 1 - t) % n, 0), Work((r + 1 + t) % n, 1))
                            for r in range(n))
            transfers = () if last else tuple(
                tr for r in range(n) for tr in (
                    Transfer(r, (r + 1) % n, (r - 1 - t) % n, 0),
                    Transfer(r, (r - 1) % n, (r + 1 + t) % n, 1)))
        else:
            compute = tuple((Work((r + 1 + t) % n),) for r in range(n))
            transfers = () if last else tuple(
                Transfer(r, (r + 1 + t) % n, (r + 1 + t) % n) for r in range(n))
        steps.append(Step(compute, transfers))
    sched = CollectiveMatmulSchedule("reduce_scatter", n, topology, chunks, tuple(steps))
    sched.validate()
    return sched


def all_reduce_chunk_rows(m: int, chunks: int, *, ratio: float = 0.5,
                          align: int = 8) -> tuple[int, ...]:
    """Row counts for GEMM→AllReduce: chunk sizes that shrink the tail.

    Chunk ``i`` gets rows proportional to ``ratio**i``, rounded to ``align``
    rows, so the last chunk (whose all-reduce cannot be overlapped with any
    GEMM) is the smallest.

    Args:
      m: rows of the output.
      chunks: requested number of chunks (fewer are returned when ``m`` is
        too small to give each chunk at least ``align`` rows).
      ratio: size of each chunk relative to the one before, in (0, 1].
      align: row granularity of every chunk but the first.

    Returns:
      Positive row counts that sum to ``m``, the first the largest; all but
      the first (which takes the rounding remainder) are multiples of
      ``align`` and non-increasing.
    """
    if m < 1 or chunks < 1:
        raise ValueError(f"need m >= 1 and chunks >= 1, got m={m}, chunks={chunks}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    chunks = max(1, min(chunks, m // align))
    weights = np.asarray([ratio ** i for i in range(chunks)])
    tail = [max(align, int(round(m * w / weights.sum() / align)) * align)
            for w in weights[1:]]
    # Rounding can leave the first chunk smaller than the second: give it the
    # smallest chunks back until it is the largest.
    while tail and m - sum(tail) < tail[0]:
        tail.pop()
    return (m - sum(tail), *tail)
