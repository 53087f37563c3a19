"""jax_flashoverlap: communication/computation overlap for JAX.

Collective matmuls whose communication hides behind the GEMM (FlashOverlap)
and a low-latency all-reduce (NVRAR), as ops usable inside ``jax.shard_map``
and ``jax.jit``; :mod:`jax_flashoverlap.sharded` has the global-array forms.
"""

# _checkout first: run from a checkout's root, it joins the installed package.
# _module_loading next: its import sets CUDA_MODULE_LOADING before anything
# can start JAX's backends.
from . import _checkout  # noqa: F401  # isort: skip
from . import _module_loading, schedule, settings, sharded  # noqa: F401
from ._extension import build_info, check_device_errors
from ._validation import IMPLS
from .all_gather_matmul import all_gather_matmul
from .all_reduce import all_reduce
from .decode_matmul import decode_matmul
from .faults import reset
from .matmul_all_reduce import matmul_all_reduce
from .matmul_reduce_scatter import matmul_reduce_scatter

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "all_reduce",
    "decode_matmul",
    "IMPLS",
    "build_info",
    "check_device_errors",
    "reset",
    "schedule",
    "sharded",
]

__version__ = "0.1.0"


def _cli_command() -> str | None:
    """The package's command this process runs (jax-flashoverlap-train, ...), or None."""
    import os
    import sys

    if os.path.basename(sys.argv[0] if sys.argv else "").startswith("jax-flashoverlap-"):
        return os.path.basename(sys.argv[0])
    args = getattr(sys, "orig_argv", [])  # `python -m jax_flashoverlap.cli.X`: argv[0] is "-m" yet
    for flag, module in zip(args, args[1:]):
        if flag == "-m" and module.startswith("jax_flashoverlap.cli."):
            return "jax-flashoverlap-" + module.rsplit(".", 1)[1]
    return None


try:
    settings.check_all()  # a bad environment variable fails here, naming itself
except ValueError as e:
    # Under one of the commands: their one-line error, not a traceback of this import.
    if _command := _cli_command():
        import sys

        print(f"{_command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise
