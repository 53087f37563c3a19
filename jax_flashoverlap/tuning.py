"""Tuning tables: what each implementation of each op measured on a machine.

``impl="auto"`` runs what was measured fastest on the machine it runs on
(:func:`jax_flashoverlap.dispatch.resolve` reads this module). A table holds
:class:`Entry` rows keyed by the machine (device kind and devices in the
process), the axis size, the dtype, the op and the shape measured. Two
sources, later ones winning for the same key and shape:

- tables shipped with the package (``jax_flashoverlap/tables/*.json``:
  2 H200s in one process, written by ``scripts/make_tuning_table.py`` from
  the committed benchmark results);
- the cache that ``jax-flashoverlap-tune`` writes on the user's machine,
  ``$XDG_CACHE_HOME/jax_flashoverlap/tuning.json`` (default
  ``~/.cache/jax_flashoverlap/tuning.json``).

A call matches the entries of its machine, axis size, dtype and op whose
rows per rank are in the largest power-of-two bucket not above its own (a
shape larger than every tuned one takes the largest's choice; a smaller one
has no entry and runs "xla"), and among those the nearest in weight size.
float16 calls use bfloat16 entries where float16 has none (same kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
from collections.abc import Iterable, Sequence

from . import cuda_policy, settings

__all__ = ["Entry", "Table", "cache_path", "load", "rows_per_rank", "size_of",
           "table_from_results", "VERSION"]

VERSION = 1
_TABLES = pathlib.Path(__file__).with_name("tables")

Shapes = Sequence[tuple[int, ...]]


def rows_per_rank(op: str, shapes: Shapes, n: int, itemsize: int) -> int:
    """The size a call is bucketed by: the rows of the GEMM each rank runs
    per block (:func:`jax_flashoverlap.cuda_policy.rows_per_rank`), or for
    all_reduce the message bytes per rank."""
    if op == "all_reduce":
        return math.prod(shapes[0]) * itemsize
    return cuda_policy.rows_per_rank(op, shapes, n)


def size_of(op: str, shapes: Shapes) -> int:
    """The second key within a bucket: weight elements k * n_out (0 for all_reduce)."""
    return 0 if op == "all_reduce" else shapes[1][0] * shapes[1][1]


def _bucket(value: int) -> int:
    return max(value, 1).bit_length() - 1  # floor(log2)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One measured shape of one op on one machine.

    Attributes:
      device_kind: ``jax.Device.device_kind`` ("NVIDIA H200", "cpu").
      devices: devices the measuring process's transport spans: its own, or
        its node's when the axis spans processes.
      axis_size: ranks of the op's axis.
      dtype: operand dtype name.
      op: the op.
      rows: :func:`rows_per_rank` of the measured shapes.
      weight: :func:`size_of` of the measured shapes.
      shape: (rows per rank, k, n_out), or (bytes per rank,) for all_reduce.
      times_us: impl -> measured µs per call.
      source: where the numbers come from (a results file, or the tune run).
      processes: processes the measured axis spans (1: one process drove
        every rank).
    """

    device_kind: str
    devices: int
    axis_size: int
    dtype: str
    op: str
    rows: int
    weight: int
    shape: tuple[int, ...]
    times_us: dict
    source: str
    processes: int = 1

    def key(self) -> tuple:
        return (self.device_kind, self.devices, self.processes, self.axis_size, self.dtype,
                self.op, self.rows, self.weight)

    def fastest(self, impls: Iterable[str]) -> str | None:
        """The measured-fastest of ``impls`` (None: none of them measured)."""
        times = {i: t for i, t in self.times_us.items() if i in set(impls)}
        return min(times, key=times.get) if times else None

    def describe(self) -> str:
        times = ", ".join(f"{impl} {t:.1f} µs" for impl, t in
                          sorted(self.times_us.items(), key=lambda kv: kv[1]))
        shape = ("x".join(map(str, self.shape)) if self.op != "all_reduce"
                 else f"{self.shape[0]} bytes")
        across = f" in {self.processes} processes" if self.processes > 1 else ""
        return (f"measured on {self.device_kind} x{self.devices}{across}, "
                f"axis size {self.axis_size}, "
                f"{self.dtype} {self.op} {shape}: {times} ({self.source})")

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> Entry:
        return cls(**(d | {"shape": tuple(d["shape"]), "times_us": dict(d["times_us"])}))


class Table:
    """Entries of any machines, looked up per call."""

    def __init__(self, entries: Iterable[Entry] = ()):
        self._entries: dict[tuple, Entry] = {}
        for e in entries:
            self._entries[e.key()] = e

    @property
    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def merged(self, other: Table) -> Table:
        """This table with ``other``'s entries replacing those of the same key."""
        return Table([*self.entries, *other.entries])

    def has_machine(self, device_kind: str, devices: int, processes: int = 1) -> bool:
        return any((e.device_kind, e.devices, e.processes) == (device_kind, devices, processes)
                   for e in self._entries.values())

    def lookup(self, op: str, shapes: Shapes, dtype: str, n: int, device_kind: str,
               devices: int, itemsize: int, processes: int = 1) -> tuple[Entry | None, str]:
        """The entry that decides a call, or None and why there is none.

        ``processes``: how many processes the call's axis spans; an entry
        measured in one process does not decide for an axis across processes.
        """
        if not self.has_machine(device_kind, devices, processes):
            across = f" with the axis across {processes} processes" if processes > 1 else ""
            return None, f"no tuning table for {device_kind} x{devices}{across}"
        dtypes = [dtype] + (["bfloat16"] if dtype == "float16" else [])
        for name in dtypes:
            same = [e for e in self._entries.values()
                    if (e.device_kind, e.devices, e.processes, e.axis_size, e.dtype, e.op)
                    == (device_kind, devices, processes, n, name, op)]
            if same:
                break
        else:
            return None, (f"{op} not tuned on {device_kind} x{devices} for axis size {n}, "
                          f"{dtype}")
        rows = _bucket(rows_per_rank(op, shapes, n, itemsize))
        below = [e for e in same if _bucket(e.rows) <= rows]
        if not below:
            smallest = min(same, key=lambda e: e.rows)
            unit = "bytes" if op == "all_reduce" else "rows per rank"
            return None, (f"smaller than every tuned {op} shape (smallest: {smallest.rows} "
                          f"{unit})")
        top = max(_bucket(e.rows) for e in below)
        weight = math.log2(max(size_of(op, shapes), 1))
        return min((e for e in below if _bucket(e.rows) == top),
                   key=lambda e: (abs(math.log2(max(e.weight, 1)) - weight), e.rows)), ""

    def to_json(self) -> dict:
        return {"version": VERSION, "entries": [e.to_json() for e in self.entries]}

    @classmethod
    def from_json(cls, d: dict, where: str = "table") -> Table:
        if d.get("version") != VERSION:
            raise ValueError(f"{where}: tuning table version {d.get('version')!r}, this "
                             f"jax_flashoverlap reads version {VERSION}; rerun "
                             f"jax-flashoverlap-tune")
        return cls(Entry.from_json(e) for e in d["entries"])


def cache_path() -> pathlib.Path:
    """Where ``jax-flashoverlap-tune`` writes, and "auto" reads, this user's table."""
    base = settings.raw("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jax_flashoverlap" / "tuning.json"


def read(path: str | os.PathLike) -> Table:
    with open(path) as f:
        return Table.from_json(json.load(f), str(path))


@functools.cache
def _load(cache: str) -> Table:
    table = Table()
    for path in sorted(_TABLES.glob("*.json")):
        table = table.merged(read(path))
    if os.path.exists(cache):
        table = table.merged(read(cache))
    return table


def load() -> Table:
    """The shipped tables merged with this user's cache (read once per path)."""
    return _load(str(cache_path()))


def reload() -> None:
    """Forgets the tables read so far (after a tune run wrote the cache)."""
    _load.cache_clear()


def table_from_results(paths: Iterable[str | os.PathLike], *, devices: int | None = None,
                       all_reduce_unroll: bool = True) -> Table:
    """A table from benchmark JSON files (benchmarks/collective_matmul.py and
    benchmarks/all_reduce.py rows, bf16 unless their meta says otherwise).

    Collective-matmul rows give the times of "xla", "cuda" and "decomposed"
    per op and shape ([rows per rank, k, n_out]); all-reduce rows give "xla"
    (psum) and "cuda" (the row "auto" ran, the kernel "auto" picks by size),
    from the unrolled loops (several all-reduces per iteration, as in a
    model) unless ``all_reduce_unroll`` is False.
    """
    entries = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        meta, rows = doc.get("meta", {}), doc["rows"]
        kind = meta["device_kind"]
        count = devices or meta["devices"]
        dtype = meta.get("dtype", "bfloat16")
        times: dict[tuple, dict] = {}
        for r in rows:
            if "shape" in r:  # collective matmul
                if r["impl"] not in ("xla", "cuda", "decomposed"):
                    continue
                m, k, cols = r["shape"]
                key = (r["op"], m, k * cols, (m, k, cols))
                times.setdefault(key, {})[r["impl"]] = r["us"]
            else:  # all_reduce
                if (r.get("unroll", 1) > 1) != all_reduce_unroll:
                    continue
                impl = {"xla": "xla", "auto": "cuda"}.get(r["impl"])
                if impl is None:
                    continue
                key = ("all_reduce", r["size_bytes"], 0, (r["size_bytes"],))
                times.setdefault(key, {})[impl] = r["us"]
        for (op, rows_, weight, shape), t in times.items():
            if "xla" in t and len(t) > 1:
                entries.append(Entry(kind, count, meta["devices"], dtype, op, rows_, weight,
                                     shape, t, pathlib.Path(path).name))
    return Table(entries)
