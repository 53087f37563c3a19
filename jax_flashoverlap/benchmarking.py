"""The project's timing protocol, for benchmarks and the demo.

Per-op time = (T(k2) - T(k1)) / (k2 - k1), where T(k) is the wall time of a
jitted shard_map running k dependent iterations of the op in a
``lax.fori_loop``: dispatch and launch overheads cancel. Each iteration passes
its operands through an ``optimization_barrier`` together with the loop carry
and materialises the whole result, so XLA can neither hoist the op out of the
loop nor shrink it to the few elements read afterwards (custom calls get no
such shortcuts, so without the barriers the comparison flatters XLA).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import settings as environment

__all__ = ["Timing", "time_per_op", "time_interleaved", "first_devices_mesh", "looped",
           "loop_step_us", "median_ratio", "comparable_hlo", "gemm_autotune_setting",
           "provenance", "hbm_tb_s"]

# Where the protocol above is written down, for the results' metadata.
PROTOCOL = "jax_flashoverlap/benchmarking.py (module docstring)"
# The HBM bandwidth the decode floors divide by, TB/s: the H200's datasheet
# HBM3e, and the default of the probes that run on it.
H200_HBM_TB_S = 4.8
# Datasheet HBM bandwidths, TB/s, by a pattern of jax's device_kind: first
# match wins (the H100's PCIe and NVL forms before the SXM's plain name).
HBM_TB_S_BY_DEVICE = (
    (re.compile(r"H200"), H200_HBM_TB_S),
    (re.compile(r"H100.*PCIe"), 2.0),
    (re.compile(r"H100.*NVL"), 3.9),
    (re.compile(r"H100"), 3.35),
    (re.compile(r"A100.*80GB"), 2.039),
    (re.compile(r"A100"), 1.555),
    (re.compile(r"B200"), 8.0),
)


def hbm_tb_s(device_kind: str) -> float | None:
    """The datasheet HBM bandwidth (TB/s) of a GPU named by jax's
    ``device_kind`` (e.g. "NVIDIA H100 80GB HBM3"), or None for a GPU this
    table does not know."""
    for pattern, tb_s in HBM_TB_S_BY_DEVICE:
        if pattern.search(device_kind):
            return tb_s
    return None


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-op seconds: the median of ``reps`` paired estimates and their range."""

    median_s: float
    min_s: float
    max_s: float
    reps: int

    @classmethod
    def of(cls, estimates: Sequence[float]) -> Timing:
        """The Timing of per-op estimates in seconds (e.g. one op's of
        :func:`time_interleaved`)."""
        ordered = sorted(estimates)
        return cls(statistics.median(ordered), ordered[0], ordered[-1], len(ordered))

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6

    def spread(self) -> float:
        """(max - min) / median of the per-op estimates."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else float("inf")


def first_devices_mesh(count: int | None = None, axis_name: str = "tp") -> jax.sharding.Mesh:
    """A one-axis mesh over the first ``count`` devices (default: all).

    Raises:
      ValueError: there are fewer than ``count`` devices.
    """
    devices = jax.devices()
    if count is not None and count > len(devices):
        raise ValueError(f"--devices {count}: only {len(devices)} devices here")
    return jax.sharding.Mesh(np.asarray(devices[:count]), (axis_name,))


def looped(op: Callable[..., jax.Array], mesh, in_specs, k: int, unroll: int = 1):
    """A jitted shard_map running ``k`` dependent calls of ``op`` in a
    ``fori_loop`` (the protocol's loop, also what a profiler trace of
    ``k`` calls should run). ``op`` returns an array or a pytree of them
    (gradients), each materialised whole. Returns a function of the global
    ``args`` that yields a scalar."""
    def body(_, carry):
        args, acc = lax.optimization_barrier(carry)
        results = jax.tree.leaves(lax.optimization_barrier(op(*args)))
        return args, acc + sum(y.reshape(-1)[0].astype(jnp.float32) for y in results)

    def per_device(*args):
        _, acc = lax.fori_loop(0, k, body, (args, jnp.zeros((), jnp.float32)), unroll=unroll)
        return acc

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=P(),
                                 check_vma=False))


def time_per_op(op: Callable[..., jax.Array], args: Sequence[jax.Array], *, mesh,
                in_specs, k1: int = 2, k2: int = 12, reps: int = 7,
                warmup: int = 2, unroll: int = 1,
                compiler_options: dict | None = None) -> Timing:
    """Times ``op`` (a per-device function, run inside shard_map) per call.

    Args:
      op: ``op(*per_device_args) -> array`` (or a pytree of arrays); its
        result is fully materialised.
      args: global arrays, sharded as ``in_specs`` says.
      mesh: the device mesh.
      in_specs: shard_map in_specs of ``args``.
      k1, k2: the two loop lengths whose difference is timed.
      reps: paired repetitions; the median is reported.
      warmup: untimed runs of each loop first (compilation, autotuning).
      unroll: ops per loop iteration (``fori_loop``'s ``unroll``). With 1,
        XLA's host runs every iteration, which bounds the time of a
        microsecond-scale op; with several, XLA can replay the body as one
        CUDA graph, as it does in a model whose layer holds several ops.
      compiler_options: XLA options for both loops, as
        ``jax.stages.Lowered.compile`` takes them (e.g.
        ``{"xla_gpu_graph_min_graph_size": 1}`` to replay each iteration as
        a CUDA graph); time the baseline with the same options.

    Returns:
      A :class:`Timing`.
    """
    return Timing.of(time_interleaved({"op": op}, args, mesh=mesh, in_specs=in_specs, k1=k1,
                                      k2=k2, reps=reps, warmup=warmup, unroll=unroll,
                                      compiler_options=compiler_options)["op"])


def time_interleaved(ops: dict[str, Callable[..., jax.Array]], args: Sequence[jax.Array], *,
                     mesh, in_specs, k1: int = 2, k2: int = 12, reps: int = 7,
                     warmup: int = 2, unroll: int = 1,
                     compiler_options: dict | None = None) -> dict[str, list[float]]:
    """Per-op seconds of several ops, their estimates taken in turn.

    :func:`time_per_op`'s estimate, but each repetition times every op once,
    one after another (starting with a different op each time), so that a
    slow spell of the machine (other processes, clocks) falls on all of them
    alike. Compare two ops by the median of
    their per-repetition ratios (:func:`median_ratio`): on 8 CPU devices that share cores, "auto"
    timed by its own :func:`time_per_op` calls came out 0.81 to 1.37 times
    the fastest impl although it compiles to one of their programs.

    Args:
      ops: name -> ``op(*per_device_args)``, as :func:`time_per_op` takes it.
      args, mesh, in_specs, k1, k2, reps, warmup, unroll, compiler_options: as
        :func:`time_per_op`'s.

    Returns:
      name -> ``reps`` per-op estimates in seconds, in repetition order.
    """
    if not 0 < k1 < k2:
        raise ValueError(f"need 0 < k1 < k2, got k1={k1}, k2={k2}")
    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    loops = {name: {k: looped(op, mesh, in_specs, k, unroll) for k in (k1, k2)}
             for name, op in ops.items()}
    if compiler_options:
        loops = {name: {k: fn.lower(*args).compile(compiler_options) for k, fn in by_k.items()}
                 for name, by_k in loops.items()}
    for by_k in loops.values():
        for fn in by_k.values():
            for _ in range(warmup):
                fn(*args).block_until_ready()

    def wall(fn):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        return time.perf_counter() - start

    estimates = {name: [] for name in ops}
    names = list(ops)
    for rep in range(reps):
        # Each repetition starts with another op: none is always first.
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            by_k = loops[name]
            estimates[name].append((wall(by_k[k2]) - wall(by_k[k1])) / (k2 - k1))
    return estimates


def loop_step_us(loop: Callable[[int], Callable], fresh_args: Callable[[], tuple],
                 steps: tuple[int, int] = (8, 24), reps: int = 5) -> list[float]:
    """A step's time in a compiled loop of steps (a decode loop), in µs:
    (T(k2) - T(k1)) / (k2 - k1) for each of ``reps`` repetitions, sorted.

    Args:
      loop: ``loop(k)`` is a jitted function running k steps.
      fresh_args: the loop's arguments, made anew (outside the timing)
        before each run: a loop may donate them.
      steps: (k1, k2).
      reps: repetitions.
    """
    loops = {k: loop(k) for k in steps}

    def run(k):
        args = jax.block_until_ready(fresh_args())
        start = time.perf_counter()
        jax.block_until_ready(loops[k](*args))
        return time.perf_counter() - start

    for k in steps:
        run(k)  # compile, warm up
    k1, k2 = steps
    return sorted((run(k2) - run(k1)) / (k2 - k1) * 1e6 for _ in range(reps))


def median_ratio(estimates: Sequence[float], baseline: Sequence[float]) -> float:
    """How many times ``baseline`` an op took: the median over repetitions
    of their per-repetition ratio (two ops' lists of :func:`time_interleaved`)."""
    return statistics.median(a / b for a, b in zip(estimates, baseline, strict=True))


def comparable_hlo(compiled) -> str:
    """The optimized HLO text of ``compiled`` (a ``jax.stages.Compiled``)
    without what only names it or says where it came from: the module's
    name, each instruction's metadata, the source-location tables and blank
    lines. Two programs whose texts are equal run the same kernels; an
    executable read back from JAX's persistent compilation cache, whose
    tables may differ or be missing, compares equal to a fresh one."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", "",
                  text, flags=re.M)
    text = re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


def gemm_autotune_setting() -> str:
    """``JAX_FLASHOVERLAP_GEMM_AUTOTUNE`` as a benchmark's JSON records it:
    the value, or "unset (on)" (the extension autotunes by default)."""
    return environment.raw("JAX_FLASHOVERLAP_GEMM_AUTOTUNE") or "unset (on)"


def provenance(settings: dict | None = None) -> dict:
    """Where a result comes from, for a benchmark JSON's ``meta``.

    The commit is ``JFO_COMMIT`` where set (on a machine that runs a copy of
    the tree, whose ``.git`` may be missing or stale), else that of the git
    checkout the process runs in (with ``dirty`` when tracked files have
    changes), else None.

    Args:
      settings: the run's non-default settings (its flags).

    Returns:
      commit, dirty, date (UTC), devices (kind, count, platform), versions
      (jax, jaxlib, CUDA as the extension saw it), the protocol's location,
      the environment variables that change behaviour (``JAX_FLASHOVERLAP_*``,
      ``JFO_*``, ``XLA_FLAGS``) and ``settings``.
    """
    import jaxlib

    from ._extension import build_info

    commit, dirty = _git_commit()
    devices = jax.devices()
    env = environment.snapshot(("JAX_FLASHOVERLAP_", "JFO_", "XLA_FLAGS"))
    env.pop("JFO_COMMIT", None)
    return {
        "commit": commit, "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_kind": devices[0].device_kind, "devices": len(devices),
        "platform": devices[0].platform, "processes": jax.process_count(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "cuda": build_info().get("cuda_version"), "protocol": PROTOCOL,
        "environment": env, "settings": settings or {},
    }


def _git_commit() -> tuple[str | None, bool | None]:
    commit = environment.raw("JFO_COMMIT")
    if commit:  # a copy of the tree, whose .git may be stale
        return commit, None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10,
                                check=True).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None
