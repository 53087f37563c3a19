"""What the launcher runs in each process: the program, then an exit that does not wait.

    python -m jax_flashoverlap.cli._rank (script.py | -m module) [args...]

Python's normal exit runs ``jax.distributed``'s shutdown barrier, which waits
(300 s by default) for every other process. A rank that raised, or called
``sys.exit(3)``, would hold the whole job there until the coordination service
aborted every rank, and its own status would be lost. So a program that fails
ends here with ``os._exit(status)`` once its traceback is printed: the
launcher sees the failure at once, names the rank, and stops the others. A
program that succeeds exits as usual (the other ranks meet its barrier).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends a process with (a message: 1, printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _leave(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(argv: list[str]) -> None:
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py`
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv == ["-m"]:
        sys.exit("usage: python -m jax_flashoverlap.cli._rank (script.py | -m module) [args...]")
    try:
        _run(argv)
    except SystemExit as e:
        status = _exit_status(e.code)
        if status:
            _leave(status)
        raise
    except KeyboardInterrupt:
        traceback.print_exc()
        _leave(128 + signal.SIGINT)
    except BaseException:  # noqa: BLE001 - any failure ends the rank, printed
        traceback.print_exc()
        _leave(1)


if __name__ == "__main__":
    main()
