"""Starts n local processes of one program, wired together for ``jax.distributed``.

    python -m jax_flashoverlap.cli.launch -n 2 script.py [args...]
    python -m jax_flashoverlap.cli.launch -n 2 -m package.module [args...]

One process per GPU where there are GPUs (``CUDA_VISIBLE_DEVICES`` narrowed to
one device each, as NVSHMEM and XLA's multi-process GPU runtime want), else one
CPU process each. The program calls :func:`jax_flashoverlap.distributed.initialize`,
which reads what this launcher put in its environment:

    JAX_FLASHOVERLAP_COORDINATOR_ADDRESS  ``127.0.0.1:PORT``, served by process 0 on loopback only
    JAX_FLASHOVERLAP_PROCESS_ID           this process, 0 .. n-1
    JAX_FLASHOVERLAP_NUM_PROCESSES        n
    JAX_FLASHOVERLAP_LOCAL_RANK           index among the processes on this host
    JAX_FLASHOVERLAP_LOCAL_SIZE           processes on this host
    JAX_FLASHOVERLAP_NODE_SIZE            consecutive processes that form one "node" (--node-size)
    JAX_FLASHOVERLAP_PLATFORM             ``gpu`` or ``cpu``

With ``--share-gpu`` several processes share each visible GPU (rank r on GPU
r mod G), each with an equal slice of its memory: a way to run 2, 4 or 8 ranks
of the real kernels on one GPU, for tests; their timings mean nothing.
Without CUDA MPS their kernels take turns on the GPU, so every wait on a
peer lasts a time slice; ``--mps`` starts a private MPS daemon for the job
(its kernels then run side by side, each process with an equal share of
the SMs) and stops it at the end.

Every output line is prefixed ``[rank i]``. If a process exits non-zero or is
killed, the others get SIGTERM, then SIGKILL after ``--grace`` seconds, and the
launcher exits non-zero naming the rank; ``--timeout`` bounds the whole run
(exit 124). The launcher never starts a JAX backend: it must not touch the
GPUs it hands out (importing the package imports jax, which starts no
backend until first use).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from ..distributed import ENV
from .devices import without_cpu_device_count
from .flags import HelpFormatter

__all__ = ["ENV", "FORCED_ENV", "LOOPBACK_ENV", "main", "visible_gpus"]

# NVLink multicast (NVLS) must stay off on the shared machines, whatever the
# caller's environment says, so these are overwritten, not defaulted.
FORCED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}

# Every process runs on this host, so NCCL's and NVSHMEM's bootstrap sockets
# listen on the loopback interface (by default both pick a routable one);
# defaults only: a caller who names an interface keeps it.
LOOPBACK_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
}

# Launcher options that take a value; everything from the program on is the
# program's, even if it looks like a launcher option (as with `python -m`).
_VALUE_OPTIONS = {"-n", "--nproc", "--node-size", "--timeout", "--grace"}
# Of each shared GPU's memory, the part the processes on it split evenly.
_SHARED_MEMORY_FRACTION = 0.8
_EXIT_TIMEOUT = 124  # as timeout(1)
_POLL_S = 0.05


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this host lets us use, as ``CUDA_VISIBLE_DEVICES`` entries.

    Honours an existing ``CUDA_VISIBLE_DEVICES`` (so process i gets its i-th
    entry); otherwise counts ``nvidia-smi -L``. No GPU, no driver: ``[]``.
    """
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [s.strip() for s in env["CUDA_VISIBLE_DEVICES"].split(",") if s.strip()]
        # CUDA ignores everything from the first -1 on.
        return ids[:ids.index("-1")] if "-1" in ids else ids
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    # MIG instances are listed as indented lines under their GPU; count GPUs.
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in out.splitlines()))]


def _reserve_port() -> tuple[socket.socket, int]:
    """A loopback port held for process 0's coordinator, and the socket holding it.

    Bound (not listening) with SO_REUSEPORT, as gRPC binds its servers: the
    coordinator can bind it too, while any other program that does not ask
    for port sharing is refused it until :func:`_release_when_listening`
    closes the reservation.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def _release_when_listening(reservation: socket.socket, port: int,
                            children: list[subprocess.Popen]) -> None:
    """Closes ``reservation`` once the coordinator accepts connections (or
    every child has exited)."""
    try:
        while any(c.poll() is None for c in children):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(_POLL_S)
    finally:
        reservation.close()


def _child_pythonpath(env: Mapping[str, str]) -> str:
    """The parent's sys.path entries a fresh interpreter would lack, then PYTHONPATH.

    Makes the children find the package however the parent found it (a
    checkout as the working directory, a venv, PYTHONPATH). The interpreter's
    own entries (stdlib, site-packages, .pth additions) are left out, so that
    they keep their usual order behind PYTHONPATH; asking a fresh interpreter
    is the one reliable way to know them (~20 ms).
    """
    probe = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    try:
        own = set(subprocess.run(
            [sys.executable, "-c", "import sys; print('\\n'.join(sys.path[1:]))"],
            env=probe, capture_output=True, text=True, timeout=30, check=True,
        ).stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        own = set()  # then pass everything: duplicates are harmless
    entries = []
    for p in sys.path:
        p = os.path.abspath(p or os.curdir)
        if p not in own and os.path.isdir(p) and p not in entries:
            entries.append(p)
    entries += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in entries]
    return os.pathsep.join(entries)


def _child_env(base: Mapping[str, str], *, rank: int, nproc: int, node_size: int,
               port: int, gpu: str | None, pythonpath: str, per_gpu: int = 1,
               mps_dir: str | None = None) -> dict[str, str]:
    env = dict(base)
    env.update({
        ENV["coordinator"]: f"127.0.0.1:{port}",
        ENV["process_id"]: str(rank),
        ENV["num_processes"]: str(nproc),
        ENV["local_rank"]: str(rank),
        ENV["local_size"]: str(nproc),
        ENV["node_size"]: str(node_size),
        ENV["platform"]: "cpu" if gpu is None else "gpu",
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",  # lines reach us before a crash or a kill
    })
    env.update(FORCED_ENV)
    for name, value in LOOPBACK_ENV.items():
        env.setdefault(name, value)
    if gpu is None:
        env["JAX_PLATFORMS"] = "cpu"
        # One CPU device per process: drop a device count inherited from the
        # caller (the test suite's conftest asks for 8).
        env["XLA_FLAGS"] = without_cpu_device_count(env.get("XLA_FLAGS", ""))
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if per_gpu > 1:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                       f"{_SHARED_MEMORY_FRACTION / per_gpu:.3f}")
    if mps_dir is not None:
        env["CUDA_MPS_PIPE_DIRECTORY"] = os.path.join(mps_dir, "pipe")
        env["CUDA_MPS_LOG_DIRECTORY"] = os.path.join(mps_dir, "log")
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(100 // per_gpu, 1))
    return env


def _die_with_parent_hook():
    """A pre-exec hook that has the kernel SIGKILL the child when the launcher dies.

    Without it a launcher killed by SIGKILL (or the OOM killer) would leave its
    children waiting on each other. Resolved here, before forking, so that the
    hook itself only makes one system call. None where there is no prctl.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the launcher's own teardown still applies
    parent = os.getpid()

    def hook():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before the line above
            os._exit(1)
    return hook


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Copies a child's stream to ``out`` line by line, each line prefixed."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with lock:
            out.write(prefix + (line if line.endswith("\n") else line + "\n"))
            out.flush()
    stream.close()


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits at the program: (launcher options, [-m] program and its arguments)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if arg == "-m" or not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in _VALUE_OPTIONS else 1
    return list(argv), []


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_flashoverlap.cli.launch",
        formatter_class=HelpFormatter,
        usage="%(prog)s -n N [options] (script.py | -m module) [args...]",
        description="Start N local processes for jax.distributed, one per GPU "
                    "(or CPU processes without GPUs).")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--node-size", type=int, default=None,
                   help="consecutive processes forming one node (None: N); "
                        "--node-size 1 makes every GPU its own node")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill everything after this many seconds (exit 124)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when tearing down")
    p.add_argument("--cpu", action="store_true", help="CPU processes even if there are GPUs")
    p.add_argument("--share-gpu", action="store_true",
                   help="allow more processes than GPUs: rank r runs on GPU r mod G, with "
                        "an equal slice of its memory (for tests: timings mean nothing)")
    p.add_argument("--mps", action="store_true",
                   help="with --share-gpu: run the job under a private CUDA MPS daemon, "
                        "started here and stopped at the end")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns its exit status (the failing rank's, 124 on timeout)."""
    parser = _parser()
    own, program = _split_argv(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    if not program or program == ["-m"]:
        parser.error("missing the program: a script path or -m module")
    n = args.nproc
    node_size = n if args.node_size is None else args.node_size
    if n < 1:
        parser.error(f"-n must be at least 1, got {n}")
    if node_size < 1 or n % node_size:
        parser.error(f"--node-size {node_size} must be >= 1 and divide -n {n} "
                     f"(e.g. --node-size 1 for one node per process)")
    gpus = [] if args.cpu else visible_gpus()
    if gpus and n > len(gpus) and not args.share_gpu:
        parser.error(f"-n {n} processes but only {len(gpus)} GPUs visible "
                     f"({','.join(gpus)}); use at most {len(gpus)}, --share-gpu or --cpu")
    if args.mps and not (args.share_gpu and gpus):
        parser.error("--mps needs --share-gpu and a visible GPU")
    per_gpu = -(-n // len(gpus)) if gpus else 1
    mps = _MpsDaemon.start() if args.mps else None
    try:
        return _run(program, args, n, node_size, gpus, per_gpu, mps)
    finally:
        if mps is not None:
            mps.stop()


def _run(program: list[str], args: argparse.Namespace, n: int, node_size: int,
         gpus: list[str], per_gpu: int, mps: _MpsDaemon | None) -> int:
    """Starts the n processes and supervises them; returns the launcher's status."""
    reservation, port = _reserve_port()
    # Through _rank, so that a rank that fails exits at once with its status
    # instead of waiting in jax.distributed's shutdown barrier.
    cmd = [sys.executable, "-m", "jax_flashoverlap.cli._rank", *program]
    lock = threading.Lock()
    hook = _die_with_parent_hook()
    pythonpath = _child_pythonpath(os.environ)
    children: list[subprocess.Popen] = []
    # Spawn everything before starting any thread: the pre-exec hook is only
    # safe in a single-threaded parent.
    for rank in range(n):
        env = _child_env(os.environ, rank=rank, nproc=n, node_size=node_size, port=port,
                         gpu=gpus[rank % len(gpus)] if gpus else None, pythonpath=pythonpath,
                         per_gpu=per_gpu, mps_dir=None if mps is None else mps.directory)
        children.append(subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,  # own group: kill grandchildren too
            preexec_fn=hook))
    threading.Thread(target=_release_when_listening, args=(reservation, port, children),
                     daemon=True).start()
    pumps = []
    for rank, child in enumerate(children):
        for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[rank {rank}] ", lock),
                                 daemon=True)
            t.start()
            pumps.append(t)

    status = _supervise(children, args.timeout, args.grace, lock)
    for t in pumps:
        t.join(timeout=2.0)  # a grandchild that escaped its group may hold a pipe
    return status


class _MpsDaemon:
    """A private CUDA MPS control daemon (``nvidia-cuda-mps-control -d``) in its
    own directory: only processes given that directory use it."""

    def __init__(self, directory: str):
        self.directory = directory

    def env(self) -> dict[str, str]:
        return dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(self.directory, "pipe"),
                    CUDA_MPS_LOG_DIRECTORY=os.path.join(self.directory, "log"))

    @classmethod
    def start(cls) -> _MpsDaemon:
        import tempfile

        daemon = cls(tempfile.mkdtemp(prefix="jfo_mps_"))
        for sub in ("pipe", "log"):
            os.makedirs(os.path.join(daemon.directory, sub))
        try:
            subprocess.run(["nvidia-cuda-mps-control", "-d"], env=daemon.env(), check=True,
                           capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise SystemExit(f"launch: --mps: could not start nvidia-cuda-mps-control "
                             f"({type(e).__name__}: {e}); run without --mps") from None
        return daemon

    def stop(self) -> None:
        """Asks the daemon to quit, then removes its directory."""
        try:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=self.env(),
                           check=True, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"[launch] --mps: the MPS daemon did not stop ({type(e).__name__}: {e}); "
                  f"stop it with `echo quit | CUDA_MPS_PIPE_DIRECTORY="
                  f"{self.env()['CUDA_MPS_PIPE_DIRECTORY']} nvidia-cuda-mps-control`",
                  file=sys.stderr, flush=True)
            return
        shutil.rmtree(self.directory, ignore_errors=True)


def _say(lock: threading.Lock, msg: str) -> None:
    with lock:
        print(f"[launch] {msg}", file=sys.stderr, flush=True)


def _supervise(children: list[subprocess.Popen], timeout: float | None, grace: float,
               lock: threading.Lock) -> int:
    """Waits for the children; on a failure, timeout or signal tears them all down."""
    caught: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # Children run in their own sessions, so Ctrl-C no longer reaches them
        # directly: forward it by tearing down.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda s, _f: caught.append(s))
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        status = 0
        while True:
            codes = [c.poll() for c in children]
            failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank = failed[0]
                code = codes[rank]
                _say(lock, f"rank {rank} {_describe(code)}; stopping the other ranks")
                status = code if code > 0 else 128 - code
                break
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _say(lock, f"timed out after {timeout:g} s; stopping all ranks")
                status = _EXIT_TIMEOUT
                break
            if caught:
                _say(lock, f"got {signal.Signals(caught[0]).name}; stopping all ranks")
                status = 128 + caught[0]
                break
            time.sleep(_POLL_S)
        _teardown(children, grace, lock)
        for rank, child in enumerate(children):
            code = child.poll()
            _say(lock, f"rank {rank} " + ("is still running (gave up on it)" if code is None
                                          else _describe(code)))
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    # Only children not yet reaped: a reaped pid may already belong to someone else.
    if child.poll() is None:
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass


def _teardown(children: list[subprocess.Popen], grace: float, lock: threading.Lock) -> None:
    """SIGTERM to every running child's group, SIGKILL after ``grace``; bounded."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(c.poll() is None for c in children):
        time.sleep(_POLL_S)
    stubborn = [r for r, c in enumerate(children) if c.poll() is None]
    if stubborn:
        _say(lock, f"ranks {stubborn} ignored SIGTERM for {grace:g} s; sending SIGKILL")
        for r in stubborn:
            _signal_group(children[r], signal.SIGKILL)
        for r in stubborn:
            try:
                children[r].wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass  # uninterruptible (e.g. stuck in a driver call); reported as such


if __name__ == "__main__":
    sys.exit(main())
